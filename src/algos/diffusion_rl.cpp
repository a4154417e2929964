// Diffusion RL on a flow-matching transformer (models::FlowModel): text conditioning, the sampler,
// the rows of each algorithm's update and their per-micro-batch losses. The math is algos.h; this
// file runs the model and moves tensors into rows.
#include "shardrl/algos/diffusion_rl.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <sstream>

#include "algos/internal.h"

namespace shardrl::algos {

using internal::require;

namespace {

const char* const kPromptEmbeds = "prompt_embeds";
const char* const kPooled = "pooled_prompt_embeds";
const char* const kNegativeEmbeds = "negative_prompt_embeds";
const char* const kNegativePooled = "negative_pooled_prompt_embeds";
const char* const kMask = "prompt_embeds_mask";
const char* const kNegativeMask = "negative_prompt_embeds_mask";

// A column the caller must have put in the rows; the error names it and who needs it.
const torch::Tensor& column(const TensorMap& rows, const std::string& name,
                            const std::string& needed_by) {
  auto it = rows.find(name);
  require(it != rows.end() && it->second.defined(), name,
          fmt::format("missing column (needed by {})", needed_by));
  return it->second;
}

// [R] row indices repeating each of `n` samples `k` times: sample-major rows.
torch::Tensor repeat_each(int64_t n, int64_t k, const torch::Device& device) {
  return torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(device))
      .repeat_interleave(k);
}

// [P, ...] chosen and [P, ...] rejected -> [2P, ...] interleaved, as dpo_make_pairs orders pairs.
torch::Tensor interleave(const torch::Tensor& chosen, const torch::Tensor& rejected) {
  auto both = torch::stack({chosen, rejected}, 1);
  std::vector<int64_t> shape = both.sizes().vec();
  shape.erase(shape.begin());
  shape[0] = 2 * chosen.size(0);
  return both.reshape(shape);
}

// DiffusionNFT: the conditional velocity at (xt, t), no CFG (NFT trains the guidance-free model).
torch::Tensor nft_velocity(const models::FlowModel& model, const TensorMap& rows) {
  const std::string who = "the diffusion_nft loss";
  auto cond = Conditioning::from(rows);
  return model.velocity(column(rows, "xt", who), column(rows, "t", who), cond.text());
}

// Diffusion-DPO: both members of each pair noised with the pair's eps and sigma, interleaved.
struct DpoInputs {
  torch::Tensor xt, target;
  torch::Tensor sigma;  // [2P]
  Conditioning cond;    // per member
};

DpoInputs dpo_inputs(const TensorMap& rows) {
  const std::string who = "the dpo loss";
  auto x0 = interleave(column(rows, "chosen_x0", who), column(rows, "rejected_x0", who));
  auto eps = repeat_for_pairs(column(rows, "eps", who));
  auto sigma = repeat_for_pairs(column(rows, "sigma", who));
  auto pairs = Conditioning::from(rows);
  return {flow_interpolate(x0, eps, sigma), diffusion_target(x0, eps, "flow_matching"), sigma,
          pairs.index_select(repeat_each(pairs.size(), 2, x0.device()))};
}

// Both members' predictions in one forward, interleaved like the inputs.
torch::Tensor dpo_prediction(const models::FlowModel& model, const DpoInputs& in) {
  return model.velocity(in.xt, in.sigma, in.cond.text());
}

Metrics detached(std::initializer_list<std::pair<const char*, torch::Tensor>> values) {
  Metrics m;
  for (const auto& [name, value] : values) m.emplace(name, value.detach().to(torch::kFloat));
  return m;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Text conditioning

Conditioning Conditioning::from(const TensorMap& rows) {
  const std::string who = "the text conditioning";
  auto optional = [&](const char* name) {
    auto it = rows.find(name);
    return it == rows.end() ? torch::Tensor() : it->second;
  };
  Conditioning c;
  c.prompt_embeds = column(rows, kPromptEmbeds, who);
  c.pooled_prompt_embeds = optional(kPooled);
  c.prompt_embeds_mask = optional(kMask);
  const bool neg = rows.count(kNegativeEmbeds) > 0, neg_pooled = rows.count(kNegativePooled) > 0,
             neg_mask = rows.count(kNegativeMask) > 0;
  if (neg || neg_pooled || neg_mask) {
    // Half a negative prompt is a caller's bug, not "no CFG": it has what the positive one has.
    c.negative_prompt_embeds = column(rows, kNegativeEmbeds, who);
    if (c.pooled_prompt_embeds.defined() || neg_pooled) {
      c.negative_pooled_prompt_embeds = column(rows, kNegativePooled, who);
    }
    if (c.prompt_embeds_mask.defined() || neg_mask) {
      c.negative_prompt_embeds_mask = column(rows, kNegativeMask, who);
    }
  }
  return c;
}

void Conditioning::add_to(TensorMap& rows) const {
  const std::pair<const char*, const torch::Tensor*> columns[] = {
      {kPromptEmbeds, &prompt_embeds},
      {kPooled, &pooled_prompt_embeds},
      {kMask, &prompt_embeds_mask},
      {kNegativeEmbeds, &negative_prompt_embeds},
      {kNegativePooled, &negative_pooled_prompt_embeds},
      {kNegativeMask, &negative_prompt_embeds_mask}};
  for (const auto& [name, tensor] : columns) {
    if (tensor->defined()) rows[name] = *tensor;
  }
}

Conditioning Conditioning::index_select(const torch::Tensor& rows) const {
  auto pick = [&](const torch::Tensor& t) {
    return t.defined() ? t.index_select(0, rows.to(t.device())) : t;
  };
  return {pick(prompt_embeds),          pick(pooled_prompt_embeds),
          pick(negative_prompt_embeds), pick(negative_pooled_prompt_embeds),
          pick(prompt_embeds_mask),     pick(negative_prompt_embeds_mask)};
}

torch::Tensor flow_velocity(const models::FlowModel& model, const torch::Tensor& x,
                            const torch::Tensor& sigma, const Conditioning& cond,
                            double true_cfg_scale) {
  require(cond.size() == x.size(0), kPromptEmbeds,
          fmt::format("has {} rows for {} latents", cond.size(), x.size(0)));
  // diffusers' do_true_cfg: guidance only above 1.
  if (true_cfg_scale <= 1.0) return model.velocity(x, sigma, cond.text());
  require(
      cond.has_negative(), kNegativeEmbeds,
      fmt::format("required by true_cfg_scale {} > 1 (the unconditional branch)", true_cfg_scale));
  const int64_t b = x.size(0);
  auto s = sigma.to(x.device(), torch::kFloat).expand({b});
  auto both = [](const torch::Tensor& negative, const torch::Tensor& positive) {
    return positive.defined() ? torch::cat({negative, positive}) : positive;
  };
  const auto neg = cond.negative_text(), pos = cond.text();
  auto v = model.velocity(
      torch::cat({x, x}), torch::cat({s, s}),
      {both(neg.embeds, pos.embeds), both(neg.pooled, pos.pooled), both(neg.mask, pos.mask)});
  auto v_cond = v.narrow(0, b, b);
  return model.rescale_guidance(cfg_combine(v.narrow(0, 0, b), v_cond, true_cfg_scale), v_cond);
}

// ---------------------------------------------------------------------------------------------
// Supervised stage

MicroBatchLoss flow_matching_loss(const models::FlowModel& model, const TensorMap& rows,
                                  const FlowMatchingLossConfig& config, at::Generator generator) {
  require(config.caption_dropout >= 0 && config.caption_dropout <= 1, "caption_dropout",
          fmt::format("must be in [0, 1], got {}", config.caption_dropout));
  const auto& x0 = column(rows, "images", "the flow-matching loss");
  const int64_t b = x0.size(0);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(x0.device());
  auto sigma = internal::flow_matching_sigmas(config.timestep_sampling, b, generator, f32);
  auto eps = at::randn(x0.sizes(), generator, f32);
  auto cond = Conditioning::from(rows);
  auto text = cond.text();
  if (config.caption_dropout > 0) {
    require(cond.has_negative(), kNegativeEmbeds,
            "required by caption_dropout > 0 (the dropped captions' embedding)");
    auto drop = at::rand({b}, generator, f32) < config.caption_dropout;
    // A dropped caption is the negative prompt's every column: its embeddings, pooled and mask.
    auto dropped = [&](const torch::Tensor& positive, const torch::Tensor& negative) {
      if (!positive.defined()) return positive;
      std::vector<int64_t> shape(static_cast<size_t>(positive.dim()), 1);
      shape[0] = b;
      return torch::where(drop.view(shape), negative, positive);
    };
    const auto neg = cond.negative_text();
    text = {dropped(text.embeds, neg.embeds), dropped(text.pooled, neg.pooled),
            dropped(text.mask, neg.mask)};
  }
  auto v = model.velocity(flow_interpolate(x0, eps, sigma), sigma, text);
  auto loss = torch::mse_loss(v, diffusion_target(x0, eps, "flow_matching"));
  return {loss, detached({{"flow_matching_loss", loss}})};
}

// ---------------------------------------------------------------------------------------------
// Sampling

FlowMatchScheduler SamplerConfig::scheduler() const {
  return FlowMatchScheduler::create(num_inference_steps, shift);
}

void SamplerConfig::validate() const {
  const std::string pipeline = "actor_rollout_ref.rollout.pipeline.";
  const std::string algo = "actor_rollout_ref.rollout.algo.";
  require(num_inference_steps >= 1, pipeline + "num_inference_steps",
          fmt::format("must be >= 1, got {}", num_inference_steps));
  require(shift > 0, pipeline + "shift", fmt::format("must be > 0, got {}", shift));
  require(noise_level >= 0, algo + "noise_level", fmt::format("must be >= 0, got {}", noise_level));
  if (sde_type != "sde" && sde_type != "cps" && sde_type != "dance_sde") {
    internal::throw_unknown_value(algo + "sde_type", sde_type, {"sde", "cps", "dance_sde"});
  }
  if (sample_strategy != "random" && sample_strategy != "progressive") {
    internal::throw_unknown_value(algo + "sample_strategy", sample_strategy,
                                  {"random", "progressive"});
  }
  require(iters_per_group >= 1, algo + "iters_per_group",
          fmt::format("must be >= 1, got {}", iters_per_group));
  if (!mix_grpo) {
    // verl-omni reads them in its MixGRPO pipeline only; elsewhere they would silently not act.
    require(sample_strategy == "random", algo + "sample_strategy",
            "'progressive' slides MixGRPO's window: it needs actor_rollout_ref.model.algorithm "
            "mix_grpo");
    require(iters_per_group == 1, algo + "iters_per_group",
            "paces MixGRPO's progressive window: it needs actor_rollout_ref.model.algorithm "
            "mix_grpo");
  } else {
    require(sde_window_size > 0, algo + "sde_window_size",
            "MixGRPO (actor_rollout_ref.model.algorithm mix_grpo) moves a window of this size: "
            "it must be set");
  }
  require(true_cfg_scale >= 1, pipeline + "true_cfg_scale",
          fmt::format("must be >= 1 (1: no CFG), got {}", true_cfg_scale));
  require(height >= 1, pipeline + "height", fmt::format("must be >= 1, got {}", height));
  require(width >= 1, pipeline + "width", fmt::format("must be >= 1, got {}", width));
  require(sde_window_size >= 0 && sde_window_size <= num_inference_steps, algo + "sde_window_size",
          fmt::format("must be in [0, num_inference_steps = {}] (0: null), got {}",
                      num_inference_steps, sde_window_size));
  if (sde_window_size > 0) {
    const auto [first, last_raw] = sde_window_range;
    const int64_t last = last_raw < 0 ? num_inference_steps : last_raw;
    require(first >= 0 && last <= num_inference_steps && last - first >= sde_window_size,
            algo + "sde_window_range",
            fmt::format("[{}, {}) must lie in [0, num_inference_steps = {}] and hold "
                        "sde_window_size = {} steps",
                        first, last_raw, num_inference_steps, sde_window_size));
  }
}

int64_t python_random_randint(int64_t seed, int64_t low, int64_t high) {
  require(low <= high, "high", fmt::format("empty range [{}, {}]", low, high));
  // CPython's random_seed: the key is |seed| in 32-bit words, least significant first.
  uint64_t n = seed < 0 ? static_cast<uint64_t>(-(seed + 1)) + 1 : static_cast<uint64_t>(seed);
  std::vector<uint32_t> key;
  do {
    key.push_back(static_cast<uint32_t>(n & 0xffffffffu));
    n >>= 32;
  } while (n != 0);
  // init_by_array of the MT19937 reference code, which CPython's _randommodule.c keeps.
  constexpr int kN = 624;
  std::vector<uint32_t> mt(kN);
  mt[0] = 19650218u;
  for (int i = 1; i < kN; ++i) {
    mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + static_cast<uint32_t>(i);
  }
  int i = 1;
  size_t j = 0;
  for (int k = std::max<int>(kN, static_cast<int>(key.size())); k > 0; --k) {
    mt[i] =
        (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525u)) + key[j] + static_cast<uint32_t>(j);
    ++i;
    ++j;
    if (i >= kN) {
      mt[0] = mt[kN - 1];
      i = 1;
    }
    if (j >= key.size()) j = 0;
  }
  for (int k = kN - 1; k > 0; --k) {
    mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941u)) - static_cast<uint32_t>(i);
    ++i;
    if (i >= kN) {
      mt[0] = mt[kN - 1];
      i = 1;
    }
  }
  mt[0] = 0x80000000u;
  // std::mt19937 is the same generator; its text form is the 624 state words, read back with the
  // next draw regenerating the state, as CPython's after seeding.
  std::stringstream state;
  for (uint32_t w : mt) state << w << ' ';
  std::mt19937 gen;
  state >> gen;
  // randint(low, high) = low + _randbelow(high - low + 1): getrandbits(k) by rejection.
  const uint64_t range = static_cast<uint64_t>(high - low) + 1;
  int bits = 0;
  while ((range >> bits) != 0) ++bits;
  require(bits <= 32, "high", "MixGRPO's window start needs a range below 2^32");
  uint64_t r = 0;
  do {
    r = static_cast<uint64_t>(gen()) >> (32 - bits);
  } while (r >= range);
  return low + static_cast<int64_t>(r);
}

