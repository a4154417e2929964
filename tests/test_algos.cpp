// The algorithm math against the test vectors of shared/reference/rl-algorithms.md, plus
// hand-computed cases for the losses.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardrl/algos.h"
#include "test_util.h"

namespace shardrl::algos {
namespace {

using shardrl::testing::expect_invalid_argument_naming;

using torch::indexing::Slice;

torch::Tensor Vec(const std::vector<float>& v) {
  return torch::tensor(v);
}

void ExpectNear(const torch::Tensor& t, const std::vector<double>& expected, double tol = 1e-5) {
  auto c = t.detach().to(torch::kCPU, torch::kDouble).contiguous().reshape({-1});
  ASSERT_EQ(c.numel(), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(c[static_cast<int64_t>(i)].item<double>(), expected[i], tol) << "index " << i;
  }
}

void ExpectScalar(const torch::Tensor& t, double expected, double tol = 1e-5) {
  ASSERT_EQ(t.numel(), 1);
  EXPECT_NEAR(t.item<double>(), expected, tol);
}

at::Generator Gen(uint64_t seed) {
  return at::detail::createCPUGenerator(seed);
}

// ---------------------------------------------------------------------------------------------
// §1 scheduler and SDE step

TEST(FlowMatchScheduler, ShiftedSigmasAndTimesteps) {
  const auto s = FlowMatchScheduler::create(10, 3.0);
  ASSERT_EQ(s.sigmas.numel(), 11);
  ASSERT_EQ(s.num_steps(), 10);
  EXPECT_EQ(s.sigmas.scalar_type(), torch::kFloat);
  EXPECT_EQ(s.sigma(0), 1.0);  // exactly 1: the SDE step's sigma == 1 branch depends on it
  EXPECT_EQ(s.sigma(10), 0.0);
  const double sigma_min = 0.003 / 1.002;
  for (int64_t i = 0; i < 10; ++i) {
    const double lin = 1.0 + (sigma_min - 1.0) * static_cast<double>(i) / 9.0;
    const double shifted = 3.0 * lin / (1.0 + 2.0 * lin);
    EXPECT_NEAR(s.sigma(i), shifted, 1e-6) << i;
    EXPECT_NEAR(s.timesteps[i].item<double>(), 1000.0 * shifted, 1e-3) << i;
  }
  // Decreasing, so dt = sigma_prev - sigma < 0 at every step.
  EXPECT_TRUE((s.sigmas.slice(0, 1) < s.sigmas.slice(0, 0, 10)).all().item<bool>());

  const auto unshifted = FlowMatchScheduler::create(5, 1.0, 1.0, 0.2);
  ExpectNear(unshifted.sigmas, {1.0, 0.8, 0.6, 0.4, 0.2, 0.0}, 1e-6);
  expect_invalid_argument_naming([] { FlowMatchScheduler::create(0); }, "num_steps");
}

TEST(SdeStep, ReferenceVector) {
  // a = 0.7, sigma = 0.5, sigma_prev = 0.4, x = v = 1, x_prev = mean.
  const auto x = torch::ones({2, 3, 4});
  SdeStepOptions opt;
  opt.noise_level = 0.7;
  opt.prev_sample = torch::full({2, 3, 4}, 0.8265f);
  for (const auto& sigma : {torch::tensor(0.5f), torch::tensor({0.5f, 0.5f})}) {
    const auto sigma_prev = sigma - 0.1f;
    const auto r = sde_step_with_logprob_sigmas(x, x, sigma, sigma_prev, 0.9, opt);
    ExpectNear(r.prev_sample_mean.mean(), {0.8265});
    EXPECT_NEAR((r.prev_sample_mean - 0.8265).abs().max().item<double>(), 0.0, 1e-6);
    ExpectNear(r.std_dev_t.reshape({-1}).slice(0, 0, 1), {0.7});
    ExpectNear((r.std_dev_t * r.sqrt_dt).reshape({-1}).slice(0, 0, 1), {0.221359});
    ExpectNear(r.sqrt_dt.reshape({-1}).slice(0, 0, 1), {std::sqrt(0.1)});
    ASSERT_EQ(r.log_prob.sizes(), torch::IntArrayRef({2}));
    ExpectNear(r.log_prob, {0.589029, 0.589029});
  }
}

TEST(SdeStep, SchedulerStepZeroUsesSigmaOneSubstitute) {
  const auto sched = FlowMatchScheduler::create(10, 3.0);
  const double s1 = sched.sigma(1);
  const auto x = torch::randn({2, 4}, Gen(1));
  const auto v = torch::randn({2, 4}, Gen(2));
  SdeStepOptions opt;
  opt.prev_sample = torch::zeros({2, 4});
  const auto r = sde_step_with_logprob(sched, v, x, 0, opt);
  const double std_dev = 0.7 * std::sqrt(1.0 / (1.0 - s1));
  ExpectNear(r.std_dev_t, {std_dev}, 1e-5);
  ExpectNear(r.sqrt_dt, {std::sqrt(1.0 - s1)}, 1e-6);
  EXPECT_TRUE(torch::isfinite(r.log_prob).all().item<bool>());
  // Same numbers as the explicit-sigma entry point, per-sample step indices too.
  const auto r2 = sde_step_with_logprob_sigmas(v, x, torch::tensor(1.0f),
                                               torch::tensor(static_cast<float>(s1)), s1, opt);
  EXPECT_TRUE(torch::allclose(r.log_prob, r2.log_prob));
  const auto r3 = sde_step_with_logprob(sched, v, x, torch::tensor({0, 3}), opt);
  EXPECT_TRUE(torch::allclose(r3.log_prob[0], r.log_prob[0]));
  const auto r4 = sde_step_with_logprob(sched, v, x, 3, opt);
  EXPECT_TRUE(torch::allclose(r3.log_prob[1], r4.log_prob[1]));
  expect_invalid_argument_naming([&] { sde_step_with_logprob(sched, v, x, 10, opt); },
                                 "step_index");
}

TEST(SdeStep, SamplingUsesGeneratorNoise) {
  const auto sched = FlowMatchScheduler::create(10, 3.0);
  const auto x = torch::randn({3, 2, 2}, Gen(3));
  const auto v = torch::randn({3, 2, 2}, Gen(4));
  SdeStepOptions opt;
  opt.generator = Gen(7);
  const auto r = sde_step_with_logprob(sched, v, x, 4, opt);
  const auto eps = torch::randn({3, 2, 2}, Gen(7));
  const auto step_std = r.std_dev_t * r.sqrt_dt;
  EXPECT_TRUE(torch::allclose(r.prev_sample, r.prev_sample_mean + step_std * eps));
  // With x_prev = mean + s*eps the density reduces to -eps^2/2 - log s - log sqrt(2 pi).
  const auto expected = (-eps.pow(2) / 2).flatten(1).mean(1) - torch::log(step_std).reshape({-1}) -
                        0.5 * std::log(2 * M_PI);
  EXPECT_TRUE(torch::allclose(r.log_prob, expected, 1e-4, 1e-5));

  opt.generator = Gen(7);
  EXPECT_TRUE(torch::equal(sde_step_with_logprob(sched, v, x, 4, opt).prev_sample, r.prev_sample));
  // Rescoring the sampled x_prev gives the sampling-time log-prob back.
  SdeStepOptions rescore;
  rescore.prev_sample = r.prev_sample;
  EXPECT_TRUE(torch::allclose(sde_step_with_logprob(sched, v, x, 4, rescore).log_prob, r.log_prob));
}

TEST(SdeStep, LogProbGradientFlowsThroughTheMean) {
  const auto sched = FlowMatchScheduler::create(10, 3.0);
  auto v = torch::randn({2, 3}, Gen(5)).requires_grad_();
  const auto x = torch::randn({2, 3}, Gen(6));
  SdeStepOptions opt;
  opt.prev_sample = torch::randn({2, 3}, Gen(8));
  sde_step_with_logprob(sched, v.to(torch::kBFloat16), x, 2, opt).log_prob.sum().backward();
  ASSERT_TRUE(v.grad().defined());
  EXPECT_GT(v.grad().abs().sum().item<double>(), 0.0);
}

TEST(Guidance, CfgCombine) {
  ExpectNear(cfg_combine(Vec({1, 0}), Vec({3, 1}), 4.5), {10.0, 4.5});
  ExpectNear(cfg_combine(Vec({1, 0}), Vec({3, 1}), 1.0), {3.0, 1.0});
}

TEST(FlowMatching, InterpolateAndTargets) {
  const auto x0 = torch::tensor({{1.0f, 2.0f}, {3.0f, 4.0f}});
  const auto eps = torch::tensor({{0.0f, 0.0f}, {1.0f, 1.0f}});
  ExpectNear(flow_interpolate(x0, eps, Vec({0.25f, 0.5f})), {0.75, 1.5, 2.0, 2.5});
  ExpectNear(flow_interpolate(x0, eps, torch::tensor(1.0f)), {0, 0, 1, 1});
  ExpectNear(diffusion_target(x0, eps, "flow_matching"), {-1, -2, -2, -3});
  ExpectNear(diffusion_target(x0, eps, "epsilon"), {0, 0, 1, 1});
  expect_invalid_argument_naming([&] { diffusion_target(x0, eps, "v_prediction"); },
                                 "prediction_type", "v_prediction");
}

// ---------------------------------------------------------------------------------------------
// Advantages

TEST(DiffusionAdvantages, ReferenceVectorWithoutStd) {
  DiffusionAdvantageConfig c;
  c.normalize_by_std = false;
  ExpectNear(diffusion_group_advantages(Vec({1, 3, 0, 2}), std::vector<int64_t>{0, 0, 1, 1}, c),
             {-1, 1, -1, 1});
  const std::vector<std::string> uids = {"a", "a", "b", "b"};
  ExpectNear(diffusion_group_advantages(Vec({1, 3, 0, 2}), uids, c), {-1, 1, -1, 1});
}

TEST(DiffusionAdvantages, GlobalAndPerGroupStd) {
  const std::vector<int64_t> uids = {0, 0, 1, 1};
  // verl-omni's torch.std is unbiased: the batch std of [1,3,0,2] is sqrt(5/3).
  const double g = 1.0 / (std::sqrt(5.0 / 3.0) + 1e-4);
  ExpectNear(diffusion_group_advantages(Vec({1, 3, 0, 2}), uids), {-g, g, -g, g});
  DiffusionAdvantageConfig per_group;
  per_group.global_std = false;
  const double p = 1.0 / (std::sqrt(2.0) + 1e-4);  // unbiased std of each pair is sqrt(2)
  ExpectNear(diffusion_group_advantages(Vec({1, 3, 0, 2}), uids, per_group), {-p, p, -p, p});
}

TEST(DiffusionAdvantages, SingletonGroupGetsZero) {
  const auto rewards = Vec({1, 3, 5});
  const std::vector<int64_t> uids = {0, 0, 7};
  for (bool global : {true, false}) {
    for (bool norm : {true, false}) {
      DiffusionAdvantageConfig c;
      c.global_std = global;
      c.normalize_by_std = norm;
      const auto a = diffusion_group_advantages(rewards, uids, c);
      EXPECT_EQ(a[2].item<float>(), 0.0f);
      EXPECT_LT(a[0].item<float>(), 0.0f);
    }
  }
  expect_invalid_argument_naming(
      [&] {
        diffusion_group_advantages(rewards, std::vector<int64_t>{0, 0});
      },
      "uids");
}

TEST(DiffusionAdvantages, BroadcastOverTimesteps) {
  const auto a = broadcast_over_timesteps(Vec({1, -2}), 3);
  ASSERT_EQ(a.sizes(), torch::IntArrayRef({2, 3}));
  ExpectNear(a, {1, 1, 1, -2, -2, -2});
}

TEST(GrpoAdvantages, UnbiasedStdAndSingleton) {
  const std::vector<std::string> uids = {"a", "a", "b"};
  // Group a: mean 1.5, unbiased std sqrt(0.5); b alone: mean 0, std 1.
  const double s = 0.5 / (std::sqrt(0.5) + 1e-6);
  ExpectNear(grpo_score_advantages(Vec({1, 2, 4}), uids), {-s, s, 4.0 / (1.0 + 1e-6)}, 1e-6);
  ExpectNear(grpo_score_advantages(Vec({1, 2, 4}), uids, false), {-0.5, 0.5, 4.0}, 1e-6);

  const auto rewards = torch::tensor({{0.f, 1.f, 0.f}, {0.f, 0.f, 2.f}, {4.f, 0.f, 0.f}});
  const auto mask = torch::tensor({{1.f, 1.f, 0.f}, {1.f, 1.f, 1.f}, {1.f, 0.f, 0.f}});
  const auto a = grpo_outcome_advantages(rewards, mask, std::vector<int64_t>{3, 3, 9});
  ExpectNear(a, {-s, -s, 0, s, s, s, 4.0 / (1.0 + 1e-6), 0, 0}, 1e-6);
}

// ---------------------------------------------------------------------------------------------
// §6 divisors

TEST(GradAccum, Divisors) {
  EXPECT_EQ(grad_accum_divisor("flow_grpo", 4, 10), 40);
  EXPECT_EQ(grad_accum_divisor("ppo", 4, 10), 40);
  EXPECT_EQ(grad_accum_divisor("nft", 2, 3), 6);
  EXPECT_EQ(grad_accum_divisor("dpo", 4, 10), 4);
  EXPECT_EQ(grad_accum_divisor("dpo", 4), 4);
  expect_invalid_argument_naming([] { grad_accum_divisor("sft", 1, 1); }, "algorithm", "sft");
  expect_invalid_argument_naming([] { grad_accum_divisor("nft", 0, 1); }, "num_micro_batches");
}

// ---------------------------------------------------------------------------------------------
// §1 Flow-GRPO loss

TEST(FlowGrpoLoss, ClipInactiveAtRatioOne) {
  FlowGrpoLossInputs in;
  in.log_prob = Vec({0.3f, -0.2f}).requires_grad_();
  in.old_log_prob = Vec({0.3f, -0.2f});
  in.advantages = Vec({1, -2});
  const auto out = flow_grpo_loss(in);
  ExpectScalar(out.loss, 0.5);  // mean(-A) = (-1 + 2) / 2
  ExpectScalar(out.clipfrac, 0.0);
  ExpectScalar(out.ppo_kl, 0.0);
  ExpectScalar(out.kl_loss, 0.0);
  out.loss.backward();
  ExpectNear(in.log_prob.grad(), {-0.5, 1.0});  // -A * ratio / B
}

TEST(FlowGrpoLoss, ClipActiveStopsGradient) {
  FlowGrpoLossInputs in;
  in.log_prob = Vec({0.01f, -0.01f}).requires_grad_();
  in.old_log_prob = Vec({0.0f, 0.0f});
  in.advantages = Vec({1, 1});
  const auto out = flow_grpo_loss(in);  // clip 1e-4
  // Sample 0: ratio e^0.01 > 1 + eps, A > 0: clipped at -(1 + 1e-4). Sample 1: ratio below
  // 1 - eps, but for A > 0 the unclipped -A * ratio is the larger (pessimistic) term.
  const double r1 = std::exp(-0.01);
  ExpectScalar(out.loss, (-(1.0001) - r1) / 2.0);
  ExpectScalar(out.clipfrac, 1.0);
  ExpectScalar(out.ppo_kl, 0.0);
  ExpectScalar(out.policy_loss, (-(1.0001) - r1) / 2.0);
  out.loss.backward();
  ExpectNear(in.log_prob.grad(), {0.0, -r1 / 2.0});
}

TEST(FlowGrpoLoss, AdvantageClipWeightsAndDivisor) {
  FlowGrpoLossInputs in;
  in.log_prob = Vec({0.0f});
  in.old_log_prob = Vec({0.0f});
  in.advantages = Vec({10});
  ExpectScalar(flow_grpo_loss(in).loss, -5.0);  // A clamped to adv_clip_max

  in.log_prob = Vec({0.0f, 0.0f});
  in.old_log_prob = Vec({0.0f, 0.2f});
  in.advantages = Vec({1, 1});
  in.rollout_is_weights = Vec({0.5f, 2.0f});
  FlowGrpoLossConfig c;
  c.clip_range = 1.0;  // wide: no clipping
  c.loss_divisor = 4.0;
  const auto out = flow_grpo_loss(in, c);
  ExpectScalar(out.loss, (-0.5 - 2.0 * std::exp(-0.2)) / 2.0 / 4.0);
  ExpectScalar(out.ppo_kl, 0.1);  // mean(-log_ratio) = mean(0, 0.2)
}

TEST(FlowGrpoLoss, KlTermToReference) {
  FlowGrpoLossInputs in;
  in.log_prob = Vec({0.0f, 0.0f});
  in.old_log_prob = Vec({0.0f, 0.0f});
  in.advantages = Vec({0, 0});
  in.prev_sample_mean = torch::ones({2, 2, 2}).requires_grad_();
  in.ref_prev_sample_mean = torch::zeros({2, 2, 2});
  in.std_dev_t = Vec({0.5f, 1.0f}).reshape({2, 1, 1});
  FlowGrpoLossConfig c;
  c.beta = 0.1;
  c.loss_divisor = static_cast<double>(grad_accum_divisor("flow_grpo", 2, 5));
  const auto out = flow_grpo_loss(in, c);
  // Per sample: mean sq diff 1 over 2 * std^2 -> [2, 0.5], mean 1.25.
  ExpectScalar(out.kl_loss, 1.25);
  ExpectScalar(out.loss, 0.1 * 1.25 / 10.0);
  out.loss.backward();
  EXPECT_TRUE(in.prev_sample_mean.grad().defined());

  FlowGrpoLossInputs no_ref = in;
  no_ref.ref_prev_sample_mean = torch::Tensor();
  expect_invalid_argument_naming([&] { flow_grpo_loss(no_ref, c); }, "ref_prev_sample_mean");
}

// ---------------------------------------------------------------------------------------------
// §2 DiffusionNFT

TEST(NftRewardProb, ReferenceVectors) {
  const auto a = Vec({-10, -5, 0, 5, 10});
  ExpectNear(nft_reward_prob(a, "continuous"), {0, 0, .5, 1, 1});
  // Modes act before the A / c / 2 + 0.5 mapping, so a "one" maps to 0.6 at c = 5.
  ExpectNear(nft_reward_prob(a, "one_only"), {.5, .5, .5, .6, .6});
  ExpectNear(nft_reward_prob(a, "binary"), {.4, .4, .5, .6, .6});
  ExpectNear(nft_reward_prob(a, "positive_only"), {.5, .5, .5, 1, 1});
  ExpectNear(nft_reward_prob(a, "negative_only"), {0, 0, .5, .5, .5});
  ExpectNear(nft_reward_prob(Vec({-1, 2.5}), "continuous"), {0.4, 0.75});
  ExpectNear(nft_reward_prob(Vec({1}), "one_only", 1.0), {1.0});
  expect_invalid_argument_naming([&] { nft_reward_prob(a, "ternary"); }, "adv_mode", "ternary");
}

TEST(NftTrainTimesteps, PermutationPrefixPerRow) {
  const auto rollout = (torch::arange(10, torch::kFloat) * 100).expand({3, 10}).contiguous();
  const auto sel = nft_select_train_timesteps(rollout, 0.3, Gen(11));
  ASSERT_EQ(sel.indices.sizes(), torch::IntArrayRef({3, 3}));
  EXPECT_TRUE(torch::equal(sel.timesteps, sel.indices.to(torch::kFloat) * 100));
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(std::get<0>(torch::_unique(sel.indices[b])).numel(), 3);
  }
  EXPECT_TRUE((sel.indices >= 0).all().item<bool>() && (sel.indices < 10).all().item<bool>());
  EXPECT_TRUE(torch::equal(nft_select_train_timesteps(rollout, 0.3, Gen(11)).indices, sel.indices));

