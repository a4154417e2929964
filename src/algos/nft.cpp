// DiffusionNFT: reward probabilities, training-timestep selection, the NFT loss, and the EMA of
// the "old" adapter (reference §2).
#include <torch/torch.h>

#include <algorithm>

#include "algos/internal.h"
#include "shardrl/algos.h"

namespace shardrl::algos {

using internal::f32;
using internal::mean_non_batch;
using internal::per_sample_view;
using internal::require;

torch::Tensor nft_reward_prob(const torch::Tensor& advantages, const std::string& adv_mode,
                              double adv_clip_max) {
  require(adv_clip_max > 0.0, "adv_clip_max", "must be > 0");
  const double c = adv_clip_max;
  auto a = f32(advantages).clamp(-c, c);
  if (adv_mode == "continuous") {
  } else if (adv_mode == "positive_only") {
    a = a.clamp(0.0, c);
  } else if (adv_mode == "negative_only") {
    a = a.clamp(-c, 0.0);
  } else if (adv_mode == "one_only") {
    a = (a > 0).to(torch::kFloat);
  } else if (adv_mode == "binary") {
    a = torch::sign(a);
  } else {
    internal::throw_unknown_value(
        "adv_mode", adv_mode,
        {"continuous", "positive_only", "negative_only", "one_only", "binary"});
  }
  // The mapping runs after the mode on purpose: the reference trains with r = 0.6, not 1, for
  // one_only/binary positives at c = 5, and matching it keeps published recipes reproducible.
  return (a / c / 2.0 + 0.5).clamp(0.0, 1.0);
}

NftTimestepSelection nft_select_train_timesteps(const torch::Tensor& rollout_timesteps,
                                                double timestep_fraction,
                                                std::optional<at::Generator> generator) {
  require(rollout_timesteps.defined() && rollout_timesteps.dim() == 2, "rollout_timesteps",
          "must be [B, T]");
  require(timestep_fraction > 0.0 && timestep_fraction <= 1.0, "timestep_fraction",
          "must be in (0, 1], got " + std::to_string(timestep_fraction));
  const int64_t b = rollout_timesteps.size(0);
  const int64_t t = rollout_timesteps.size(1);
  require(t >= 1, "rollout_timesteps", "has no timesteps");
  // Truncation, as Python's int() in the reference.
  const int64_t k =
      std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(t) * timestep_fraction));
  const auto gen = internal::to_c10(generator);
  std::vector<torch::Tensor> rows;
  rows.reserve(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) rows.push_back(torch::randperm(t, gen, torch::kLong));
  auto perms = b > 0 ? torch::stack(rows) : torch::zeros({0, t}, torch::kLong);
  NftTimestepSelection sel;
  sel.indices = perms.slice(1, 0, k).contiguous();
  sel.timesteps = rollout_timesteps.gather(1, sel.indices.to(rollout_timesteps.device()));
  return sel;
}

