// Language-model policy losses (verl's loss modes), loss aggregation, entropy, KL penalties and
// GRPO advantages, following verl's core_algos (reference §4).
#include <torch/torch.h>

#include <cmath>

#include "algos/internal.h"
#include "shardrl/algos.h"

namespace shardrl::algos {

using internal::f32;
using internal::require;

namespace {

template <typename Key>
torch::Tensor grpo_scores_impl(const torch::Tensor& scores, const std::vector<Key>& uids,
                               bool norm_adv_by_std, double eps) {
  const std::vector<double> s = internal::to_host_vector(scores, "scores");
  require(s.size() == uids.size(), "uids",
          "has " + std::to_string(uids.size()) + " entries for " + std::to_string(s.size()) +
              " scores");
  std::vector<double> adv(s.size(), 0.0);
  for (const auto& group : internal::group_members(uids)) {
    // verl's convention: a lone response is judged by its raw score.
    double mean = 0.0;
    double sd = 1.0;
    if (group.size() > 1) {
      for (int64_t i : group) mean += s[i];
      mean /= static_cast<double>(group.size());
      double ss = 0.0;
      for (int64_t i : group) ss += (s[i] - mean) * (s[i] - mean);
      sd = std::sqrt(ss / static_cast<double>(group.size() - 1));
    }
    for (int64_t i : group) adv[i] = norm_adv_by_std ? (s[i] - mean) / (sd + eps) : s[i] - mean;
  }
  return torch::tensor(adv, torch::TensorOptions().dtype(torch::kDouble))
      .to(scores.device(), torch::kFloat);
}

template <typename Key>
torch::Tensor grpo_outcome_impl(const torch::Tensor& token_level_rewards,
                                const torch::Tensor& response_mask, const std::vector<Key>& uids,
                                bool norm_adv_by_std, double eps) {
  require(token_level_rewards.defined() && token_level_rewards.dim() == 2, "token_level_rewards",
          "must be [B, L]");
  require(response_mask.defined() && response_mask.sizes() == token_level_rewards.sizes(),
          "response_mask", "must have the shape of token_level_rewards");
  auto adv = grpo_scores_impl(f32(token_level_rewards).sum(-1), uids, norm_adv_by_std, eps);
  return adv.unsqueeze(-1) * f32(response_mask).to(adv.device());
}

// Masked-out entries contribute an exact 0 even when they hold inf/NaN (padding garbage).
torch::Tensor masked_sum(const torch::Tensor& values, const torch::Tensor& mask,
                         c10::optional<int64_t> dim) {
  auto v = torch::where(mask.to(torch::kBool), values, torch::zeros_like(values));
  return dim ? v.sum(*dim) : v.sum();
}

}  // namespace

torch::Tensor grpo_score_advantages(const torch::Tensor& scores,
                                    const std::vector<std::string>& uids, bool norm_adv_by_std,
                                    double eps) {
  return grpo_scores_impl(scores, uids, norm_adv_by_std, eps);
}

torch::Tensor grpo_score_advantages(const torch::Tensor& scores, const std::vector<int64_t>& uids,
                                    bool norm_adv_by_std, double eps) {
  return grpo_scores_impl(scores, uids, norm_adv_by_std, eps);
}

torch::Tensor grpo_outcome_advantages(const torch::Tensor& token_level_rewards,
                                      const torch::Tensor& response_mask,
                                      const std::vector<std::string>& uids, bool norm_adv_by_std,
                                      double eps) {
  return grpo_outcome_impl(token_level_rewards, response_mask, uids, norm_adv_by_std, eps);
}

torch::Tensor grpo_outcome_advantages(const torch::Tensor& token_level_rewards,
                                      const torch::Tensor& response_mask,
                                      const std::vector<int64_t>& uids, bool norm_adv_by_std,
                                      double eps) {
  return grpo_outcome_impl(token_level_rewards, response_mask, uids, norm_adv_by_std, eps);
}

torch::Tensor masked_mean(const torch::Tensor& values, const torch::Tensor& mask) {
  require(values.sizes() == mask.sizes(), "mask", "must have the shape of values");
  auto m = f32(mask).to(values.device());
  return masked_sum(f32(values), m, c10::nullopt) / (m.sum() + 1e-8);
}

torch::Tensor agg_loss(const torch::Tensor& loss_mat, const torch::Tensor& loss_mask,
                       const std::string& loss_agg_mode, double loss_scale_factor) {
  require(loss_mat.defined() && loss_mat.dim() == 2, "loss_mat", "must be [B, L]");
  require(loss_mask.defined() && loss_mask.sizes() == loss_mat.sizes(), "loss_mask",
          "must have the shape of loss_mat");
  auto loss = f32(loss_mat);
  auto mask = f32(loss_mask).to(loss.device());
  if (loss_agg_mode == "token-mean") return masked_mean(loss, mask);
  if (loss_agg_mode == "token-sum") return masked_sum(loss, mask, c10::nullopt);
  if (loss_agg_mode == "seq-mean-token-sum" || loss_agg_mode == "seq-mean-token-mean" ||
      loss_agg_mode == "seq-mean-token-sum-norm") {
    auto tokens = mask.sum(-1);
    auto seq = masked_sum(loss, mask, -1);
    if (loss_agg_mode == "seq-mean-token-mean") seq = seq / (tokens + 1e-8);
    // A fully masked sequence (e.g. padding rows of a micro-batch) must not dilute the mean.
    auto out = masked_mean(seq, (tokens > 0).to(torch::kFloat));
    if (loss_agg_mode == "seq-mean-token-sum-norm") {
      // verl's default divisor is the padded response length, a constant of the run.
      out =
          out / (loss_scale_factor > 0 ? loss_scale_factor : static_cast<double>(loss_mat.size(1)));
    }
    return out;
  }
  internal::throw_unknown_value("loss_agg_mode", loss_agg_mode,
                                {"token-mean", "token-sum", "seq-mean-token-sum",
                                 "seq-mean-token-mean", "seq-mean-token-sum-norm"});
}

namespace {

// PPO's clipped ratio per token, with the dual clip for A < 0 (verl's "vanilla").
PolicyLossOutput vanilla_policy_loss(const torch::Tensor& old_log_prob,
                                     const torch::Tensor& log_prob, const torch::Tensor& adv,
                                     const torch::Tensor& mask, const PolicyLossConfig& config) {
  require(config.clip_ratio_c > 1.0, "clip_ratio_c",
          "must be > 1, got " + std::to_string(config.clip_ratio_c));
  // Clamped so that a stale or garbage log-prob cannot overflow exp().
  auto log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0);
  auto ratio = torch::exp(log_ratio);