SdeWindow draw_sde_window(const SamplerConfig& config, at::Generator generator,
                          int64_t global_step) {
  config.validate();
  const int64_t steps = config.num_inference_steps;
  // As flow_grpo's sd3_pipeline_with_logprob_fast.py and verl-omni's pipelines choose it: with no
  // window size, every step but the last, (0, T - 1): the last step lands on sigma 0, where the
  // Gaussian is so sharp that its log-prob overflows; a 1-step schedule keeps its only step.
  // Otherwise start ~ randint(range[0], range[1] - size) inclusive (torch.randint(first,
  // last - size + 1) in verl-omni), so the window [start, start + size) stays in the range.
  if (config.sde_window_size == 0) return {0, std::max<int64_t>(1, steps - 1)};
  const int64_t first = config.sde_window_range.first;
  const int64_t last = config.sde_window_range.second < 0 ? steps : config.sde_window_range.second;
  if (config.mix_grpo) {
    // verl-omni's QwenImageMixGRPOPipelineWithLogProb._maybe_make_progressive_window.
    const int64_t size = config.sde_window_size, max_start = last - size;
    int64_t start = 0;
    if (config.sample_strategy == "progressive") {
      const int64_t advances = std::max<int64_t>(0, global_step) / config.iters_per_group;
      start = std::min(first + advances * size, max_start);
    } else {
      start = python_random_randint(config.sde_window_seed + global_step, first, max_start);
    }
    return {start, start + size};
  }
  const int64_t start = at::randint(first, last - config.sde_window_size + 1, {1}, generator,
                                    torch::TensorOptions().dtype(torch::kLong))
                            .item<int64_t>();
  return {start, start + config.sde_window_size};
}

