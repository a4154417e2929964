// verl's LLM advantage estimators, policy losses and DAPO's reward shaping and group filter
// (algos::compute_advantage, compute_policy_loss, overlong_penalty, groups_to_keep) against
// tests/python/verl_lm_algos_reference.py, written from verl's core_algos.py, on fixed tensors with
// right padding, a masked hole inside a response, groups of three, two and one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "shardrl/algos.h"
#include "shardrl/models/weights.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

constexpr double kGamma = 0.9, kLam = 0.95, kLow = 0.2, kHigh = 0.28, kClipC = 3.0,
                 kClipValue = 0.5;
const std::vector<std::string> kEstimators = {
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"};
const std::vector<std::string> kLossModes = {"vanilla", "gspo", "gpg", "geo_mean"};
const std::vector<std::string> kAggModes = {"token-mean", "token-sum", "seq-mean-token-sum",
                                            "seq-mean-token-mean", "seq-mean-token-sum-norm"};

struct Fixture {
  std::map<std::string, torch::Tensor> in;
  std::vector<int64_t> uids = {0, 0, 0, 1, 1, 2, 3};  // groups of 3, 2, 1 and 1
};

Fixture fixture() {
  Fixture f;
  auto g = at::make_generator<at::CPUGeneratorImpl>(44);
  // Right padding of several lengths; row 3 has a masked (observation) token inside.
  const auto mask = torch::tensor({{1, 1, 1, 1, 0, 0},
                                   {1, 1, 0, 0, 0, 0},
                                   {1, 1, 1, 1, 1, 1},
                                   {1, 1, 0, 1, 1, 0},
                                   {1, 0, 0, 0, 0, 0},
                                   {1, 1, 1, 0, 0, 0},
                                   {1, 1, 1, 1, 0, 0}},
                                  torch::kFloat);
  const auto outcome = torch::tensor({1.0f, 0.0f, 1.0f, 0.5f, -1.0f, 1.0f, 0.0f});
  const auto last = torch::tensor({3, 1, 5, 4, 0, 2, 3}, torch::kLong);
  auto rewards = 0.1 * at::randn({7, 6}, g) * mask;
  rewards.scatter_add_(1, last.unsqueeze(1), outcome.unsqueeze(1));
  // Outside the mask the log-probs and advantages hold finite garbage that must not count.
  const auto garbage = 7.0 * (1 - mask);
  const auto old_log_prob = -2.0 * at::rand({7, 6}, g) * mask + garbage;
  // One token past the dual clip: ratio e^1.5 > clip_ratio_c with A < 0.
  const auto dual = torch::zeros({7, 6});
  dual[0][1] = 1.5;
  auto advantages = at::randn({7, 6}, g) * mask;
  advantages[0][1] = -1.0;
  f.in = {
      {"rewards", rewards},
      {"mask", mask},
      {"values", at::randn({7, 6}, g)},
      {"old_log_prob", old_log_prob},
      // A step of the policy, wide enough that some ratios leave the clip range.
      {"log_prob", old_log_prob + 0.8 * at::randn({7, 6}, g) * mask * (dual == 0) + dual - garbage},
      {"advantages", advantages + garbage},
      {"reward_baselines", torch::tensor({0.5f, 0.5f, 0.5f, 1.0f, 1.0f, 0.0f, -0.5f})},
      {"logits", 3.0 * at::randn({7, 6, 5}, g)},
      {"uids", torch::tensor(f.uids, torch::kLong)},
      {"config", torch::tensor({kGamma, kLam, kLow, kHigh, kClipC}, torch::kDouble)},
      // Group 0's metric is all equal (dropped), group 1's varies, 2 and 3 are alone.
      {"metric", torch::tensor({1.0f, 1.0f, 1.0f, 0.5f, 0.2f, 3.0f, 4.0f})},
      {"overlong_config", torch::tensor({6.0, 3.0, 0.5}, torch::kDouble)}};
  // The critic's new predictions, some further than critic.cliprange_value from its old values.
  f.in["vpreds"] = f.in["values"] + 0.9 * at::randn({7, 6}, g);
  f.in["returns"] = at::randn({7, 6}, g);
  f.in["cliprange_value"] = torch::tensor({kClipValue}, torch::kDouble);
  return f;
}

algos::Advantages advantages_of(const Fixture& f, const std::string& estimator,
                                bool norm_by_std = true) {
  algos::AdvantageInputs in;
  in.token_level_rewards = f.in.at("rewards");
  in.response_mask = f.in.at("mask");
  in.uids = f.uids;
  in.values = f.in.at("values");
  in.reward_baselines = f.in.at("reward_baselines");
  algos::AdvantageConfig config;
  config.adv_estimator = estimator;
  config.gamma = kGamma;
  config.lam = kLam;
  config.norm_adv_by_std_in_grpo = norm_by_std;
  return algos::compute_advantage(in, config);
}

TEST(LmAlgos, EstimatorsAndPolicyLossesMatchVerlsCoreAlgos) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "safetensors"}));
  auto f = fixture();
  std::map<std::string, torch::Tensor> io = f.in;
  for (const auto& estimator : kEstimators) {
    const auto out = advantages_of(f, estimator);
    io["ours/adv/" + estimator] = out.advantages;
    io["ours/ret/" + estimator] = out.returns;
  }
  io["ours/adv/grpo_no_std"] = advantages_of(f, "grpo", false).advantages;
  for (const auto& mode : kLossModes) {
    for (const auto& agg : kAggModes) {
      algos::PolicyLossConfig config;
      config.loss_mode = mode;
      config.loss_agg_mode = agg;
      config.clip_ratio_low = kLow;
      config.clip_ratio_high = kHigh;
      config.clip_ratio_c = kClipC;
      auto log_prob = f.in.at("log_prob").clone().requires_grad_(true);
      auto out = algos::compute_policy_loss(f.in.at("old_log_prob"), log_prob,
                                            f.in.at("advantages"), f.in.at("mask"), config);
      out.pg_loss.backward();
      io["ours/pg_loss/" + mode + "/" + agg] = out.pg_loss.detach();
      io["ours/grad/" + mode + "/" + agg] = log_prob.grad();
      io["ours/clipfrac/" + mode] = out.pg_clipfrac;
      io["ours/ppo_kl/" + mode] = out.ppo_kl;
      io["ours/clipfrac_lower/" + mode] = out.pg_clipfrac_lower;
    }
  }
  for (const auto& agg : kAggModes) {
    io["ours/agg/" + agg] = algos::agg_loss(f.in.at("values"), f.in.at("mask"), agg);
    auto vpreds = f.in.at("vpreds").clone().requires_grad_(true);
    auto value = algos::compute_value_loss(vpreds, f.in.at("returns"), f.in.at("values"),
                                           f.in.at("mask"), kClipValue, agg);
    value.vf_loss.backward();
    io["ours/vf_loss/" + agg] = value.vf_loss.detach();
    io["ours/vf_grad/" + agg] = vpreds.grad();
    io["ours/vf_clipfrac"] = value.vf_clipfrac;
  }
  io["ours/entropy"] = algos::entropy_from_logits(f.in.at("logits"));
  io["ours/overlong"] = algos::overlong_penalty(f.in.at("mask").sum(-1), 6, 3, 0.5);
  io["ours/kept"] = torch::tensor(algos::groups_to_keep(f.in.at("metric"), f.uids), torch::kLong);
  for (auto& [name, t] : io) t = t.detach().contiguous();

  const auto dir = make_temp_dir("lm_algos");
  models::save_weights(io, dir + "/io.safetensors");
  auto run = run_python_reference("verl_lm_algos_reference.py", {dir + "/io.safetensors"});
  // 6 estimators' advantages and returns, grpo without std, 4 modes x 5 aggregations (loss and
  // gradient), 3 metrics of 3 modes, 5 aggregations, the entropy, the overlong penalty, the
  // groups kept.
  expect_checks_pass(run, 12 + 1 + 40 + 9 + 5 + 3);
  std::filesystem::remove_all(dir);
}