NftLossOutput nft_loss(const NftLossInputs& in, const NftLossConfig& config) {
  require(in.x0.defined() && in.x0.dim() >= 1, "x0", "must have a batch dim");
  const auto shape = in.x0.sizes();
  require(in.v.defined() && in.v.sizes() == shape, "v", "must have the shape of x0");
  require(in.v_old.defined() && in.v_old.sizes() == shape, "v_old", "must have the shape of x0");
  require(in.xt.defined() && in.xt.sizes() == shape, "xt", "must have the shape of x0");
  require(in.t.defined(), "t", "is required");
  require(in.r.defined(), "r", "is required");
  require(config.beta > 0.0, "beta", "must be > 0");
  require(config.adv_clip_max > 0.0, "adv_clip_max", "must be > 0");
  require(config.loss_divisor > 0.0, "loss_divisor", "must be > 0");
  require(config.adaptive_weight_min > 0.0, "adaptive_weight_min", "must be > 0");
  const int64_t nd = in.x0.dim();
  const auto device = in.v.device();
  const double beta = config.beta;

  auto v = f32(in.v);
  auto v_old = f32(in.v_old).detach().to(device);
  auto x0 = f32(in.x0).detach().to(device);
  auto xt = f32(in.xt).detach().to(device);
  auto t = per_sample_view(f32(in.t).detach().to(device), nd);
  auto r = internal::flat_per_sample(f32(in.r).detach().to(device));

  auto v_pos = beta * v + (1.0 - beta) * v_old;
  auto v_neg = (1.0 + beta) * v_old - beta * v;
  auto xp = xt - t * v_pos;
  auto xn = xt - t * v_neg;
  // Adaptive per-sample weights normalise the x0 error scale across timesteps; they are
  // constants of the loss (fp64 as in the reference, so tiny errors do not underflow the clamp).
  auto weight = [&](const torch::Tensor& pred) {
    torch::NoGradGuard no_grad;
    return mean_non_batch((pred.detach().to(torch::kDouble) - x0.to(torch::kDouble)).abs())
        .clamp_min(config.adaptive_weight_min)
        .to(torch::kFloat);
  };
  auto l_pos = mean_non_batch((xp - x0).pow(2)) / weight(xp);
  auto l_neg = mean_non_batch((xn - x0).pow(2)) / weight(xn);
  auto policy_loss = ((r * l_pos + (1.0 - r) * l_neg) / beta).mean() * config.adv_clip_max;

  auto ref_loss = torch::zeros({}, policy_loss.options());
  if (in.v_ref.defined()) {
    require(in.v_ref.sizes() == shape, "v_ref", "must have the shape of x0");
    ref_loss = mean_non_batch((v - f32(in.v_ref).detach().to(device)).pow(2)).mean();
  } else {
    require(config.ref_kl_coef == 0.0, "v_ref", "is required when ref_kl_coef > 0");
  }

  auto total =
      config.ref_kl_coef != 0.0 ? policy_loss + config.ref_kl_coef * ref_loss : policy_loss;
  NftLossOutput out;
  out.loss = total / config.loss_divisor;
  out.policy_loss = policy_loss.detach();
  out.ref_loss = ref_loss.detach();
  out.positive_loss = l_pos.mean().detach();
  out.negative_loss = l_neg.mean().detach();
  return out;
}

EmaDecaySchedule ema_decay_schedule(const std::string& decay_schedule) {
  if (decay_schedule == "copy") return {0, 0.0, 0.0};
  if (decay_schedule == "linear_to_0_5") return {0, 0.001, 0.5};
  if (decay_schedule == "delayed_linear_to_0_999") return {75, 0.0075, 0.999};
  internal::throw_unknown_value("decay_schedule", decay_schedule,
                                {"copy", "linear_to_0_5", "delayed_linear_to_0_999"});
}

double ema_decay(const EmaDecaySchedule& schedule, int64_t step) {
  if (step < schedule.flat_steps) return 0.0;
  return std::min(static_cast<double>(step - schedule.flat_steps) * schedule.rate,
                  schedule.max_decay);
}

double ema_decay(const std::string& decay_schedule, int64_t step) {
  return ema_decay(ema_decay_schedule(decay_schedule), step);
}

void ema_update(const std::vector<torch::Tensor>& target, const std::vector<torch::Tensor>& source,
                double decay) {
  require(target.size() == source.size(), "source",
          "has " + std::to_string(source.size()) + " tensors for " + std::to_string(target.size()) +
              " targets");
  require(decay >= 0.0 && decay <= 1.0, "decay", "must be in [0, 1], got " + std::to_string(decay));
  for (size_t i = 0; i < target.size(); ++i) {
    require(target[i].sizes() == source[i].sizes(), "source",
            "tensor " + std::to_string(i) + " differs in shape from its target");
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < target.size(); ++i) {
    auto t = target[i];  // shares storage: the update lands in the caller's tensor
    auto s = source[i].detach().to(t.options());
    if (decay == 0.0) {
      t.copy_(s);
    } else {
      t.mul_(decay).add_(s, 1.0 - decay);
    }
  }
}

}  // namespace shardrl::algos