DiffusionRollout sample_with_logprob(const models::FlowModel& model, const Conditioning& cond,
                                     const SamplerConfig& config, const SdeWindow& window,
                                     at::Generator generator) {
  config.validate();
  const int64_t steps = config.num_inference_steps;
  require(window.begin >= 0 && window.begin <= window.end && window.end <= steps, "window",
          fmt::format("[{}, {}) must lie in [0, {}]", window.begin, window.end, steps));
  require(cond.prompt_embeds.defined() && cond.size() > 0, kPromptEmbeds,
          "must hold at least one prompt");
  const int64_t patch = model.patch_size();
  require(config.height % patch == 0 && config.width % patch == 0,
          "actor_rollout_ref.rollout.pipeline.height",
          fmt::format("{} x {} latents must be multiples of the model's patch size {}",
                      config.height, config.width, patch));
  torch::NoGradGuard no_grad;
  const int64_t b = cond.size();
  const auto scheduler = config.scheduler();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(cond.prompt_embeds.device());
  auto sigmas = scheduler.sigmas.to(f32.device());
  auto x = at::randn({b, model.latent_channels(), config.height, config.width}, generator, f32);
  std::vector<torch::Tensor> latents{x};
  auto log_probs = torch::zeros({b, steps}, f32);
  SdeStepOptions opts;
  opts.noise_level = config.noise_level;
  opts.sde_type = config.sde_type;
  opts.generator = generator;
  for (int64_t j = 0; j < steps; ++j) {
    // Per-sample sigmas, as the training rows carry them: the step then runs the same kernels on
    // the same shapes as the trainer's recomputation of it.
    auto sigma = sigmas[j].expand({b}), sigma_next = sigmas[j + 1].expand({b});
    auto v = flow_velocity(model, x, sigma, cond, config.true_cfg_scale);
    // noise_level 0 is the ODE everywhere: the SDE step's std would be 0 (log-prob undefined).
    if (window.contains(j) && config.noise_level > 0) {
      auto step = sde_step_with_logprob_sigmas(v, x, sigma, sigma_next, scheduler.sigma(1), opts);
      x = step.prev_sample;
      log_probs.select(1, j).copy_(step.log_prob);
    } else {
      x = x + (sigmas[j + 1] - sigmas[j]) * v;
    }
    latents.push_back(x);
  }
  return {torch::stack(latents, 1), log_probs, scheduler.sigmas.clone(), window, cond};
}