  auto l1 = -adv * ratio;
  auto l2 = -adv * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high);
  auto c1 = torch::maximum(l1, l2);
  // For A < 0 a huge ratio makes c1 unbounded; the dual clip caps it at -A * c.
  auto l3 = -adv * config.clip_ratio_c;
  auto c2 = torch::minimum(l3, c1);
  auto negative = adv < 0;

  PolicyLossOutput out;
  out.pg_losses = torch::where(negative, c2, c1);
  out.pg_loss = agg_loss(out.pg_losses, mask, config.loss_agg_mode, config.loss_scale_factor);
  out.pg_clipfrac = masked_mean((l2 > l1).to(torch::kFloat), mask).detach();
  out.ppo_kl = masked_mean(-log_ratio, mask).detach();
  out.pg_clipfrac_lower = masked_mean(((c1 > l3) & negative).to(torch::kFloat), mask).detach();
  return out;
}

// GSPO: every token of a row carries the row's ratio exp(mean log-ratio), its gradient the
// token's own (log_prob - sg(log_prob) + sg(mean log-ratio)).
PolicyLossOutput gspo_policy_loss(const torch::Tensor& old_log_prob, const torch::Tensor& log_prob,
                                  const torch::Tensor& adv, const torch::Tensor& mask,
                                  const PolicyLossConfig& config) {
  const auto log_ratio = log_prob - old_log_prob;
  const auto lengths = mask.sum(-1).clamp_min(1);
  const auto seq_log_ratio = masked_sum(log_ratio, mask, -1) / lengths;
  const auto token_log_ratio =
      (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp_max(10.0);
  const auto ratio = torch::exp(token_log_ratio);
  const auto l1 = -adv * ratio;
  const auto l2 = -adv * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high);
  PolicyLossOutput out;
  out.pg_losses = torch::maximum(l1, l2);
  out.pg_loss = agg_loss(out.pg_losses, mask, "seq-mean-token-mean");
  out.pg_clipfrac = masked_mean((l2 > l1).to(torch::kFloat), mask).detach();
  out.ppo_kl = masked_mean(-log_ratio, mask).detach();
  out.pg_clipfrac_lower = torch::zeros({}, out.pg_loss.options());
  return out;
}