  EXPECT_EQ(nft_select_train_timesteps(rollout, 0.01).indices.size(1), 1);  // max(1, int(0.1))
  const auto all = nft_select_train_timesteps(rollout, 1.0, Gen(12));
  EXPECT_TRUE(torch::equal(std::get<0>(all.indices.sort(1)), torch::arange(10).expand({3, 10})));
  expect_invalid_argument_naming([&] { nft_select_train_timesteps(rollout, 0.0); },
                                 "timestep_fraction");
}

TEST(NftLoss, HandComputedExample) {
  // t = 0.5, beta = 0.5, v = [1, 2], v_old = 0, xt = [1, 1], x0 = 0:
  //   v_pos = [0.5, 1], v_neg = [-0.5, -1], xp = [0.75, 0.5], xn = [1.25, 1.5]
  //   w_pos = 0.625, L_pos = mean(0.5625, 0.25) / 0.625 = 0.65
  //   w_neg = 1.375, L_neg = mean(1.5625, 2.25) / 1.375 = 1.386364
  //   r = 0.6: L_pol = (0.6 * 0.65 + 0.4 * 1.386364) / 0.5 * 5 = 9.445455
  //   v_ref = [1, 1]: L_ref = 0.5; ref_kl_coef 0.1 -> loss 9.495455
  NftLossInputs in;
  in.v = torch::tensor({{1.0f, 2.0f}}).requires_grad_();
  in.v_old = torch::zeros({1, 2});
  in.v_ref = torch::ones({1, 2});
  in.x0 = torch::zeros({1, 2});
  in.xt = torch::ones({1, 2});
  in.t = Vec({0.5f});
  in.r = Vec({0.6f});
  NftLossConfig c;
  c.beta = 0.5;
  c.ref_kl_coef = 0.1;
  const auto out = nft_loss(in, c);
  ExpectScalar(out.positive_loss, 0.65);
  ExpectScalar(out.negative_loss, 1.90625 / 1.375);
  ExpectScalar(out.policy_loss, 10.0 * (0.6 * 0.65 + 0.4 * 1.90625 / 1.375));
  ExpectScalar(out.ref_loss, 0.5);
  ExpectScalar(out.loss, 10.0 * (0.6 * 0.65 + 0.4 * 1.90625 / 1.375) + 0.05, 1e-4);
  out.loss.backward();
  // dL_pos/dv = -t*beta * xp / w_pos, dL_neg/dv = +t*beta * xn / w_neg (weights are constants),
  // dL_ref/dv = v - v_ref.
  const double g0 = 10.0 * (0.6 * -0.25 * 1.2 + 0.4 * 0.25 * (1.25 / 1.375)) + 0.1 * 0.0;
  const double g1 = 10.0 * (0.6 * -0.25 * 0.8 + 0.4 * 0.25 * (1.5 / 1.375)) + 0.1 * 1.0;
  ExpectNear(in.v.grad(), {g0, g1});

  c.loss_divisor = 6.0;
  ExpectScalar(nft_loss(in, c).loss, out.loss.item<double>() / 6.0, 1e-4);
  NftLossInputs no_ref = in;
  no_ref.v_ref = torch::Tensor();
  expect_invalid_argument_naming([&] { nft_loss(no_ref, c); }, "v_ref");
}

TEST(NftLoss, WeightFloorOnExactPrediction) {
  // xp == x0 exactly: w_pos hits the 1e-5 floor instead of dividing by zero.
  NftLossInputs in;
  in.v = torch::ones({1, 2});
  in.v_old = torch::ones({1, 2});
  in.x0 = torch::zeros({1, 2});
  in.xt = torch::ones({1, 2});
  in.t = Vec({1.0f});
  in.r = Vec({1.0f});
  const auto out = nft_loss(in);
  ExpectScalar(out.positive_loss, 0.0);
  ExpectScalar(out.loss, 0.0);
}

TEST(EmaDecay, Schedules) {
  for (int64_t s : {0, 10, 1000}) EXPECT_EQ(ema_decay("copy", s), 0.0);
  EXPECT_DOUBLE_EQ(ema_decay("linear_to_0_5", 0), 0.0);
  EXPECT_NEAR(ema_decay("linear_to_0_5", 100), 0.1, 1e-12);
  EXPECT_NEAR(ema_decay("linear_to_0_5", 400), 0.4, 1e-12);
  EXPECT_DOUBLE_EQ(ema_decay("linear_to_0_5", 1000), 0.5);
  EXPECT_DOUBLE_EQ(ema_decay("delayed_linear_to_0_999", 74), 0.0);
  EXPECT_DOUBLE_EQ(ema_decay("delayed_linear_to_0_999", 75), 0.0);
  EXPECT_NEAR(ema_decay("delayed_linear_to_0_999", 76), 0.0075, 1e-12);
  EXPECT_NEAR(ema_decay("delayed_linear_to_0_999", 200), 0.9375, 1e-12);
  EXPECT_DOUBLE_EQ(ema_decay("delayed_linear_to_0_999", 300), 0.999);
  const auto s = ema_decay_schedule("delayed_linear_to_0_999");
  EXPECT_EQ(s.flat_steps, 75);
  expect_invalid_argument_naming([] { ema_decay("cosine", 1); }, "decay_schedule", "cosine");
}

TEST(EmaDecay, UpdateInPlace) {
  torch::nn::Linear old_layer(2, 1), cur_layer(2, 1);
  {
    torch::NoGradGuard g;
    old_layer->weight.copy_(torch::tensor({{1.0f, 2.0f}}));
    cur_layer->weight.copy_(torch::tensor({{3.0f, 4.0f}}));
    old_layer->bias.fill_(std::nanf(""));
  }
  ema_update(old_layer->parameters(), cur_layer->parameters(), 0.25);
  ExpectNear(old_layer->weight, {2.5, 3.5});
  EXPECT_TRUE(old_layer->weight.requires_grad());
  ema_update(old_layer->parameters(), cur_layer->parameters(), 0.0);  // copy clears the NaN
  EXPECT_TRUE(torch::equal(old_layer->bias, cur_layer->bias));
  EXPECT_TRUE(torch::equal(old_layer->weight, cur_layer->weight));
  expect_invalid_argument_naming([&] { ema_update(old_layer->parameters(), {}, 0.5); }, "source");
  expect_invalid_argument_naming(
      [&] { ema_update(old_layer->parameters(), cur_layer->parameters(), 1.5); }, "decay");
}

// ---------------------------------------------------------------------------------------------
// §3 Diffusion-DPO

TEST(DpoPairs, BestWorstPerGroupSkippingSingletons) {
  const std::vector<double> rewards = {0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 1.0};
  const std::vector<std::string> uids = {"p", "p", "q", "r", "p", "r", "s"};
  const auto pairs = dpo_make_pairs(rewards, uids);
  // p = {0, 1, 4} -> best 1 (0.9), worst 0 (0.1); q, s alone; r = {3, 5} -> (3, 5).
  EXPECT_EQ(pairs.indices, (std::vector<int64_t>{1, 0, 3, 5}));
  EXPECT_EQ(pairs.num_pairs(), 2);
  EXPECT_EQ(pairs.num_skipped_groups, 2);
  EXPECT_TRUE(torch::equal(pairs.index_tensor(), torch::tensor({1, 0, 3, 5}, torch::kLong)));
  for (int64_t i = 0; i < pairs.num_pairs(); ++i) {
    EXPECT_EQ(uids[pairs.indices[2 * i]], uids[pairs.indices[2 * i + 1]]);
    EXPECT_GE(rewards[pairs.indices[2 * i]], rewards[pairs.indices[2 * i + 1]]);
  }
  const auto from_tensor =
      dpo_make_pairs(torch::tensor(rewards), std::vector<int64_t>{0, 0, 1, 2, 0, 2, 3});
  EXPECT_EQ(from_tensor.indices, pairs.indices);
}

TEST(DpoPairs, TiesKeepBatchOrderAndBadInputThrows) {
  EXPECT_EQ(dpo_make_pairs(std::vector<double>{0.5, 0.5}, std::vector<int64_t>{4, 4}).indices,
            (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(dpo_make_pairs(std::vector<double>{1.0}, std::vector<int64_t>{4}).num_pairs(), 0);
  expect_invalid_argument_naming(
      [] {
        dpo_make_pairs(std::vector<double>{1.0, 2.0}, std::vector<int64_t>{1});
      },
      "uids");
  expect_invalid_argument_naming(
      [] {
        dpo_make_pairs(std::vector<double>{1.0, NAN}, std::vector<int64_t>{1, 1});
      },
      "rewards");
}

TEST(DpoTimesteps, LogitNormalIndices) {
  const auto idx = dpo_sample_timestep_indices(20000, 1000, Gen(21));
  EXPECT_EQ(idx.scalar_type(), torch::kLong);
  EXPECT_TRUE((idx >= 0).all().item<bool>() && (idx < 1000).all().item<bool>());
  EXPECT_NEAR(idx.to(torch::kDouble).mean().item<double>(), 499.5, 10.0);
  // P(0.25 <= sigmoid(z) < 0.75) = P(|z| < log 3) = 0.7280.
  const double mid = ((idx >= 250) & (idx < 750)).to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(mid, 0.7280, 0.015);
  EXPECT_TRUE(torch::equal(dpo_sample_timestep_indices(20000, 1000, Gen(21)), idx));

  const auto sched = FlowMatchScheduler::create(1000, 3.0);
  const auto ts = dpo_sample_timesteps(sched, 8, Gen(22));
  EXPECT_TRUE(torch::equal(ts.timesteps, sched.timesteps.index_select(0, ts.indices)));
  EXPECT_TRUE(torch::allclose(ts.sigmas * 1000, ts.timesteps));
  ExpectNear(repeat_for_pairs(Vec({1, 2})), {1, 1, 2, 2});
}

TEST(DpoLoss, HandComputedPairs) {
  // target 0. Pair 0: e_theta_w = 1, e_ref_w = 4, e_theta_l = 4, e_ref_l = 1,
  //   inside = -0.5 * 0.5 * ((1 - 4) - (4 - 1)) = 1.5. Pair 1 mirrored: inside = -1.5.
  auto model = torch::tensor({{1.f, 1.f}, {2.f, 2.f}, {2.f, 2.f}, {1.f, 1.f}}).requires_grad_();
  const auto ref = torch::tensor({{2.f, 2.f}, {1.f, 1.f}, {1.f, 1.f}, {2.f, 2.f}});
  DpoLossConfig c;
  c.beta = 0.5;
  c.loss_divisor = 2.0;
  const auto out = diffusion_dpo_loss(model, ref, torch::zeros({4, 2}), c);
  const double l_pos = std::log1p(std::exp(-1.5));  // -logsigmoid(1.5)
  const double l_neg = std::log1p(std::exp(1.5));
  ExpectScalar(out.loss, (l_pos + l_neg) / 2.0 / 2.0);
  ExpectScalar(out.implicit_acc, 0.5);
  ExpectScalar(out.reward_margin, 0.0);
  ExpectScalar(out.chosen_reward, (0.75 - 0.75) / 2.0);
  ExpectScalar(out.model_mse, 2.5);
  ExpectScalar(out.ref_mse, 2.5);
  out.loss.backward();
  EXPECT_GT(model.grad().abs().sum().item<double>(), 0.0);

  const auto one =
      diffusion_dpo_loss(model.slice(0, 0, 2), ref.slice(0, 0, 2), torch::zeros({2, 2}), c);
  ExpectScalar(one.implicit_acc, 1.0);
  ExpectScalar(one.reward_margin, 1.5);
  ExpectScalar(one.chosen_reward, 0.75);
  ExpectScalar(one.rejected_reward, -0.75);
  ExpectScalar(one.loss, l_pos / 2.0);
  expect_invalid_argument_naming(
      [&] {
        diffusion_dpo_loss(model.slice(0, 0, 3), ref.slice(0, 0, 3), torch::zeros({3, 2}));
      },
      "model_pred");
}

// ---------------------------------------------------------------------------------------------
// §4 LM policy loss

// Row 0: [A=1 ratio 1.5 (clipped), A=1 ratio 1.1, masked garbage];
// row 1: [A=-1 ratio 5 (dual clip), A=-1 ratio 0.5 (clipped), A=-1 ratio 2].
struct PolicyCase {
  torch::Tensor old_logp = torch::zeros({2, 3});
  torch::Tensor logp =
      torch::log(torch::tensor({{1.5f, 1.1f, 1.0f}, {5.0f, 0.5f, 2.0f}})).index_put_({0, 2}, 50.0f);
  torch::Tensor adv = torch::tensor({{1.f, 1.f, 100.f}, {-1.f, -1.f, -1.f}});
  torch::Tensor mask = torch::tensor({{1.f, 1.f, 0.f}, {1.f, 1.f, 1.f}});
};

TEST(PolicyLoss, DualClipPerToken) {
  PolicyCase pc;
  auto logp = pc.logp.clone().requires_grad_();
  const auto out = compute_policy_loss(pc.old_logp, logp, pc.adv, pc.mask);
  ExpectNear(out.pg_losses.index({0, Slice(0, 2)}), {-1.2, -1.1});
  ExpectNear(out.pg_losses[1], {3.0, 0.8, 2.0});
  ExpectScalar(out.pg_loss, 3.5 / 5.0);
  ExpectScalar(out.pg_clipfrac, 2.0 / 5.0);
  ExpectScalar(out.pg_clipfrac_lower, 1.0 / 5.0);
  const double kl =
      -(std::log(1.5) + std::log(1.1) + std::log(5.0) + std::log(0.5) + std::log(2.0));
  ExpectScalar(out.ppo_kl, kl / 5.0);
  out.pg_loss.backward();
  // Only unclipped tokens carry gradient: d(-A * ratio)/d logp = -A * ratio, over 5 tokens.
  ExpectNear(logp.grad(), {0.0, -1.1 / 5.0, 0.0, 0.0, 0.0, 2.0 / 5.0});
}

TEST(PolicyLoss, AggregationModes) {
  PolicyCase pc;
  PolicyLossConfig c;
  c.loss_agg_mode = "seq-mean-token-sum";
  ExpectScalar(compute_policy_loss(pc.old_logp, pc.logp, pc.adv, pc.mask, c).pg_loss,
               (-2.3 + 5.8) / 2.0);
  c.loss_agg_mode = "seq-mean-token-mean";
  ExpectScalar(compute_policy_loss(pc.old_logp, pc.logp, pc.adv, pc.mask, c).pg_loss,
               (-2.3 / 2.0 + 5.8 / 3.0) / 2.0);
  c.loss_agg_mode = "seq-mean";
  expect_invalid_argument_naming(
      [&] { compute_policy_loss(pc.old_logp, pc.logp, pc.adv, pc.mask, c); }, "loss_agg_mode",
      "seq-mean");
  c.loss_agg_mode = "token-mean";
  c.clip_ratio_c = 1.0;
  expect_invalid_argument_naming(
      [&] { compute_policy_loss(pc.old_logp, pc.logp, pc.adv, pc.mask, c); }, "clip_ratio_c");
}

TEST(PolicyLoss, AsymmetricClipRange) {
  PolicyLossConfig c;
  c.clip_ratio_high = 0.28;
  const auto out = compute_policy_loss(torch::zeros({1, 1}), torch::log(torch::full({1, 1}, 1.5f)),
                                       torch::ones({1, 1}), torch::ones({1, 1}), c);
  ExpectScalar(out.pg_loss, -1.28);
}

TEST(AggLoss, MaskedExample) {
  const auto loss = torch::tensor({{1.f, 2.f, 3.f}, {4.f, 5.f, 6.f}, {7.f, 8.f, 9.f}});
  const auto mask = torch::tensor({{1.f, 1.f, 1.f}, {1.f, 0.f, 0.f}, {0.f, 0.f, 0.f}});
  ExpectScalar(agg_loss(loss, mask, "token-mean"), 10.0 / 4.0);
  // The fully masked third row does not count as a sequence.
  ExpectScalar(agg_loss(loss, mask, "seq-mean-token-sum"), (6.0 + 4.0) / 2.0);
  ExpectScalar(agg_loss(loss, mask, "seq-mean-token-mean"), (2.0 + 4.0) / 2.0);
  ExpectScalar(agg_loss(loss, torch::zeros({3, 3}), "token-mean"), 0.0);
  ExpectScalar(masked_mean(Vec({1, 2, 3}), Vec({1, 0, 1})), 2.0);
  const auto with_inf = loss.clone().index_put_({2, 2}, INFINITY);
  ExpectScalar(agg_loss(with_inf, mask, "token-mean"), 10.0 / 4.0);
}

TEST(KlPenalty, EstimatorsAndClamps) {
  const auto logp = Vec({0, -1, -30, 0});
  const auto ref = Vec({-1, 0, 0, -30});
  ExpectNear(kl_penalty(logp, ref, "k1"), {1, -1, -30, 30});
  ExpectNear(kl_penalty(logp, ref, "kl"), {1, -1, -30, 30});
  ExpectNear(kl_penalty(logp, ref, "abs"), {1, 1, 30, 30});
  ExpectNear(kl_penalty(logp, ref, "k2"), {0.5, 0.5, 450, 450}, 1e-3);
  ExpectNear(kl_penalty(logp, ref, "mse"), {0.5, 0.5, 450, 450}, 1e-3);
  // k3: d = ref - logp = [-1, 1, 30 -> 20, -30 -> -20]; exp(d) - d - 1 clamped to 10.
  const std::vector<double> k3 = {std::exp(-1.0), std::exp(1.0) - 2.0, 10.0, 10.0};
  ExpectNear(kl_penalty(logp, ref, "k3"), k3);
  ExpectNear(kl_penalty(logp, ref, "low_var_kl"), k3);
  ExpectNear(kl_penalty(Vec({0.3f}), Vec({0.3f}), "k3"), {0.0});
  expect_invalid_argument_naming([&] { kl_penalty(logp, ref, "full"); }, "kl_penalty", "full");
}

}  // namespace
}  // namespace shardrl::algos