// ---------------------------------------------------------------------------------------------
// Rewards to advantages

GroupAdvantages group_advantages(const torch::Tensor& rewards, int64_t group_size,
                                 const DiffusionAdvantageConfig& config,
                                 dist::ProcessGroup* group) {
  require(rewards.defined() && rewards.dim() == 1, "rewards", "must be a [B] tensor");
  const int64_t b = rewards.size(0);
  require(group_size >= 1 && b % group_size == 0, "group_size",
          fmt::format("{} samples do not split into groups of {}", b, group_size));
  const int64_t world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  auto mine = rewards.detach().to(torch::kCPU, torch::kFloat).contiguous();
  auto all = mine;
  if (group) {
    all = torch::empty({world * b}, torch::kFloat);
    group->all_gather(mine, all);
  }
  std::vector<int64_t> uids(static_cast<size_t>(world * b));
  for (size_t i = 0; i < uids.size(); ++i) uids[i] = static_cast<int64_t>(i) / group_size;
  GroupAdvantages out;
  out.advantages = diffusion_group_advantages(all, uids, config)
                       .narrow(0, rank * b, b)
                       .to(rewards.device())
                       .contiguous();
  out.group_ids.assign(uids.begin() + rank * b, uids.begin() + (rank + 1) * b);
  out.reward_mean = all.mean().item<double>();
  out.reward_std = all.std(/*unbiased=*/false).item<double>();
  return out;
}

// ---------------------------------------------------------------------------------------------
// The policy's step on the rows

