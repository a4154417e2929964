// The SD3 (MMDiT) flow-matching training scenario shared by sd3_worker and the in-process
// reference in tests/test_sd3.cpp, so both build the same model and see the same data.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/models/sd3.h"

namespace shardrl::testing {

struct SD3Scenario {
  int64_t steps = 3;
  int64_t batch = 4;  // global batch, split evenly over the ranks
  int64_t prompt_tokens = 5;
  double lr = 1e-3;
  uint64_t seed = 23;
};

// SD3.5-style (qk_norm rms_norm, a dual-attention block, the pre-only last block), small.
inline models::SD3Config sd3_test_config() {
  models::SD3Config c;
  c.sample_size = 8;
  c.patch_size = 2;
  c.in_channels = 2;
  c.num_layers = 3;
  c.attention_head_dim = 8;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 12;
  c.caption_projection_dim = 16;
  c.pooled_projection_dim = 10;
  c.out_channels = 2;
  c.pos_embed_max_size = 6;
  c.dual_attention_layers = {1};
  c.qk_norm = "rms_norm";
  return c;
}

// An adapter on every attention projection, as a diffusion RL run trains SD3.
inline models::lora::LoraConfig sd3_lora_config() {
  models::lora::LoraConfig c;
  c.r = 4;
  c.alpha = 8;
  c.target_modules = {"to_q",       "to_k",       "to_v",       "to_out.0",
                      "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"};
  return c;
}

inline models::SD3Transformer2DModel build_sd3(const SD3Scenario& s) {
  torch::manual_seed(s.seed);
  return models::SD3Transformer2DModel(sd3_test_config());
}

struct SD3Batch {
  torch::Tensor xt, prompt_embeds, pooled, timestep, target;
};

// Rectified flow on random latents: x_t = (1 - t) data + t noise at diffusers' timestep 1000 t,
// velocity target noise - data.
inline SD3Batch sd3_batch(const SD3Scenario& s, int64_t step) {
  const auto c = sd3_test_config();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 1000 + step);
  auto data = torch::randn({s.batch, c.in_channels, c.sample_size, c.sample_size}, gen);
  auto noise = torch::randn(data.sizes(), gen);
  auto prompt = torch::randn({s.batch, s.prompt_tokens, c.joint_attention_dim}, gen);
  auto pooled = torch::randn({s.batch, c.pooled_projection_dim}, gen);
  auto t = torch::rand({s.batch}, gen);
  auto tt = t.view({-1, 1, 1, 1});
  return {(1 - tt) * data + tt * noise, prompt, pooled, t * 1000, noise - data};
}

}  // namespace shardrl::testing