// GPG: the plain policy gradient -log_prob * A.
PolicyLossOutput gpg_policy_loss(const torch::Tensor& old_log_prob, const torch::Tensor& log_prob,
                                 const torch::Tensor& adv, const torch::Tensor& mask,
                                 const PolicyLossConfig& config) {
  PolicyLossOutput out;
  out.pg_losses = -log_prob * adv;
  out.pg_loss = agg_loss(out.pg_losses, mask, config.loss_agg_mode, config.loss_scale_factor);
  out.pg_clipfrac = torch::zeros({}, out.pg_loss.options());
  out.ppo_kl = masked_mean(old_log_prob - log_prob, mask).detach();
  out.pg_clipfrac_lower = out.pg_clipfrac;
  return out;
}

// GMPO: token log-ratios clipped on the side the advantage's sign pushes, their masked mean the
// row's log-ratio, times the row's mean advantage; the mean over every row of the batch.
PolicyLossOutput geo_mean_policy_loss(const torch::Tensor& old_log_prob,
                                      const torch::Tensor& log_prob, const torch::Tensor& adv,
                                      const torch::Tensor& mask, const PolicyLossConfig& config) {
  const auto log_ratio = log_prob - old_log_prob;
  const auto sign = torch::sign(adv);
  const auto clamped = log_ratio.clamp(-config.clip_ratio_low, config.clip_ratio_high);
  const auto clipped_log_ratio = sign * torch::minimum(sign * log_ratio, sign * clamped);
  const auto tokens = mask.sum(-1);
  const auto ratio = torch::exp(masked_sum(clipped_log_ratio, mask, -1) / (tokens + 1e-8));
  const auto seq_adv = masked_sum(adv, mask, -1) / (tokens + 1e-8);
  PolicyLossOutput out;
  out.pg_losses = -seq_adv * ratio;
  out.pg_loss = out.pg_losses.mean();
  const auto clipped = (log_ratio != clamped).detach();
  out.pg_clipfrac = masked_mean((clipped & (adv > 0)).to(torch::kFloat), mask).detach();
  out.ppo_kl = masked_mean(-log_ratio, mask).detach();
  out.pg_clipfrac_lower = masked_mean((clipped & (adv < 0)).to(torch::kFloat), mask).detach();
  return out;
}

}  // namespace

