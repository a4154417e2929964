// Diffusion-DPO: online pairing, logit-normal timesteps and the loss (reference §3).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "algos/internal.h"
#include "shardrl/algos.h"

namespace shardrl::algos {

using internal::f32;
using internal::mean_non_batch;
using internal::require;

namespace {

template <typename Key>
DpoPairing make_pairs_impl(const std::vector<double>& rewards, const std::vector<Key>& uids) {
  require(rewards.size() == uids.size(), "uids",
          "has " + std::to_string(uids.size()) + " entries for " + std::to_string(rewards.size()) +
              " rewards");
  for (double r : rewards) {
    // NaN has no order; sorting on it would pair arbitrary samples.
    require(std::isfinite(r), "rewards", "must be finite");
  }
  DpoPairing pairing;
  for (auto group : internal::group_members(uids)) {
    if (group.size() < 2) {
      ++pairing.num_skipped_groups;
      continue;
    }
    std::stable_sort(group.begin(), group.end(),
                     [&](int64_t a, int64_t b) { return rewards[a] > rewards[b]; });
    const int64_t chosen = group.front();
    const int64_t rejected = group.back();
    // A reversed or cross-prompt pair would silently train the opposite preference.
    if (!(uids[chosen] == uids[rejected]) || rewards[chosen] < rewards[rejected]) {
      throw std::logic_error("dpo_make_pairs: inconsistent pair (" + std::to_string(chosen) + ", " +
                             std::to_string(rejected) + ")");
    }
    pairing.indices.push_back(chosen);
    pairing.indices.push_back(rejected);
  }
  return pairing;
}

}  // namespace

torch::Tensor DpoPairing::index_tensor() const {
  return torch::tensor(indices, torch::TensorOptions().dtype(torch::kLong));
}

DpoPairing dpo_make_pairs(const std::vector<double>& rewards,
                          const std::vector<std::string>& uids) {
  return make_pairs_impl(rewards, uids);
}

DpoPairing dpo_make_pairs(const std::vector<double>& rewards, const std::vector<int64_t>& uids) {
  return make_pairs_impl(rewards, uids);
}

DpoPairing dpo_make_pairs(const torch::Tensor& rewards, const std::vector<std::string>& uids) {
  return make_pairs_impl(internal::to_host_vector(rewards, "rewards"), uids);
}

DpoPairing dpo_make_pairs(const torch::Tensor& rewards, const std::vector<int64_t>& uids) {
  return make_pairs_impl(internal::to_host_vector(rewards, "rewards"), uids);
}

torch::Tensor dpo_sample_timestep_indices(int64_t n, int64_t num_train_timesteps,
                                          std::optional<at::Generator> generator) {
  require(n >= 0, "num_pairs", "must be >= 0");
  require(num_train_timesteps >= 1, "num_train_timesteps", "must be >= 1");
  auto u = torch::sigmoid(at::randn({n}, internal::to_c10(generator), torch::kFloat));
  // sigmoid rounds to exactly 1 in fp32 for large draws; keep the index in range.
  return torch::floor(u * static_cast<double>(num_train_timesteps))
      .to(torch::kLong)
      .clamp(0, num_train_timesteps - 1);
}

DpoTimesteps dpo_sample_timesteps(const FlowMatchScheduler& train_scheduler, int64_t num_pairs,
                                  std::optional<at::Generator> generator) {
  DpoTimesteps out;
  out.indices =
      dpo_sample_timestep_indices(num_pairs, train_scheduler.num_steps(), std::move(generator));
  auto idx = out.indices.to(train_scheduler.timesteps.device());
  out.timesteps = train_scheduler.timesteps.index_select(0, idx);
  out.sigmas = train_scheduler.sigmas.index_select(0, idx);
  return out;
}

torch::Tensor repeat_for_pairs(const torch::Tensor& per_pair) {
  require(per_pair.defined() && per_pair.dim() >= 1, "per_pair", "must have a pair dim");
  return per_pair.repeat_interleave(2, 0);
}

DpoLossOutput diffusion_dpo_loss(const torch::Tensor& model_pred, const torch::Tensor& ref_pred,
                                 const torch::Tensor& target, const DpoLossConfig& config) {
  require(model_pred.defined() && model_pred.dim() >= 1, "model_pred", "must have a batch dim");
  const int64_t n = model_pred.size(0);
  require(n > 0 && n % 2 == 0, "model_pred",
          "batch must be non-empty and even (chosen/rejected pairs), got " + std::to_string(n));
  require(ref_pred.defined() && ref_pred.sizes() == model_pred.sizes(), "ref_pred",
          "must have the shape of model_pred");
  require(target.defined() && target.sizes() == model_pred.sizes(), "target",
          "must have the shape of model_pred");
  require(config.loss_divisor > 0.0, "loss_divisor", "must be > 0");
  const auto device = model_pred.device();

  auto tgt = f32(target).detach().to(device);
  auto e_theta = mean_non_batch((f32(model_pred) - tgt).pow(2));
  auto e_ref = mean_non_batch((f32(ref_pred).detach().to(device) - tgt).pow(2));
  auto diff = (e_theta - e_ref).view({n / 2, 2});
  auto chosen = -0.5 * config.beta * diff.select(1, 0);
  auto rejected = -0.5 * config.beta * diff.select(1, 1);
  auto inside = chosen - rejected;

  DpoLossOutput out;
  out.loss = -torch::log_sigmoid(inside).mean() / config.loss_divisor;
  out.implicit_acc = (inside > 0).to(torch::kFloat).mean().detach();
  out.reward_margin = inside.mean().detach();
  out.chosen_reward = chosen.mean().detach();
  out.rejected_reward = rejected.mean().detach();
  out.model_mse = e_theta.mean().detach();
  out.ref_mse = e_ref.mean().detach();
  return out;
}

}  // namespace shardrl::algos