PolicyStep policy_step(const models::FlowModel& model, const TensorMap& rows,
                       const SamplerConfig& sampler) {
  const std::string who = "the policy's SDE step";
  const auto& x = column(rows, "latents", who);
  const auto& sigma = column(rows, "sigma", who);
  auto v = flow_velocity(model, x, sigma, Conditioning::from(rows), sampler.true_cfg_scale);
  SdeStepOptions opts;
  opts.noise_level = sampler.noise_level;
  opts.sde_type = sampler.sde_type;
  opts.prev_sample = column(rows, "next_latents", who);
  auto step = sde_step_with_logprob_sigmas(v, x, sigma, column(rows, "sigma_next", who),
                                           sampler.scheduler().sigma(1), opts);
  return {v, step};
}

TensorMap recompute_log_probs(const models::FlowModel& model, const TensorMap& rows,
                              const SamplerConfig& sampler) {
  torch::NoGradGuard no_grad;
  auto out = policy_step(model, rows, sampler).step;
  return {{"old_log_probs", out.log_prob}, {"old_prev_sample_mean", out.prev_sample_mean}};
}

Metrics logprob_consistency(const TensorMap& rows) {
  const std::string who = "the rollout-train consistency metrics";
  auto diff =
      (column(rows, "old_log_probs", who) - column(rows, "rollout_log_probs", who)).abs().detach();
  return {{"rollout_corr/logprob_abs_diff_mean", diff.mean().to(torch::kFloat)},
          {"rollout_corr/logprob_abs_diff_max", diff.max().to(torch::kFloat)}};
}

// ---------------------------------------------------------------------------------------------
// Rows of an update

std::vector<int64_t> flow_grpo_train_steps(const SdeWindow& window, double timestep_fraction) {
  require(timestep_fraction > 0 && timestep_fraction <= 1, "algorithm.timestep_fraction",
          fmt::format("must be in (0, 1], got {}", timestep_fraction));
  require(window.size() >= 1, "window", "has no stochastic step to train on");
  const int64_t k = std::max<int64_t>(
      1, static_cast<int64_t>(static_cast<double>(window.size()) * timestep_fraction));
  std::vector<int64_t> steps;
  for (int64_t j = window.begin; j < window.begin + k; ++j) steps.push_back(j);
  return steps;
}

TensorMap flow_grpo_rows(const DiffusionRollout& rollout, const torch::Tensor& advantages,
                         const std::vector<int64_t>& steps) {
  const int64_t b = rollout.size(), s = static_cast<int64_t>(steps.size());
  require(advantages.defined() && advantages.dim() == 1 && advantages.size(0) == b, "advantages",
          fmt::format("must be [{}] (one per sample)", b));
  require(s > 0, "steps", "must name at least one step");
  for (int64_t j : steps) {
    // Only a window step has a recorded log-prob to form the ratio with.
    require(rollout.window.contains(j), "steps",
            fmt::format("step {} is outside the SDE window [{}, {})", j, rollout.window.begin,
                        rollout.window.end));
  }
  const auto device = rollout.latents.device();
  auto idx = torch::tensor(steps, torch::kLong).to(device);
  auto flat = [&](const torch::Tensor& per_sample_step) {  // [B, S, ...] -> [B * S, ...]
    return per_sample_step.flatten(0, 1).contiguous();
  };
  auto sigmas = rollout.sigmas.to(device);
  TensorMap rows;
  rows["latents"] = flat(rollout.latents.index_select(1, idx));
  rows["next_latents"] = flat(rollout.latents.index_select(1, idx + 1));
  rows["sigma"] = sigmas.index_select(0, idx).repeat({b});
  rows["sigma_next"] = sigmas.index_select(0, idx + 1).repeat({b});
  rows["rollout_log_probs"] = flat(rollout.log_probs.index_select(1, idx));
  rows["old_log_probs"] = rows["rollout_log_probs"];
  rows["advantages"] = advantages.to(device, torch::kFloat).repeat_interleave(s);
  rollout.cond.index_select(repeat_each(b, s, device)).add_to(rows);
  return rows;
}

TensorMap nft_rows(const DiffusionRollout& rollout, const torch::Tensor& reward_prob,
                   double timestep_fraction, at::Generator generator) {
  const int64_t b = rollout.size(), steps = rollout.num_steps();
  require(reward_prob.defined() && reward_prob.dim() == 1 && reward_prob.size(0) == b,
          "reward_prob", fmt::format("must be [{}] (one per sample)", b));
  require(timestep_fraction > 0 && timestep_fraction <= 1, "algorithm.timestep_fraction",
          fmt::format("must be in (0, 1], got {}", timestep_fraction));
  const auto device = rollout.latents.device();
  auto sigmas = rollout.sigmas.to(device, torch::kFloat).narrow(0, 0, steps);
  // Selecting among the sigmas themselves, not timesteps / 1000, which would round differently.
  auto selected =
      nft_select_train_timesteps(sigmas.expand({b, steps}), timestep_fraction, generator);
  const int64_t k = selected.indices.size(1);
  auto t = selected.timesteps.reshape({-1});
  auto per_row = repeat_each(b, k, device);
  auto x0 = rollout.images().index_select(0, per_row).contiguous();
  auto eps = at::randn(x0.sizes(), generator, x0.options());
  TensorMap rows;
  rows["x0"] = x0;
  rows["xt"] = flow_interpolate(x0, eps, t);
  rows["t"] = t;
  rows["r"] = reward_prob.to(device, torch::kFloat).index_select(0, per_row);
  rollout.cond.index_select(per_row).add_to(rows);
  return rows;
}

