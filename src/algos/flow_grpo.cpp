// Flow-matching schedule, the Flow-GRPO SDE step and loss, and group-relative advantages for
// diffusion models (reference §1 and §6).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "algos/internal.h"
#include "shardrl/algos.h"

namespace shardrl::algos {

using internal::f32;
using internal::flat_per_sample;
using internal::mean_non_batch;
using internal::per_sample_view;
using internal::require;

namespace {

constexpr double kLogSqrtTwoPi = 0.91893853320467274178;  // log(sqrt(2*pi))
constexpr double kPi = 3.14159265358979323846;

template <typename Key>
torch::Tensor diffusion_advantages_impl(const torch::Tensor& rewards, const std::vector<Key>& uids,
                                        const DiffusionAdvantageConfig& config) {
  const std::vector<double> r = internal::to_host_vector(rewards, "rewards");
  require(r.size() == uids.size(), "uids",
          "has " + std::to_string(uids.size()) + " entries for " + std::to_string(r.size()) +
              " rewards");
  std::vector<double> adv(r.size(), 0.0);
  if (r.empty()) return torch::zeros({0}, rewards.options().dtype(torch::kFloat));

  // torch.std's unbiased estimate, as verl-omni's compute_flow_grpo_outcome_advantage takes it
  // (flow_grpo's np.std is the population one; verl-omni is the reference here).
  auto sample_std = [&](const std::vector<int64_t>& idx, double mean) {
    double ss = 0.0;
    for (int64_t i : idx) ss += (r[i] - mean) * (r[i] - mean);
    return std::sqrt(ss / static_cast<double>(idx.size() - 1));
  };
  std::vector<int64_t> all(r.size());
  for (size_t i = 0; i < r.size(); ++i) all[i] = static_cast<int64_t>(i);
  double batch_mean = 0.0;
  for (double x : r) batch_mean += x;
  batch_mean /= static_cast<double>(r.size());
  const double batch_std = r.size() > 1 ? sample_std(all, batch_mean) : 0.0;

  for (const auto& group : internal::group_members(uids)) {
    // A lone sample has nothing to be relative to: no signal rather than noise.
    if (group.size() < 2) continue;
    double mean = 0.0;
    for (int64_t i : group) mean += r[i];
    mean /= static_cast<double>(group.size());
    const double sd = config.global_std ? batch_std : sample_std(group, mean);
    for (int64_t i : group) {
      adv[i] = config.normalize_by_std ? (r[i] - mean) / (sd + config.eps) : r[i] - mean;
    }
  }
  return torch::tensor(adv, torch::TensorOptions().dtype(torch::kDouble))
      .to(rewards.device(), torch::kFloat);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Scheduler and SDE step

FlowMatchScheduler FlowMatchScheduler::create(int64_t num_steps, double shift, double sigma_max,
                                              double sigma_min) {
  require(num_steps >= 1, "num_steps", "must be >= 1, got " + std::to_string(num_steps));
  require(shift > 0.0, "shift", "must be > 0, got " + std::to_string(shift));
  if (sigma_min < 0.0) sigma_min = shift * 1e-3 / (1.0 + (shift - 1.0) * 1e-3);
  require(sigma_max <= 1.0 && sigma_max >= sigma_min, "sigma_max",
          "must satisfy sigma_min <= sigma_max <= 1");
  // Shift in fp64 and round once, as diffusers does with numpy before moving to torch.
  auto lin = torch::linspace(sigma_max, sigma_min, num_steps, torch::kDouble);
  auto shifted = (shift * lin / (1.0 + (shift - 1.0) * lin)).to(torch::kFloat);
  FlowMatchScheduler s;
  s.timesteps = shifted * 1000.0f;
  s.sigmas = torch::cat({shifted, torch::zeros({1}, torch::kFloat)});
  return s;
}

double FlowMatchScheduler::sigma(int64_t i) const {
  require(i >= 0 && i < sigmas.size(0), "step_index", "out of range: " + std::to_string(i));
  return sigmas[i].item<double>();
}

const std::vector<std::string>& sde_types() {
  static const std::vector<std::string> types = {"sde", "cps", "dance_sde"};
  return types;
}

SdeStepResult sde_step_with_logprob_sigmas(const torch::Tensor& model_output,
                                           const torch::Tensor& sample, const torch::Tensor& sigma,
                                           const torch::Tensor& sigma_prev, double sigma1,
                                           const SdeStepOptions& options) {
  require(sample.defined() && sample.dim() >= 1, "sample", "must have a batch dim");
  require(model_output.defined() && model_output.sizes() == sample.sizes(), "model_output",
          "must have the shape of sample");
  const int64_t nd = sample.dim();
  const auto device = sample.device();
  auto x = f32(sample);
  auto v = f32(model_output);
  auto s = per_sample_view(f32(sigma).to(device), nd);
  auto s_prev = per_sample_view(f32(sigma_prev).to(device), nd);

  auto dt = s_prev - s;
  auto sqrt_dt = torch::sqrt(-dt);
  // Both kinds of step after flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
  // (yifan123/flow_grpo), which verl-omni's rollout copies.
  torch::Tensor std_dev_t, mean, step_std;
  const bool cps = options.sde_type == "cps";
  if (options.sde_type == "dance_sde") {
    // DanceGRPO (verl-omni's flow_match_sde.py, after XueZeyue/DanceGRPO): the Euler mean plus a
    // score correction, stable near sigma = 1 where the "sde" type's std diverges.
    auto x0_hat = x - s * v;
    auto score = -(x - x0_hat * (1.0 - s)) / s.pow(2);
    mean = x + dt * v + (-0.5 * options.noise_level * options.noise_level) * score * dt;
    std_dev_t = torch::sqrt(-dt) * options.noise_level;
    step_std = std_dev_t;
  } else if (options.sde_type == "sde") {
    auto denom_sigma = torch::where(s == 1.0, torch::full_like(s, sigma1), s);
    std_dev_t = torch::sqrt(s / (1.0 - denom_sigma)) * options.noise_level;
    auto var = std_dev_t.pow(2);
    mean = x * (1.0 + var / (2.0 * s) * dt) + v * (1.0 + var * (1.0 - s) / (2.0 * s)) * dt;
    step_std = std_dev_t * sqrt_dt;
  } else if (cps) {
    // CPS: x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v;
    // mean = (1 - sigma_prev) x0_hat + sqrt(sigma_prev^2 - std^2) x1_hat, std = sigma_prev sin(a
    // pi/2).
    std_dev_t = s_prev * std::sin(options.noise_level * kPi / 2.0);
    auto x0_hat = x - s * v;
    auto x1_hat = x + (1.0 - s) * v;
    mean = x0_hat * (1.0 - s_prev) + x1_hat * torch::sqrt(s_prev.pow(2) - std_dev_t.pow(2));
    step_std = std_dev_t;
  } else {
    internal::throw_unknown_value("sde_type", options.sde_type, {"sde", "cps", "dance_sde"});
  }

  torch::Tensor prev;
  if (options.prev_sample.defined()) {
    require(options.prev_sample.sizes() == sample.sizes(), "prev_sample",
            "must have the shape of sample");
    prev = f32(options.prev_sample).to(device);
  } else {
    auto noise = at::randn(x.sizes(), internal::to_c10(options.generator), x.options());
    prev = mean + step_std * noise;
  }
  // The sample is a constant of the density: only the mean carries the policy gradient. CPS's
  // log-prob drops the constants (its std is fixed per step), as flow_grpo's does: the ratios
  // and clip ranges tuned there assume exactly this scale.
  auto sq = (prev.detach() - mean).pow(2);
  auto logp = cps ? -sq : -sq / (2.0 * step_std.pow(2)) - torch::log(step_std) - kLogSqrtTwoPi;
  return {prev, mean_non_batch(logp), mean, std_dev_t, sqrt_dt};
}

SdeStepResult sde_step_with_logprob(const FlowMatchScheduler& scheduler,
                                    const torch::Tensor& model_output, const torch::Tensor& sample,
                                    const torch::Tensor& step_index,
                                    const SdeStepOptions& options) {
  require(step_index.defined() && !step_index.is_floating_point(), "step_index",
          "must be an integer tensor");
  const int64_t n = scheduler.num_steps();
  auto idx = step_index.to(torch::kCPU, torch::kLong);
  require(idx.numel() > 0 && idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < n,
          "step_index", "must lie in [0, " + std::to_string(n) + ")");
  auto flat = idx.reshape({-1});
  auto sigma = scheduler.sigmas.index_select(0, flat).reshape(idx.sizes());
  auto sigma_prev = scheduler.sigmas.index_select(0, flat + 1).reshape(idx.sizes());
  return sde_step_with_logprob_sigmas(model_output, sample, sigma, sigma_prev, scheduler.sigma(1),
                                      options);
}

SdeStepResult sde_step_with_logprob(const FlowMatchScheduler& scheduler,
                                    const torch::Tensor& model_output, const torch::Tensor& sample,
                                    int64_t step_index, const SdeStepOptions& options) {
  return sde_step_with_logprob(scheduler, model_output, sample,
                               torch::scalar_tensor(step_index, torch::kLong), options);
}

torch::Tensor cfg_combine(const torch::Tensor& v_uncond, const torch::Tensor& v_cond,
                          double guidance_scale) {
  require(v_uncond.sizes() == v_cond.sizes(), "v_cond", "must have the shape of v_uncond");
  auto u = f32(v_uncond);
  return u + guidance_scale * (f32(v_cond) - u);
}

torch::Tensor flow_interpolate(const torch::Tensor& x0, const torch::Tensor& eps,
                               const torch::Tensor& sigma) {
  require(x0.sizes() == eps.sizes(), "eps", "must have the shape of x0");
  auto s = per_sample_view(f32(sigma).to(x0.device()), x0.dim());
  return (1.0 - s) * f32(x0) + s * f32(eps);
}

torch::Tensor diffusion_target(const torch::Tensor& x0, const torch::Tensor& eps,
                               const std::string& prediction_type) {
  require(x0.sizes() == eps.sizes(), "eps", "must have the shape of x0");
  if (prediction_type == "flow_matching") return f32(eps) - f32(x0);
  if (prediction_type == "epsilon") return f32(eps);
  internal::throw_unknown_value("prediction_type", prediction_type, {"flow_matching", "epsilon"});
}

// ---------------------------------------------------------------------------------------------
// Advantages

torch::Tensor diffusion_group_advantages(const torch::Tensor& rewards,
                                         const std::vector<std::string>& uids,
                                         const DiffusionAdvantageConfig& config) {
  return diffusion_advantages_impl(rewards, uids, config);
}

torch::Tensor diffusion_group_advantages(const torch::Tensor& rewards,
                                         const std::vector<int64_t>& uids,
                                         const DiffusionAdvantageConfig& config) {
  return diffusion_advantages_impl(rewards, uids, config);
}

torch::Tensor broadcast_over_timesteps(const torch::Tensor& advantages, int64_t num_timesteps) {
  require(advantages.dim() == 1, "advantages", "must be [B]");
  require(num_timesteps >= 1, "num_timesteps", "must be >= 1");
  return advantages.unsqueeze(1).expand({advantages.size(0), num_timesteps}).contiguous();
}

// ---------------------------------------------------------------------------------------------
// Gradient accumulation

int64_t grad_accum_divisor(const std::string& algorithm, int64_t num_micro_batches,
                           int64_t num_timesteps) {
  require(num_micro_batches >= 1, "num_micro_batches",
          "must be >= 1, got " + std::to_string(num_micro_batches));
  if (algorithm == "flow_grpo" || algorithm == "ppo" || algorithm == "nft") {
    require(num_timesteps >= 1, "num_timesteps",
            "must be >= 1, got " + std::to_string(num_timesteps));
    return num_micro_batches * num_timesteps;
  }
  if (algorithm == "dpo") return num_micro_batches;
  internal::throw_unknown_value("algorithm", algorithm, {"flow_grpo", "ppo", "nft", "dpo"});
}

// ---------------------------------------------------------------------------------------------
// Flow-GRPO loss

FlowGrpoLossOutput flow_grpo_loss(const FlowGrpoLossInputs& in, const FlowGrpoLossConfig& config) {
  require(in.log_prob.defined() && in.log_prob.dim() == 1, "log_prob", "must be [B]");
  const int64_t b = in.log_prob.size(0);
  require(in.old_log_prob.defined() && in.old_log_prob.numel() == b, "old_log_prob",
          "must be [B] like log_prob");
  require(in.advantages.defined() && in.advantages.numel() == b, "advantages",
          "must be [B] like log_prob");
  require(config.clip_range >= 0.0, "clip_range", "must be >= 0");
  require(config.adv_clip_max > 0.0, "adv_clip_max", "must be > 0");
  require(config.loss_divisor > 0.0, "loss_divisor", "must be > 0");
  const auto device = in.log_prob.device();

  auto adv = f32(in.advantages)
                 .detach()
                 .to(device)
                 .reshape({b})
                 .clamp(-config.adv_clip_max, config.adv_clip_max);
  auto log_ratio = f32(in.log_prob) - f32(in.old_log_prob).detach().to(device).reshape({b});
  auto ratio = torch::exp(log_ratio);
  auto unclipped = -adv * ratio;
  auto clipped = -adv * torch::clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range);
  auto per_sample = torch::maximum(unclipped, clipped);
  if (in.rollout_is_weights.defined()) {
    require(in.rollout_is_weights.numel() == b, "rollout_is_weights", "must be [B]");
    per_sample = per_sample * f32(in.rollout_is_weights).detach().to(device).reshape({b});
  }
  auto policy_loss = per_sample.mean();

  auto kl_loss = torch::zeros({}, policy_loss.options());
  if (in.ref_prev_sample_mean.defined()) {
    require(in.prev_sample_mean.defined() &&
                in.prev_sample_mean.sizes() == in.ref_prev_sample_mean.sizes(),
            "prev_sample_mean", "must be given with the shape of ref_prev_sample_mean");
    require(in.std_dev_t.defined(), "std_dev_t", "is required for the KL term");
    auto sq = mean_non_batch(
        (f32(in.prev_sample_mean) - f32(in.ref_prev_sample_mean).detach().to(device)).pow(2));
    auto sd = flat_per_sample(f32(in.std_dev_t).detach().to(device));
    kl_loss = (sq / (2.0 * sd.pow(2))).mean();
  } else {
    require(config.beta == 0.0, "ref_prev_sample_mean", "is required when beta > 0");
  }

  auto total = config.beta != 0.0 ? policy_loss + config.beta * kl_loss : policy_loss;
  FlowGrpoLossOutput out;
  out.loss = total / config.loss_divisor;
  out.policy_loss = policy_loss.detach();
  out.kl_loss = kl_loss.detach();
  out.ppo_kl = (-log_ratio).mean().detach();
  out.clipfrac = ((ratio - 1.0).abs() > config.clip_range).to(torch::kFloat).mean().detach();
  return out;
}

}  // namespace shardrl::algos
