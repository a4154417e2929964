// Language-model advantage estimators as verl's core_algos computes them (compute_advantage's
// table): GAE, GRPO, RLOO, REINFORCE++ (with and without its group baseline) and ReMax, and the
// whitening they share.
#include <torch/torch.h>

#include "algos/internal.h"
#include "shardrl/algos.h"

namespace shardrl::algos {

using internal::f32;
using internal::require;

namespace {

// The per-row outcome scores' group means; a lone member's mean is 0, as verl's.
torch::Tensor group_means(const torch::Tensor& scores, const std::vector<int64_t>& uids,
                          std::vector<int64_t>* group_sizes = nullptr) {
  const auto s = internal::to_host_vector(scores, "scores");
  require(s.size() == uids.size(), "uids",
          "has " + std::to_string(uids.size()) + " entries for " + std::to_string(s.size()) +
              " responses");
  std::vector<double> mean(s.size(), 0.0);
  if (group_sizes) group_sizes->assign(s.size(), 1);
  for (const auto& group : internal::group_members(uids)) {
    double m = 0.0;
    if (group.size() > 1) {
      for (int64_t i : group) m += s[i];
      m /= static_cast<double>(group.size());
    }
    for (int64_t i : group) {
      mean[i] = m;
      if (group_sizes) (*group_sizes)[i] = static_cast<int64_t>(group.size());
    }
  }
  return torch::tensor(mean, torch::kDouble).to(scores.device(), torch::kFloat);
}

torch::Tensor sum_everywhere(const SumOverRanks& sum_over_ranks, torch::Tensor t) {
  return sum_over_ranks ? sum_over_ranks(std::move(t)) : t;
}

}  // namespace

torch::Tensor masked_whiten(const torch::Tensor& values, const torch::Tensor& mask,
                            const SumOverRanks& sum_over_ranks) {
  require(values.defined() && mask.defined() && values.sizes() == mask.sizes(), "mask",
          "must have the shape of values");
  const auto v = f32(values);
  const auto m = f32(mask).to(v.device());
  const auto keep = m.to(torch::kBool);
  const auto zero = torch::zeros_like(v);
  // Sums in fp64 and over every rank: the batch's statistics, whatever its split.
  const auto first = sum_everywhere(
      sum_over_ranks,
      torch::stack({torch::where(keep, v, zero).sum(), m.sum()}).to(torch::kCPU, torch::kDouble));
  const double count = first[1].item<double>();
  require(count >= 2, "response_mask",
          "whitening needs at least two response tokens in the batch, got " +
              std::to_string(static_cast<int64_t>(count)));
  const double mean = first[0].item<double>() / (count + 1e-8);
  const auto centered = v - mean;
  const auto second = sum_everywhere(sum_over_ranks, torch::where(keep, centered.square(), zero)
                                                         .sum()
                                                         .reshape({1})
                                                         .to(torch::kCPU, torch::kDouble));
  // verl: the masked mean of the squares, times count / (count - 1) (Bessel).
  const double var = second[0].item<double>() / (count + 1e-8) * count / (count - 1);
  return centered * (1.0 / std::sqrt(var + 1e-8));
}

Advantages compute_advantage(const AdvantageInputs& in, const AdvantageConfig& config) {
  require(in.token_level_rewards.defined() && in.token_level_rewards.dim() == 2,
          "token_level_rewards", "must be [B, L]");
  const auto shape = in.token_level_rewards.sizes();
  require(in.response_mask.defined() && in.response_mask.sizes() == shape, "response_mask",
          "must have the shape of token_level_rewards");
  const auto rewards = f32(in.token_level_rewards);
  const auto mask = f32(in.response_mask).to(rewards.device());
  const int64_t length = shape[1];
  const auto& estimator = config.adv_estimator;
  Advantages out;

  if (estimator == "gae") {
    require(in.values.defined() && in.values.sizes() == shape, "values",
            "gae needs the critic's values, shaped as token_level_rewards");
    require(config.gamma >= 0 && config.gamma <= 1, "gamma", "must be in [0, 1]");
    require(config.lam >= 0 && config.lam <= 1, "lam", "must be in [0, 1]");
    torch::NoGradGuard no_grad;
    const auto values = f32(in.values).to(rewards.device());
    auto next_values = torch::zeros({shape[0]}, rewards.options());
    auto last_gae = torch::zeros({shape[0]}, rewards.options());
    std::vector<torch::Tensor> reversed;
    for (int64_t t = length - 1; t >= 0; --t) {
      const auto m = mask.select(1, t), v = values.select(1, t);
      const auto delta = rewards.select(1, t) + config.gamma * next_values - v;
      const auto gae = delta + config.gamma * config.lam * last_gae;
      // Masked positions (observation tokens) carry the value and the advantage through.
      next_values = v * m + (1 - m) * next_values;
      last_gae = gae * m + (1 - m) * last_gae;
      reversed.push_back(last_gae);
    }
    std::reverse(reversed.begin(), reversed.end());
    const auto advantages =
        reversed.empty() ? torch::zeros_like(rewards) : torch::stack(reversed, 1);
    out.returns = advantages + values;
    out.advantages = masked_whiten(advantages, mask, config.sum_over_ranks);
    return out;
  }
  if (estimator == "grpo") {
    out.advantages = grpo_outcome_advantages(rewards, mask, in.uids, config.norm_adv_by_std_in_grpo,
                                             config.epsilon);
    out.returns = out.advantages;
    return out;
  }
  if (estimator == "rloo") {
    const auto scores = rewards.sum(-1);
    std::vector<int64_t> sizes;
    const auto mean = group_means(scores, in.uids, &sizes);
    const auto n = torch::tensor(sizes, torch::kLong).to(scores.device(), torch::kFloat);
    // Each response against the mean of the others: (s - mean_others) * (n - 1) / n scaled back,
    // i.e. n / (n - 1) * (s - mean); a lone response keeps its score.
    const auto scale = torch::where(n > 1, n / (n - 1).clamp_min(1), torch::ones_like(n));
    const auto adv = torch::where(n > 1, scores * scale - mean * scale, scores);
    out.advantages = adv.unsqueeze(-1) * mask;
    out.returns = out.advantages;
    return out;
  }
  if (estimator == "reinforce_plus_plus") {
    require(config.gamma >= 0 && config.gamma <= 1, "gamma", "must be in [0, 1]");
    torch::NoGradGuard no_grad;
    auto returns = torch::zeros_like(rewards);
    auto running = torch::zeros({shape[0]}, rewards.options());
    for (int64_t t = length - 1; t >= 0; --t) {
      const auto m = mask.select(1, t);
      const auto next = rewards.select(1, t) + config.gamma * running;
      returns.select(1, t).copy_(next * m);
      running = next * m + running * (1 - m);
    }
    out.advantages = masked_whiten(returns, mask, config.sum_over_ranks) * mask;
    out.returns = returns;
    return out;
  }
  if (estimator == "reinforce_plus_plus_baseline") {
    const auto scores = rewards.sum(-1);
    const auto centered = (scores - group_means(scores, in.uids)).unsqueeze(-1) * mask;
    out.advantages = masked_whiten(centered, mask, config.sum_over_ranks) * mask;
    out.returns = out.advantages;
    return out;
  }
  if (estimator == "remax") {
    require(in.reward_baselines.defined() && in.reward_baselines.dim() == 1 &&
                in.reward_baselines.size(0) == shape[0],
            "reward_baselines", "remax needs the greedy answer's reward of each row, [B]");
    out.returns = (rewards * mask).flip({-1}).cumsum(-1).flip({-1});
    out.advantages =
        out.returns - f32(in.reward_baselines).to(rewards.device()).unsqueeze(-1) * mask;
    return out;
  }
  internal::throw_unknown_value(
      "adv_estimator", estimator,
      {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"});
}

torch::Tensor overlong_penalty(const torch::Tensor& response_lengths, int64_t max_response_length,
                               int64_t buffer_len, double penalty_factor) {
  require(response_lengths.defined() && response_lengths.dim() == 1, "response_lengths",
          "must be [B]");
  require(buffer_len > 0 && buffer_len <= max_response_length, "overlong_buffer.len",
          "must be in [1, " + std::to_string(max_response_length) +
              "] (the response length), got " + std::to_string(buffer_len));
  const auto exceed = f32(response_lengths) - static_cast<double>(max_response_length - buffer_len);
  return (-exceed / static_cast<double>(buffer_len) * penalty_factor).clamp_max(0.0);
}

std::vector<int64_t> groups_to_keep(const torch::Tensor& metric, const std::vector<int64_t>& uids) {
  const auto v = internal::to_host_vector(metric, "metric");
  require(v.size() == uids.size(), "uids",
          "has " + std::to_string(uids.size()) + " entries for " + std::to_string(v.size()) +
              " responses");
  std::vector<int64_t> kept;
  for (const auto& group : internal::group_members(uids)) {
    bool varied = group.size() == 1;
    for (int64_t i : group) varied = varied || v[i] != v[group.front()];
    if (varied) kept.push_back(uids[group.front()]);
  }
  return kept;
}

}  // namespace shardrl::algos