PolicyLossOutput compute_policy_loss(const torch::Tensor& old_log_prob,
                                     const torch::Tensor& log_prob, const torch::Tensor& advantages,
                                     const torch::Tensor& response_mask,
                                     const PolicyLossConfig& config) {
  require(log_prob.defined() && log_prob.dim() == 2, "log_prob", "must be [B, L]");
  const auto shape = log_prob.sizes();
  require(old_log_prob.defined() && old_log_prob.sizes() == shape, "old_log_prob",
          "must have the shape of log_prob");
  require(advantages.defined() && advantages.sizes() == shape, "advantages",
          "must have the shape of log_prob");
  require(response_mask.defined() && response_mask.sizes() == shape, "response_mask",
          "must have the shape of log_prob");
  require(config.clip_ratio_low >= 0.0 && config.clip_ratio_low < 1.0, "clip_ratio_low",
          "must be in [0, 1)");
  require(config.clip_ratio_high >= 0.0, "clip_ratio_high", "must be >= 0");
  const auto device = log_prob.device();
  const auto mask = f32(response_mask).to(device);
  const auto adv = f32(advantages).detach().to(device);
  const auto lp = f32(log_prob);
  const auto old = f32(old_log_prob).detach().to(device);
  const auto& mode = config.loss_mode;
  if (mode == "vanilla") return vanilla_policy_loss(old, lp, adv, mask, config);
  if (mode == "gspo") return gspo_policy_loss(old, lp, adv, mask, config);
  if (mode == "gpg") return gpg_policy_loss(old, lp, adv, mask, config);
  if (mode == "geo_mean") return geo_mean_policy_loss(old, lp, adv, mask, config);
  internal::throw_unknown_value("loss_mode", mode, {"vanilla", "gspo", "gpg", "geo_mean"});
}

ValueLossOutput compute_value_loss(const torch::Tensor& vpreds, const torch::Tensor& returns,
                                   const torch::Tensor& values, const torch::Tensor& response_mask,
                                   double cliprange_value, const std::string& loss_agg_mode,
                                   double loss_scale_factor) {
  require(returns.sizes() == vpreds.sizes() && values.sizes() == vpreds.sizes() &&
              response_mask.sizes() == vpreds.sizes(),
          "values", "vpreds, returns, values and response_mask must share one [B, L] shape");
  require(cliprange_value >= 0, "cliprange_value", "must be >= 0");
  const auto v = f32(vpreds);
  const auto old = f32(values).to(v.device());
  const auto target = f32(returns).to(v.device());
  const auto mask = f32(response_mask).to(v.device());
  // verl's clip_by_value: max(min(x, high), low).
  const auto clipped = torch::max(torch::min(v, old + cliprange_value), old - cliprange_value);
  const auto unclipped_losses = (v - target).pow(2);
  const auto clipped_losses = (clipped - target).pow(2);
  ValueLossOutput out;
  out.vf_loss = 0.5 * agg_loss(torch::max(unclipped_losses, clipped_losses), mask, loss_agg_mode,
                               loss_scale_factor);
  out.vf_clipfrac =
      masked_mean(torch::gt(clipped_losses, unclipped_losses).to(torch::kFloat), mask).detach();
  return out;
}

torch::Tensor entropy_from_logits(const torch::Tensor& logits) {
  require(logits.defined() && logits.dim() >= 1, "logits", "must have a vocabulary dim");
  const auto l = f32(logits);
  return torch::logsumexp(l, -1) - (torch::softmax(l, -1) * l).sum(-1);
}

torch::Tensor kl_penalty(const torch::Tensor& log_prob, const torch::Tensor& ref_log_prob,
                         const std::string& penalty) {
  require(log_prob.sizes() == ref_log_prob.sizes(), "ref_log_prob",
          "must have the shape of log_prob");
  auto lp = f32(log_prob);
  auto ref = f32(ref_log_prob).to(lp.device());
  if (penalty == "kl" || penalty == "k1") return lp - ref;
  if (penalty == "abs") return (lp - ref).abs();
  if (penalty == "mse" || penalty == "k2") return 0.5 * (lp - ref).pow(2);
  if (penalty == "low_var_kl" || penalty == "k3") {
    // k3 is unbiased and always >= 0 but exp() explodes for far-off tokens; the clamps keep a
    // single such token from dominating the batch.
    auto d = (ref - lp).clamp(-20.0, 20.0);
    return (torch::exp(d) - d - 1.0).clamp(-10.0, 10.0);
  }
  internal::throw_unknown_value("kl_penalty", penalty,
                                {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"});
}

}  // namespace shardrl::algos
