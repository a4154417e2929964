// The diffusion-RL step on the SD3 test model shared by sd3_rl_worker (sharded, one prompt group
// per rank) and its unsharded reference in tests/test_diffusion_sd3.cpp.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/algos/diffusion_rl.h"
#include "workers/sd3_scenario.h"

namespace shardrl::testing {

constexpr int64_t kSD3RlGroup = 2;  // samples per prompt; each rank holds one group
constexpr uint64_t kSD3RlWindowSeed = 77;

inline at::Generator sd3_rl_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

// Rank `rank`'s prompt (random embeddings), repeated per sample, with the negative prompt.
inline algos::Conditioning sd3_rl_cond(int64_t rank) {
  const auto c = sd3_test_config();
  auto g = sd3_rl_generator(1000 + static_cast<uint64_t>(rank));
  algos::Conditioning cond;
  cond.prompt_embeds = at::randn({1, 5, c.joint_attention_dim}, g).repeat({kSD3RlGroup, 1, 1});
  cond.pooled_prompt_embeds = at::randn({1, c.pooled_projection_dim}, g).repeat({kSD3RlGroup, 1});
  cond.negative_prompt_embeds = torch::zeros_like(cond.prompt_embeds);
  cond.negative_pooled_prompt_embeds = torch::zeros_like(cond.pooled_prompt_embeds);
  return cond;
}

// CPS with CFG in a 2-step window drawn from [0, 3) of 4 steps.
inline algos::SamplerConfig sd3_rl_sampler() {
  algos::SamplerConfig s;
  s.num_inference_steps = 4;
  s.noise_level = 0.8;
  s.sde_type = "cps";
  s.sde_window_size = 2;
  s.sde_window_range = {0, 3};
  s.true_cfg_scale = 2.0;
  s.height = s.width = 8;
  return s;
}

inline algos::DiffusionRollout sd3_rl_rollout(models::SD3Transformer2DModel& model, int64_t rank) {
  const auto s = sd3_rl_sampler();
  // One window for every rank (a shared seed), noise of its own per rank.
  auto window = algos::draw_sde_window(s, sd3_rl_generator(kSD3RlWindowSeed));
  return algos::sample_with_logprob(model, sd3_rl_cond(rank), s, window,
                                    sd3_rl_generator(100 + static_cast<uint64_t>(rank)));
}

// The easy reward: mean brightness of each sample.
inline torch::Tensor sd3_rl_rewards(const algos::DiffusionRollout& rollout) {
  return rollout.images().flatten(1).mean(1);
}

inline algos::MicroBatchLoss sd3_rl_loss(models::SD3Transformer2DModel& model,
                                         const algos::DiffusionRollout& rollout,
                                         const torch::Tensor& advantages) {
  auto rows =
      algos::flow_grpo_rows(rollout, advantages, algos::flow_grpo_train_steps(rollout.window, 1.0));
  return algos::diffusion_loss(model, rows, algos::DiffusionLossConfig{}, sd3_rl_sampler());
}

}  // namespace shardrl::testing
