// verl-omni's reverse-process losses beside Flow-GRPO's: Flow-DPPO, GRPO-Guard, the step KL
// ("kl", "distill_kl") and the flow-matching distillation MSE ("distill_fm_mse"), from
// verl_omni/trainer/diffusion/diffusion_algos.py (reference §7).
#include <torch/torch.h>

#include "algos/internal.h"
#include "shardrl/algos.h"

namespace shardrl::algos {

using internal::f32;
using internal::flat_per_sample;
using internal::mean_non_batch;
using internal::require;

namespace {

// The tensors every policy-gradient step loss reads, checked and on the log-prob's device.
struct PolicyStepTensors {
  torch::Tensor log_ratio, ratio, advantages, mean, old_mean, std_dev_t, sqrt_dt, weights;
};

PolicyStepTensors policy_step_tensors(const FlowGrpoLossInputs& in, const std::string& who) {
  require(in.log_prob.defined() && in.log_prob.dim() == 1, "log_prob", "must be [B]");
  const int64_t b = in.log_prob.size(0);
  const auto device = in.log_prob.device();
  auto per_sample = [&](const torch::Tensor& t, const char* name) {
    require(t.defined() && t.numel() == b, name, "must be [B] like log_prob (" + who + ")");
    return f32(t).detach().to(device).reshape({b});
  };
  // A step's std or sqrt(-dt): [B, 1, ...], [B] or 0-dim, as a [B] tensor.
  auto per_step = [&](const torch::Tensor& t, const char* name) {
    require(t.defined() && (t.numel() == b || t.numel() == 1), name,
            "must be [B] or a scalar (" + who + ")");
    return flat_per_sample(f32(t).detach().to(device)).expand({b});
  };
  require(in.prev_sample_mean.defined() && in.prev_sample_mean.size(0) == b, "prev_sample_mean",
          "must be [B, ...] (" + who + ")");
  require(in.old_prev_sample_mean.defined() &&
              in.old_prev_sample_mean.sizes() == in.prev_sample_mean.sizes(),
          "old_prev_sample_mean", "must have the shape of prev_sample_mean (" + who + ")");
  PolicyStepTensors t;
  t.log_ratio = f32(in.log_prob) - per_sample(in.old_log_prob, "old_log_prob");
  t.ratio = torch::exp(t.log_ratio);
  t.advantages = per_sample(in.advantages, "advantages");
  t.mean = f32(in.prev_sample_mean);
  t.old_mean = f32(in.old_prev_sample_mean).detach().to(device);
  t.std_dev_t = per_step(in.std_dev_t, "std_dev_t");
  t.sqrt_dt = per_step(in.sqrt_dt, "sqrt_dt");
  if (in.rollout_is_weights.defined()) t.weights = per_sample(in.rollout_is_weights, "weights");
  return t;
}

torch::Tensor weighted_mean(const torch::Tensor& per_sample, const torch::Tensor& weights) {
  return (weights.defined() ? per_sample * weights : per_sample).mean();
}

}  // namespace

torch::Tensor step_kl_loss(const torch::Tensor& prev_sample_mean, const torch::Tensor& other_mean,
                           const torch::Tensor& std_dev_t) {
  require(prev_sample_mean.defined() && other_mean.defined() &&
              prev_sample_mean.sizes() == other_mean.sizes(),
          "other_mean", "must have the shape of prev_sample_mean");
  require(std_dev_t.defined(), "std_dev_t", "is required for the step KL");
  const auto device = prev_sample_mean.device();
  auto sq = mean_non_batch((f32(prev_sample_mean) - f32(other_mean).detach().to(device)).pow(2));
  auto sd = flat_per_sample(f32(std_dev_t).detach().to(device));
  return (sq / (2.0 * sd.pow(2))).mean();
}

torch::Tensor distill_fm_mse_loss(const torch::Tensor& noise_pred,
                                  const torch::Tensor& teacher_noise_pred) {
  require(noise_pred.defined() && teacher_noise_pred.defined() &&
              noise_pred.sizes() == teacher_noise_pred.sizes(),
          "teacher_noise_pred", "must have the shape of noise_pred");
  return (f32(noise_pred) - f32(teacher_noise_pred).detach().to(noise_pred.device())).pow(2).mean();
}

PolicyStepLossOutput flow_dppo_loss(const FlowGrpoLossInputs& in,
                                    const FlowDppoLossConfig& config) {
  require(config.kl_mask_threshold > 0, "kl_mask_threshold", "must be > 0");
  require(config.loss_divisor > 0, "loss_divisor", "must be > 0");
  const auto t = policy_step_tensors(in, "flow_dppo");
  auto unclipped = -t.advantages * t.ratio;
  // The exact KL between the new and old step Gaussians, which share their std.
  auto sq = (t.mean - t.old_mean).pow(2);
  auto kl = config.add_kl_coefficient
                ? mean_non_batch(sq) / (2.0 * (t.std_dev_t * t.sqrt_dt).pow(2))
                : mean_non_batch(sq) / 2.0;
  auto high_kl = kl.detach() >= config.kl_mask_threshold;
  auto moving_away =
      ((t.ratio > 1.0) & (t.advantages > 0)) | ((t.ratio < 1.0) & (t.advantages < 0));
  auto masked = (high_kl & moving_away).detach();
  auto per_sample = torch::where(masked, torch::zeros_like(unclipped), unclipped);
  auto policy_loss = weighted_mean(per_sample, t.weights);
  PolicyStepLossOutput out;
  out.loss = policy_loss / config.loss_divisor;
  out.policy_loss = policy_loss.detach();
  out.ppo_kl = (-t.log_ratio).mean().detach();
  out.clipfrac = torch::zeros({}, policy_loss.options());
  out.ratio_mean = t.ratio.mean().detach();
  out.kl_new_old = kl.mean().detach();
  out.masked_fraction = masked.to(torch::kFloat).mean();
  return out;
}

PolicyStepLossOutput grpo_guard_loss(const FlowGrpoLossInputs& in,
                                     const FlowGrpoLossConfig& config) {
  require(config.clip_range >= 0, "clip_range", "must be >= 0");
  require(config.adv_clip_max > 0, "adv_clip_max", "must be > 0");
  require(config.loss_divisor > 0, "loss_divisor", "must be > 0");
  const auto t = policy_step_tensors(in, "grpo_guard");
  auto adv = t.advantages.clamp(-config.adv_clip_max, config.adv_clip_max);
  auto scale = t.sqrt_dt * t.std_dev_t;
  // The mean's drift on the log-ratio's scale: what a ratio of 1 hides when both the sample and
  // the mean move.
  auto bias = mean_non_batch((t.mean - t.old_mean).pow(2)) / (2.0 * scale.pow(2));
  auto ratio = torch::exp((t.log_ratio + bias) * scale);
  auto unclipped = -adv * ratio;
  auto clipped = -adv * torch::clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range);
  auto per_sample = torch::maximum(unclipped, clipped) / t.sqrt_dt.pow(2);
  auto policy_loss = weighted_mean(per_sample, t.weights);
  PolicyStepLossOutput out;
  out.loss = policy_loss / config.loss_divisor;
  out.policy_loss = policy_loss.detach();
  out.ppo_kl = (-t.log_ratio).mean().detach();
  out.clipfrac = ((ratio - 1.0).abs() > config.clip_range).to(torch::kFloat).mean().detach();
  out.ratio_mean = ratio.mean().detach();
  out.kl_new_old = torch::zeros({}, policy_loss.options());
  out.masked_fraction = torch::zeros({}, policy_loss.options());
  return out;
}

}  // namespace shardrl::algos