TensorMap dpo_rows(const DiffusionRollout& rollout, const torch::Tensor& rewards,
                   const std::vector<int64_t>& group_ids, double shift, at::Generator generator) {
  const auto pairs = dpo_make_pairs(rewards, group_ids);
  const int64_t p = pairs.num_pairs();
  require(p > 0, "group_ids", "no group has two samples to pair");
  const auto device = rollout.latents.device();
  auto idx = pairs.index_tensor().to(device);
  auto chosen = idx.slice(0, 0, 2 * p, 2), rejected = idx.slice(0, 1, 2 * p, 2);
  auto images = rollout.images();
  return offline_dpo_rows(images.index_select(0, chosen), images.index_select(0, rejected),
                          rollout.cond.index_select(chosen), shift, generator);
}

TensorMap offline_dpo_rows(const torch::Tensor& chosen, const torch::Tensor& rejected,
                           const Conditioning& cond, double shift, at::Generator generator) {
  require(chosen.defined() && rejected.defined() && chosen.sizes() == rejected.sizes(),
          "rejected_x0", "must have the shape of chosen_x0");
  const int64_t p = chosen.size(0);
  require(p > 0 && cond.size() == p, kPromptEmbeds,
          fmt::format("has {} rows for {} pairs", cond.size(), p));
  auto ts = dpo_sample_timesteps(FlowMatchScheduler::create(1000, shift), p, generator);
  TensorMap rows;
  rows["chosen_x0"] = chosen.to(torch::kFloat).contiguous();
  rows["rejected_x0"] = rejected.to(torch::kFloat).contiguous();
  rows["eps"] = at::randn(chosen.sizes(), generator, rows["chosen_x0"].options());
  rows["sigma"] = ts.sigmas.to(chosen.device());
  cond.add_to(rows);
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Losses

namespace {

const std::vector<std::string>& reverse_process_modes() {
  static const std::vector<std::string> modes = {
      "flow_grpo", "dance_grpo", "flow_dppo", "grpo_guard", "kl", "distill_kl", "distill_fm_mse"};
  return modes;
}

bool contains(const std::vector<std::string>& list, const std::string& value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

std::string joined(const std::vector<std::string>& list) {
  std::string out;
  for (const auto& item : list) out += (out.empty() ? "" : ", ") + item;
  return out;
}

bool is_distill_mode(const std::string& mode) {
  return mode == "distill_kl" || mode == "distill_fm_mse";
}

// The teacher's term of a distillation mode, from the policy's step on the rows.
torch::Tensor distill_term(const std::string& mode, const PolicyStep& policy,
                           const TensorMap& rows) {
  const std::string who = "the " + mode + " loss (the teacher's column)";
  if (mode == "distill_kl") {
    return step_kl_loss(policy.step.prev_sample_mean, column(rows, "teacher_prev_sample_mean", who),
                        policy.step.std_dev_t);
  }
  return distill_fm_mse_loss(policy.velocity, column(rows, "teacher_noise_pred", who));
}

// verl-omni's diffusion_loss for the PPO engine: the mode's loss on the step, plus kl_loss_coef
// times the reference KL (actor.use_kl_loss) and distill_loss_coef times the teacher's term
// (actor.use_distill_loss).
MicroBatchLoss reverse_process_loss(const models::FlowModel& model, const TensorMap& rows,
                                    const DiffusionLossConfig& loss, const SamplerConfig& sampler) {
  const std::string who = "the " + loss.loss_mode + " loss";
  const auto policy = policy_step(model, rows, sampler);
  const auto& step = policy.step;
  auto zero = torch::zeros({}, step.log_prob.options());
  auto reference_kl = [&] {
    return step_kl_loss(step.prev_sample_mean,
                        column(rows, "ref_prev_sample_mean", who + " (the reference's column)"),
                        step.std_dev_t);
  };
  FlowGrpoLossInputs in;
  if (!is_distill_mode(loss.loss_mode) && loss.loss_mode != "kl") {
    in.log_prob = step.log_prob;
    in.old_log_prob = column(rows, "old_log_probs", who);
    in.advantages = column(rows, "advantages", who);
    in.prev_sample_mean = step.prev_sample_mean;
    in.std_dev_t = step.std_dev_t;
    in.sqrt_dt = step.sqrt_dt;
    if (loss.needs_old_step()) {
      in.old_prev_sample_mean = column(rows, "old_prev_sample_mean", who);
    }
    if (rows.count("rollout_is_weights")) in.rollout_is_weights = rows.at("rollout_is_weights");
  }
  torch::Tensor main;
  Metrics m{{"ppo_kl", zero}, {"clipfrac", zero}, {"ratio_mean", zero}};
  if (loss.loss_mode == "flow_grpo" || loss.loss_mode == "dance_grpo") {
    FlowGrpoLossConfig config;
    config.clip_range = loss.clip_ratio;
    config.adv_clip_max = loss.adv_clip_max;
    auto out = flow_grpo_loss(in, config);
    main = out.loss;
    m["ppo_kl"] = out.ppo_kl;
    m["clipfrac"] = out.clipfrac;
    m["ratio_mean"] = torch::exp(step.log_prob - in.old_log_prob).mean().detach();
  } else if (loss.loss_mode == "flow_dppo" || loss.loss_mode == "grpo_guard") {
    PolicyStepLossOutput out;
    if (loss.loss_mode == "flow_dppo") {
      FlowDppoLossConfig config;
      config.kl_mask_threshold = loss.kl_mask_threshold;
      config.add_kl_coefficient = loss.add_kl_coefficient;
      out = flow_dppo_loss(in, config);
      m["kl_new_old_mean"] = out.kl_new_old;
      m["masked_fraction"] = out.masked_fraction;
    } else {
      FlowGrpoLossConfig config;
      config.clip_range = loss.clip_ratio;
      config.adv_clip_max = loss.adv_clip_max;
      out = grpo_guard_loss(in, config);
    }
    main = out.loss;
    m["ppo_kl"] = out.ppo_kl;
    m["clipfrac"] = out.clipfrac;
    m["ratio_mean"] = out.ratio_mean;
  } else if (loss.loss_mode == "kl") {
    main = reference_kl();
  } else {
    main = distill_term(loss.loss_mode, policy, rows);
  }
  m["policy_loss"] = main.detach();
  auto total = main;
  m["kl"] = zero;
  if (loss.kl_loss_coef > 0) {
    auto kl = reference_kl();
    total = total + loss.kl_loss_coef * kl;
    m["kl"] = kl.detach();
  }
  if (loss.distill_loss_coef > 0) {
    auto distill = distill_term(loss.distill_loss_mode, policy, rows);
    total = total + loss.distill_loss_coef * distill;
    m["distill_loss"] = distill.detach();
  } else if (is_distill_mode(loss.loss_mode)) {
    m["distill_loss"] = main.detach();
  }
  for (auto& [name, value] : m) value = value.detach().to(torch::kFloat);
  return {total, m};
}

}  // namespace

std::string loss_mode_of(const std::string& model_type) {
  return loss_modes_of(model_type).front();
}

const std::vector<std::string>& loss_modes_of(const std::string& model_type) {
  static const std::vector<std::string> nft = {"diffusion_nft"}, dpo = {"dpo"};
  if (model_type == "diffusion_model") return reverse_process_modes();
  if (model_type == "diffusion_nft_model") return nft;
  if (model_type == "diffusion_dpo_model") return dpo;
  throw std::invalid_argument(fmt::format(
      "config key 'actor_rollout_ref.model.model_type' must be diffusion_model (Flow-GRPO and the "
      "other reverse-process losses), diffusion_nft_model or diffusion_dpo_model, got '{}'",
      model_type));
}

bool is_reverse_process_loss(const std::string& loss_mode) {
  return contains(reverse_process_modes(), loss_mode);
}

void DiffusionLossConfig::validate() const {
  const std::string key = "actor_rollout_ref.actor.diffusion_loss.";
  std::vector<std::string> all = reverse_process_modes();
  all.push_back("diffusion_nft");
  all.push_back("dpo");
  if (!contains(all, loss_mode)) {
    throw std::invalid_argument(fmt::format(
        "{}loss_mode: unknown value \"{}\" (expected one of: {})", key, loss_mode, joined(all)));
  }
  require(clip_ratio >= 0, key + "clip_ratio", fmt::format("must be >= 0, got {}", clip_ratio));
  require(adv_clip_max > 0, key + "adv_clip_max", fmt::format("must be > 0, got {}", adv_clip_max));
  require(kl_loss_coef >= 0, "actor_rollout_ref.actor.kl_loss_coef",
          fmt::format("must be >= 0, got {}", kl_loss_coef));
  require(mix_beta > 0 && mix_beta <= 1, key + "mix_beta",
          fmt::format("must be in (0, 1], got {}", mix_beta));
  require(ref_kl_coef >= 0, key + "ref_kl_coef", fmt::format("must be >= 0, got {}", ref_kl_coef));
  require(adaptive_weight_min > 0, key + "adaptive_weight_min",
          fmt::format("must be > 0, got {}", adaptive_weight_min));
  require(dpo_beta > 0, key + "dpo_beta", fmt::format("must be > 0, got {}", dpo_beta));
  require(kl_mask_threshold > 0, key + "kl_mask_threshold",
          fmt::format("must be > 0, got {}", kl_mask_threshold));
  require(distill_loss_coef >= 0, "actor_rollout_ref.actor.distill_loss_coef",
          fmt::format("must be >= 0, got {}", distill_loss_coef));
  if (!is_distill_mode(distill_loss_mode)) {
    internal::throw_unknown_value("actor_rollout_ref.actor.distill_loss_mode", distill_loss_mode,
                                  {"distill_kl", "distill_fm_mse"});
  }
  if (!is_reverse_process_loss(loss_mode)) {
    // NFT and DPO engines train the forward process: no SDE step to put a KL or a teacher on.
    require(kl_loss_coef == 0, "actor_rollout_ref.actor.use_kl_loss",
            fmt::format("adds the reverse-step KL to a reverse-process loss; loss_mode {} has "
                        "its own reference term",
                        loss_mode));
    require(distill_loss_coef == 0, "actor_rollout_ref.actor.use_distill_loss",
            fmt::format("adds a teacher's term to a reverse-process loss, not to {}", loss_mode));
  }
}

bool DiffusionLossConfig::needs_reference() const {
  if (is_reverse_process_loss(loss_mode)) return loss_mode == "kl" || kl_loss_coef > 0;
  if (loss_mode == "diffusion_nft") return ref_kl_coef > 0;
  return loss_mode == "dpo";
}

bool DiffusionLossConfig::needs_teacher() const {
  return is_distill_mode(loss_mode) || distill_loss_coef > 0;
}

bool DiffusionLossConfig::needs_old_step() const {
  return loss_mode == "flow_dppo" || loss_mode == "grpo_guard";
}

TensorMap frozen_outputs(const std::string& role, const models::FlowModel& model,
                         const TensorMap& rows, const DiffusionLossConfig& loss,
                         const SamplerConfig& sampler) {
  loss.validate();
  torch::NoGradGuard no_grad;
  const bool reverse = is_reverse_process_loss(loss.loss_mode);
  if (role == "reference") {
    if (reverse) {
      return {{"ref_prev_sample_mean", policy_step(model, rows, sampler).step.prev_sample_mean}};
    }
    if (loss.loss_mode == "diffusion_nft") return {{"ref_velocity", nft_velocity(model, rows)}};
    auto pred = dpo_prediction(model, dpo_inputs(rows));
    return {{"ref_chosen_pred", pred.slice(0, 0, pred.size(0), 2)},
            {"ref_rejected_pred", pred.slice(0, 1, pred.size(0), 2)}};
  }
  if (role == "old") {
    require(loss.loss_mode == "diffusion_nft", "role",
            fmt::format("\"old\" is DiffusionNFT's behaviour policy; loss_mode {} has none "
                        "(recompute_log_probs gives a reverse-process loss its old step)",
                        loss.loss_mode));
    return {{"old_velocity", nft_velocity(model, rows)}};
  }
  if (role == "teacher") {
    require(
        loss.needs_teacher(), "role",
        fmt::format("loss_mode {} without a distillation term reads no teacher", loss.loss_mode));
    const auto teacher = policy_step(model, rows, sampler);
    std::vector<std::string> modes;
    if (is_distill_mode(loss.loss_mode)) modes.push_back(loss.loss_mode);
    if (loss.distill_loss_coef > 0) modes.push_back(loss.distill_loss_mode);
    TensorMap out;
    for (const auto& mode : modes) {
      if (mode == "distill_kl") out["teacher_prev_sample_mean"] = teacher.step.prev_sample_mean;
      if (mode == "distill_fm_mse") out["teacher_noise_pred"] = teacher.velocity;
    }
    return out;
  }
  internal::throw_unknown_value("role", role, {"reference", "old", "teacher"});
}

MicroBatchLoss diffusion_loss(const models::FlowModel& model, const TensorMap& rows,
                              const DiffusionLossConfig& loss, const SamplerConfig& sampler) {
  loss.validate();
  if (is_reverse_process_loss(loss.loss_mode)) {
    return reverse_process_loss(model, rows, loss, sampler);
  }
  if (loss.loss_mode == "diffusion_nft") {
    const std::string who = "the diffusion_nft loss";
    NftLossInputs in;
    in.v = nft_velocity(model, rows);
    in.v_old = column(rows, "old_velocity", who);
    if (loss.ref_kl_coef > 0) {
      in.v_ref = column(rows, "ref_velocity", "the diffusion_nft loss's KL (ref_kl_coef > 0)");
    }
    in.x0 = column(rows, "x0", who);
    in.xt = column(rows, "xt", who);
    in.t = column(rows, "t", who);
    in.r = column(rows, "r", who);
    NftLossConfig config;
    config.beta = loss.mix_beta;
    config.adv_clip_max = loss.adv_clip_max;
    config.ref_kl_coef = loss.ref_kl_coef;
    config.adaptive_weight_min = loss.adaptive_weight_min;
    auto out = nft_loss(in, config);
    return {out.loss, detached({{"policy_loss", out.policy_loss},
                                {"kl", out.ref_loss},
                                {"positive_loss", out.positive_loss},
                                {"negative_loss", out.negative_loss}})};
  }
  const std::string who = "the dpo loss";
  auto in = dpo_inputs(rows);
  auto ref =
      interleave(column(rows, "ref_chosen_pred", who), column(rows, "ref_rejected_pred", who));
  auto pred = dpo_prediction(model, in);
  DpoLossConfig config;
  config.beta = loss.dpo_beta;
  auto out = diffusion_dpo_loss(pred, ref, in.target, config);
  return {out.loss, detached({{"implicit_acc", out.implicit_acc},
                              {"reward_margin", out.reward_margin},
                              {"model_mse", out.model_mse},
                              {"ref_mse", out.ref_mse}})};
}

}  // namespace shardrl::algos