// Whitening takes the whole batch's statistics: a batch split over two ranks, each half whitened
// with the sums of both, equals the batch whitened at once.
TEST(LmAlgos, WhiteningOverRanksUsesTheWholeBatch) {
  auto f = fixture();
  const auto values = f.in.at("values"), mask = f.in.at("mask");
  const auto whole = algos::masked_whiten(values, mask);
  const auto a = values.narrow(0, 0, 3), b = values.narrow(0, 3, 4);
  const auto ma = mask.narrow(0, 0, 3), mb = mask.narrow(0, 3, 4);
  // The other rank's share of each sum, as an all-reduce would add it.
  int call = 0;
  double mean = 0;
  const algos::SumOverRanks with_b = [&](torch::Tensor local) {
    torch::Tensor other;
    if (call++ == 0) {
      other = torch::stack({(b * mb).sum(), mb.sum()}).to(torch::kDouble);
      const auto total = local + other;
      mean = (total[0] / total[1]).item<double>();
      return total;
    }
    other = ((b - mean).square() * mb).sum().reshape({1}).to(torch::kDouble);
    return local + other;
  };
  const auto half = algos::masked_whiten(a, ma, with_b);
  EXPECT_EQ(call, 2);
  EXPECT_TRUE(torch::allclose(half * ma, whole.narrow(0, 0, 3) * ma, 1e-5, 1e-5))
      << half << whole.narrow(0, 0, 3);
  // Alone, the half's statistics differ.
  EXPECT_FALSE(
      torch::allclose(algos::masked_whiten(a, ma) * ma, whole.narrow(0, 0, 3) * ma, 1e-3, 1e-3));
}

TEST(LmAlgos, BadEstimatorInputsAreErrorsNamingThem) {
  auto f = fixture();
  algos::AdvantageInputs in;
  in.token_level_rewards = f.in.at("rewards");
  in.response_mask = f.in.at("mask");
  in.uids = f.uids;
  algos::AdvantageConfig config;
  config.adv_estimator = "gae";
  expect_invalid_argument_naming([&] { algos::compute_advantage(in, config); }, "values");
  config.adv_estimator = "remax";
  expect_invalid_argument_naming([&] { algos::compute_advantage(in, config); }, "reward_baselines");
  config.adv_estimator = "opo";
  expect_invalid_argument_naming([&] { algos::compute_advantage(in, config); }, "adv_estimator",
                                 "opo");
  algos::PolicyLossConfig loss;
  loss.loss_mode = "clip_cov";
  expect_invalid_argument_naming(
      [&] {
        algos::compute_policy_loss(f.in.at("old_log_prob"), f.in.at("log_prob"),
                                   f.in.at("advantages"), f.in.at("mask"), loss);
      },
      "loss_mode", "clip_cov");
  // One response token in the whole batch: no variance to whiten by.
  expect_invalid_argument_naming(
      [&] {
        algos::masked_whiten(torch::ones({1, 3}), torch::tensor({{1.0f, 0.0f, 0.0f}}));
      },
      "response_mask");
}

}  // namespace
}  // namespace shardrl::testing
