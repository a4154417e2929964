// Diffusion RL on the SD3 transformer: text conditioning, the sampler, the rows of each
// algorithm's update and their per-micro-batch losses. The math is algos.h; this file runs the
// model and moves tensors into rows.
#include "shardrl/algos/diffusion_rl.h"

#include <fmt/format.h>

#include "algos/internal.h"

namespace shardrl::algos {

using internal::require;

namespace {

const char* const kPromptEmbeds = "prompt_embeds";
const char* const kPooled = "pooled_prompt_embeds";
const char* const kNegativeEmbeds = "negative_prompt_embeds";
const char* const kNegativePooled = "negative_pooled_prompt_embeds";

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

// The model's velocity for one batch of conditioning, without CFG: sigma [B] in [0, 1].
torch::Tensor velocity(models::SD3Transformer2DModel& model, const torch::Tensor& x,
                       const torch::Tensor& sigma, const torch::Tensor& embeds,
                       const torch::Tensor& pooled) {
  auto t = (sigma.to(x.device(), torch::kFloat) * 1000.0).expand({x.size(0)}).contiguous();
  return model(x, embeds, pooled, t).to(torch::kFloat);
}

// [P, ...] chosen and [P, ...] rejected -> [2P, ...] interleaved, as dpo_make_pairs orders pairs.
torch::Tensor interleave(const torch::Tensor& chosen, const torch::Tensor& rejected) {
  auto both = torch::stack({chosen, rejected}, 1);
  std::vector<int64_t> shape = both.sizes().vec();
  shape.erase(shape.begin());
  shape[0] = 2 * chosen.size(0);
  return both.reshape(shape);
}

// Flow-GRPO: the rollout's step x_j -> x_{j+1} scored again by `model` (what both the loss and
// the reference's step mean need).
SdeStepResult flow_grpo_step(models::SD3Transformer2DModel& model, const TensorMap& rows,
                             const SamplerConfig& sampler) {
  const std::string who = "the flow_grpo loss";
  const auto& x = column(rows, "latents", who);
  const auto& sigma = column(rows, "sigma", who);
  auto v = sd3_velocity(model, x, sigma, Conditioning::from(rows), sampler.true_cfg_scale);
  SdeStepOptions opts;
  opts.noise_level = sampler.noise_level;
  opts.sde_type = sampler.sde_type;
  opts.prev_sample = column(rows, "next_latents", who);
  return sde_step_with_logprob_sigmas(v, x, sigma, column(rows, "sigma_next", who),
                                      sampler.scheduler().sigma(1), opts);
}

// DiffusionNFT: the conditional velocity at (xt, t), no CFG (NFT trains the guidance-free model).
torch::Tensor nft_velocity(models::SD3Transformer2DModel& model, const TensorMap& rows) {
  const std::string who = "the diffusion_nft loss";
  auto cond = Conditioning::from(rows);
  return velocity(model, column(rows, "xt", who), column(rows, "t", who), cond.prompt_embeds,
                  cond.pooled_prompt_embeds);
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
torch::Tensor dpo_prediction(models::SD3Transformer2DModel& model, const DpoInputs& in) {
  return velocity(model, in.xt, in.sigma, in.cond.prompt_embeds, in.cond.pooled_prompt_embeds);
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
  Conditioning c;
  c.prompt_embeds = column(rows, kPromptEmbeds, who);
  c.pooled_prompt_embeds = column(rows, kPooled, who);
  const bool neg = rows.count(kNegativeEmbeds) > 0, neg_pooled = rows.count(kNegativePooled) > 0;
  if (neg || neg_pooled) {
    // Half a negative prompt is a caller's bug, not "no CFG".
    c.negative_prompt_embeds = column(rows, kNegativeEmbeds, who);
    c.negative_pooled_prompt_embeds = column(rows, kNegativePooled, who);
  }
  return c;
}

void Conditioning::add_to(TensorMap& rows) const {
  rows[kPromptEmbeds] = prompt_embeds;
  rows[kPooled] = pooled_prompt_embeds;
  if (has_negative()) {
    rows[kNegativeEmbeds] = negative_prompt_embeds;
    rows[kNegativePooled] = negative_pooled_prompt_embeds;
  }
}

Conditioning Conditioning::index_select(const torch::Tensor& rows) const {
  auto pick = [&](const torch::Tensor& t) {
    return t.defined() ? t.index_select(0, rows.to(t.device())) : t;
  };
  return {pick(prompt_embeds), pick(pooled_prompt_embeds), pick(negative_prompt_embeds),
          pick(negative_pooled_prompt_embeds)};
}

torch::Tensor sd3_velocity(models::SD3Transformer2DModel& model, const torch::Tensor& x,
                           const torch::Tensor& sigma, const Conditioning& cond,
                           double true_cfg_scale) {
  require(cond.size() == x.size(0), kPromptEmbeds,
          fmt::format("has {} rows for {} latents", cond.size(), x.size(0)));
  // diffusers' do_true_cfg: guidance only above 1.
  if (true_cfg_scale <= 1.0) {
    return velocity(model, x, sigma, cond.prompt_embeds, cond.pooled_prompt_embeds);
  }
  require(
      cond.has_negative(), kNegativeEmbeds,
      fmt::format("required by true_cfg_scale {} > 1 (the unconditional branch)", true_cfg_scale));
  const int64_t b = x.size(0);
  auto s = sigma.to(x.device(), torch::kFloat).expand({b});
  auto v = velocity(model, torch::cat({x, x}), torch::cat({s, s}),
                    torch::cat({cond.negative_prompt_embeds, cond.prompt_embeds}),
                    torch::cat({cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds}));
  return cfg_combine(v.narrow(0, 0, b), v.narrow(0, b, b), true_cfg_scale);
}

// ---------------------------------------------------------------------------------------------
// Supervised stage

MicroBatchLoss flow_matching_loss(models::SD3Transformer2DModel& model, const TensorMap& rows,
                                  const FlowMatchingLossConfig& config, at::Generator generator) {
  require(config.caption_dropout >= 0 && config.caption_dropout <= 1, "caption_dropout",
          fmt::format("must be in [0, 1], got {}", config.caption_dropout));
  const auto& x0 = column(rows, "images", "the flow-matching loss");
  const int64_t b = x0.size(0);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(x0.device());
  auto sigma = internal::flow_matching_sigmas(config.timestep_sampling, b, generator, f32);
  auto eps = at::randn(x0.sizes(), generator, f32);
  auto cond = Conditioning::from(rows);
  auto embeds = cond.prompt_embeds, pooled = cond.pooled_prompt_embeds;
  if (config.caption_dropout > 0) {
    require(cond.has_negative(), kNegativeEmbeds,
            "required by caption_dropout > 0 (the dropped captions' embedding)");
    auto drop = at::rand({b}, generator, f32) < config.caption_dropout;
    embeds = torch::where(drop.view({b, 1, 1}), cond.negative_prompt_embeds, embeds);
    pooled = torch::where(drop.view({b, 1}), cond.negative_pooled_prompt_embeds, pooled);
  }
  auto v = velocity(model, flow_interpolate(x0, eps, sigma), sigma, embeds, pooled);
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
  if (sde_type != "sde" && sde_type != "cps") {
    internal::throw_unknown_value(algo + "sde_type", sde_type, {"sde", "cps"});
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

SdeWindow draw_sde_window(const SamplerConfig& config, at::Generator generator) {
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
  const int64_t start = at::randint(first, last - config.sde_window_size + 1, {1}, generator,
                                    torch::TensorOptions().dtype(torch::kLong))
                            .item<int64_t>();
  return {start, start + config.sde_window_size};
}

DiffusionRollout sample_with_logprob(models::SD3Transformer2DModel& model, const Conditioning& cond,
                                     const SamplerConfig& config, const SdeWindow& window,
                                     at::Generator generator) {
  config.validate();
  const int64_t steps = config.num_inference_steps;
  require(window.begin >= 0 && window.begin <= window.end && window.end <= steps, "window",
          fmt::format("[{}, {}) must lie in [0, {}]", window.begin, window.end, steps));
  require(cond.prompt_embeds.defined() && cond.size() > 0, kPromptEmbeds,
          "must hold at least one prompt");
  torch::NoGradGuard no_grad;
  const int64_t b = cond.size();
  const auto scheduler = config.scheduler();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(cond.prompt_embeds.device());
  auto sigmas = scheduler.sigmas.to(f32.device());
  auto x = at::randn({b, model->config().in_channels, config.height, config.width}, generator, f32);
  std::vector<torch::Tensor> latents{x};
  auto log_probs = torch::zeros({b, steps}, f32);
  SdeStepOptions opts;
  opts.noise_level = config.noise_level;
  opts.sde_type = config.sde_type;
  opts.generator = generator;
  for (int64_t j = 0; j < steps; ++j) {
    auto v = sd3_velocity(model, x, sigmas[j], cond, config.true_cfg_scale);
    // noise_level 0 is the ODE everywhere: the SDE step's std would be 0 (log-prob undefined).
    if (window.contains(j) && config.noise_level > 0) {
      auto step = sde_step_with_logprob(scheduler, v, x, j, opts);
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
  rows["old_log_probs"] = flat(rollout.log_probs.index_select(1, idx));
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
  auto ts = dpo_sample_timesteps(FlowMatchScheduler::create(1000, shift), p, generator);
  TensorMap rows;
  rows["chosen_x0"] = images.index_select(0, chosen).contiguous();
  rows["rejected_x0"] = images.index_select(0, rejected).contiguous();
  rows["eps"] = at::randn(rows["chosen_x0"].sizes(), generator, images.options());
  rows["sigma"] = ts.sigmas.to(device);
  rollout.cond.index_select(chosen).add_to(rows);
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Losses

std::string loss_mode_of(const std::string& model_type) {
  if (model_type == "diffusion_model") return "flow_grpo";
  if (model_type == "diffusion_nft_model") return "diffusion_nft";
  if (model_type == "diffusion_dpo_model") return "dpo";
  throw std::invalid_argument(fmt::format(
      "config key 'actor_rollout_ref.model.model_type' must be diffusion_model (Flow-GRPO), "
      "diffusion_nft_model or diffusion_dpo_model, got '{}'",
      model_type));
}

void DiffusionLossConfig::validate() const {
  const std::string key = "actor_rollout_ref.actor.diffusion_loss.";
  if (loss_mode != "flow_grpo" && loss_mode != "diffusion_nft" && loss_mode != "dpo") {
    internal::throw_unknown_value(key + "loss_mode", loss_mode,
                                  {"flow_grpo", "diffusion_nft", "dpo"});
  }
  require(clip_ratio >= 0, key + "clip_ratio", fmt::format("must be >= 0, got {}", clip_ratio));
  require(adv_clip_max > 0, key + "adv_clip_max", fmt::format("must be > 0, got {}", adv_clip_max));
  require(kl_loss_coef >= 0, "actor_rollout_ref.actor.kl_loss_coef",
          fmt::format("must be >= 0, got {}", kl_loss_coef));
  require(mix_beta > 0 && mix_beta <= 1, key + "mix_beta",
          fmt::format("must be in (0, 1], got {}", mix_beta));
  require(ref_kl_coef >= 0, key + "ref_kl_coef", fmt::format("must be >= 0, got {}", ref_kl_coef));
  require(dpo_beta > 0, key + "dpo_beta", fmt::format("must be > 0, got {}", dpo_beta));
}

bool DiffusionLossConfig::needs_reference() const {
  if (loss_mode == "flow_grpo") return kl_loss_coef > 0;
  if (loss_mode == "diffusion_nft") return ref_kl_coef > 0;
  return loss_mode == "dpo";
}

TensorMap frozen_outputs(const std::string& role, models::SD3Transformer2DModel& model,
                         const TensorMap& rows, const DiffusionLossConfig& loss,
                         const SamplerConfig& sampler) {
  loss.validate();
  torch::NoGradGuard no_grad;
  if (role == "reference") {
    if (loss.loss_mode == "flow_grpo") {
      return {{"ref_prev_sample_mean", flow_grpo_step(model, rows, sampler).prev_sample_mean}};
    }
    if (loss.loss_mode == "diffusion_nft") return {{"ref_velocity", nft_velocity(model, rows)}};
    auto pred = dpo_prediction(model, dpo_inputs(rows));
    return {{"ref_chosen_pred", pred.slice(0, 0, pred.size(0), 2)},
            {"ref_rejected_pred", pred.slice(0, 1, pred.size(0), 2)}};
  }
  if (role == "old") {
    require(loss.loss_mode == "diffusion_nft", "role",
            fmt::format("\"old\" is DiffusionNFT's behaviour policy; loss_mode {} has none",
                        loss.loss_mode));
    return {{"old_velocity", nft_velocity(model, rows)}};
  }
  internal::throw_unknown_value("role", role, {"reference", "old"});
}

MicroBatchLoss diffusion_loss(models::SD3Transformer2DModel& model, const TensorMap& rows,
                              const DiffusionLossConfig& loss, const SamplerConfig& sampler) {
  loss.validate();
  if (loss.loss_mode == "flow_grpo") {
    const std::string who = "the flow_grpo loss";
    auto step = flow_grpo_step(model, rows, sampler);
    FlowGrpoLossInputs in;
    in.log_prob = step.log_prob;
    in.old_log_prob = column(rows, "old_log_probs", who);
    in.advantages = column(rows, "advantages", who);
    in.prev_sample_mean = step.prev_sample_mean;
    in.std_dev_t = step.std_dev_t;
    if (loss.kl_loss_coef > 0) {
      in.ref_prev_sample_mean =
          column(rows, "ref_prev_sample_mean", "the flow_grpo loss's KL (kl_loss_coef > 0)");
    }
    FlowGrpoLossConfig config;
    config.clip_range = loss.clip_ratio;
    config.adv_clip_max = loss.adv_clip_max;
    config.beta = loss.kl_loss_coef;
    auto out = flow_grpo_loss(in, config);
    return {out.loss, detached({{"policy_loss", out.policy_loss},
                                {"kl", out.kl_loss},
                                {"ppo_kl", out.ppo_kl},
                                {"clipfrac", out.clipfrac}})};
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
