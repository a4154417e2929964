// Diffusion RL on a tiny random SD3 transformer with random text conditioning: the SDE and CPS
// steps against flow_grpo's formulas (tests/python/flow_grpo_step_reference.py), the sampler and
// its SDE window, the rows of each algorithm, the losses and their frozen columns, and a few
// AdamW steps per algorithm that raise an easy reward.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>

#include "model_test_util.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/weights.h"
#include "shardrl/optim.h"
#include "test_util.h"
#include "workers/sd3_rl_scenario.h"

namespace shardrl::testing {
namespace {

namespace lora = models::lora;
using algos::Conditioning;
using algos::SamplerConfig;
using algos::TensorMap;

constexpr int64_t kTextLen = 5, kTextDim = 12;

models::SD3Transformer2DModel tiny_sd3(uint64_t seed) {
  torch::manual_seed(seed);
  return models::SD3Transformer2DModel(tiny_sd3_config(kTextDim));
}

at::Generator gen(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

// `prompts` random prompts, each repeated `group` times, and one negative prompt for every row.
Conditioning random_cond(int64_t prompts, int64_t group, uint64_t seed) {
  auto g = gen(seed);
  const int64_t b = prompts * group;
  Conditioning c;
  c.prompt_embeds = at::randn({prompts, kTextLen, kTextDim}, g).repeat_interleave(group, 0);
  c.pooled_prompt_embeds = at::randn({prompts, kTextDim}, g).repeat_interleave(group, 0);
  c.negative_prompt_embeds = at::randn({1, kTextLen, kTextDim}, g).expand({b, -1, -1}).contiguous();
  c.negative_pooled_prompt_embeds = at::randn({1, kTextDim}, g).expand({b, -1}).contiguous();
  return c;
}

SamplerConfig sampler(double cfg = 1.0, const std::string& sde_type = "sde") {
  SamplerConfig s;
  s.num_inference_steps = 6;
  s.noise_level = 0.7;
  s.sde_type = sde_type;
  s.true_cfg_scale = cfg;
  s.height = s.width = 8;
  return s;
}

algos::SdeWindow full_window(const SamplerConfig& s) {
  return {0, s.num_inference_steps};
}

// ---------------------------------------------------------------------------------------------
// The SDE and CPS steps

TEST(SdeStep, SdeAndCpsMatchFlowGrpoReference) {
  const int64_t steps = 6;
  const double noise_level = 0.8;
  auto scheduler = algos::FlowMatchScheduler::create(steps, 3.0);
  // The first step (sigma 1, where the SDE's std uses sigmas[1]), a middle one and the last (to
  // sigma 0).
  const std::vector<int64_t> cases = {0, 3, steps - 1};
  auto g = gen(7);
  const std::vector<int64_t> shape = {static_cast<int64_t>(cases.size()), 3, 2, 4, 4};
  TensorMap in{
      {"v", at::randn(shape, g)},
      {"x", at::randn(shape, g)},
      {"steps", torch::tensor(cases, torch::kLong)},
      {"config", torch::tensor({static_cast<double>(steps), 3.0, noise_level}, torch::kDouble)}};
  // A sample near each step's Euler mean, so the log-prob is in its typical range.
  std::vector<torch::Tensor> prev;
  for (size_t i = 0; i < cases.size(); ++i) {
    const int64_t j = cases[i];
    auto dt = scheduler.sigma(j + 1) - scheduler.sigma(j);
    prev.push_back(in["x"][i] + dt * in["v"][i] + 0.05 * at::randn(shape, g)[0]);
  }
  in["prev"] = torch::stack(prev);
  const auto dir = make_temp_dir("sde_step");
  const std::string in_file = dir + "/in.safetensors", out_file = dir + "/out.safetensors";
  models::save_weights(in, in_file);
  auto run = run_python_reference("flow_grpo_step_reference.py", {in_file, out_file});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  checkpoint::HfWeights file(out_file);
  auto want = [&](const std::string& name) { return file.reader(name).read(name); };
  EXPECT_TRUE(torch::allclose(scheduler.sigmas, want("sigmas"), 0, 1e-6))
      << "diffusers' FlowMatchEulerDiscreteScheduler has other sigmas";
  for (const std::string type : {"sde", "cps"}) {
    for (size_t i = 0; i < cases.size(); ++i) {
      algos::SdeStepOptions opts;
      opts.noise_level = noise_level;
      opts.sde_type = type;
      opts.prev_sample = in["prev"][i];
      auto got = algos::sde_step_with_logprob(scheduler, in["v"][i], in["x"][i], cases[i], opts);
      const auto what = type + " step " + std::to_string(cases[i]);
      EXPECT_TRUE(torch::allclose(got.prev_sample_mean, want(type + "_mean")[i], 1e-5, 1e-5))
          << what;
      EXPECT_TRUE(torch::allclose(got.std_dev_t.reshape({-1}).expand({3}), want(type + "_std")[i],
                                  1e-5, 1e-5))
          << what << ": " << got.std_dev_t.reshape({-1}) << want(type + "_std")[i];
      EXPECT_TRUE(torch::allclose(got.log_prob, want(type + "_log_prob")[i], 1e-5, 1e-5))
          << what << ": " << got.log_prob << want(type + "_log_prob")[i];
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(SdeStep, CpsDrawsItsSampleWithSigmaPrevSinStdAndUnknownTypesAreErrors) {
  auto scheduler = algos::FlowMatchScheduler::create(6, 3.0);
  auto v = at::randn({2, 1, 4, 4}, gen(1)), x = at::randn({2, 1, 4, 4}, gen(2));
  algos::SdeStepOptions opts;
  opts.sde_type = "cps";
  opts.noise_level = 0.5;
  opts.generator = gen(3);
  auto step = algos::sde_step_with_logprob(scheduler, v, x, 2, opts);
  auto noise = at::randn({2, 1, 4, 4}, gen(3));
  const double std = scheduler.sigma(3) * std::sin(0.5 * M_PI / 2);
  EXPECT_TRUE(torch::allclose(step.prev_sample, step.prev_sample_mean + std * noise, 1e-6, 1e-6));
  opts.sde_type = "ode";
  expect_invalid_argument_naming([&] { algos::sde_step_with_logprob(scheduler, v, x, 2, opts); },
                                 "sde_type", "ode");
}

// ---------------------------------------------------------------------------------------------
// The velocity and the sampler

TEST(Sd3Velocity, TrueCfgIsTheNegativeBranchPlusScaleTimesTheDifference) {
  auto model = tiny_sd3(1);
  auto cond = random_cond(3, 1, 2);
  auto x = at::randn({3, 1, 8, 8}, gen(3));
  auto sigma = torch::tensor({0.9f, 0.5f, 0.2f});
  torch::NoGradGuard no_grad;
  auto t = sigma * 1000;
  auto v = model(x, cond.prompt_embeds, cond.pooled_prompt_embeds, t);
  auto v_neg = model(x, cond.negative_prompt_embeds, cond.negative_pooled_prompt_embeds, t);
  auto guided = algos::flow_velocity(model, x, sigma, cond, 4.5);
  EXPECT_TRUE(torch::allclose(guided, v_neg + 4.5 * (v - v_neg), 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(algos::flow_velocity(model, x, sigma, cond, 1.0), v, 1e-6, 1e-6));
  cond.negative_prompt_embeds = cond.negative_pooled_prompt_embeds = torch::Tensor();
  expect_invalid_argument_naming([&] { algos::flow_velocity(model, x, sigma, cond, 2.0); },
                                 "negative_prompt_embeds");
}

TEST(Sd3Sampler, RecordsShapesAndIsSeeded) {
  auto model = tiny_sd3(2);
  auto cond = random_cond(2, 2, 3);
  const auto s = sampler(/*cfg=*/3.0);
  auto a = algos::sample_with_logprob(model, cond, s, full_window(s), gen(9));
  EXPECT_EQ(a.latents.sizes(), (std::vector<int64_t>{4, 7, 1, 8, 8}));
  EXPECT_EQ(a.log_probs.sizes(), (std::vector<int64_t>{4, 6}));
  EXPECT_TRUE(a.sigmas.equal(s.scheduler().sigmas));
  EXPECT_TRUE(torch::isfinite(a.log_probs).all().item<bool>());
  EXPECT_TRUE(a.cond.prompt_embeds.equal(cond.prompt_embeds));
  auto b = algos::sample_with_logprob(model, cond, s, full_window(s), gen(9));
  auto c = algos::sample_with_logprob(model, cond, s, full_window(s), gen(10));
  EXPECT_TRUE(a.latents.equal(b.latents));
  EXPECT_TRUE(a.log_probs.equal(b.log_probs));
  EXPECT_FALSE(a.latents.equal(c.latents));
}

TEST(Sd3Sampler, NoiseLevelZeroIsThePlainEulerOde) {
  auto model = tiny_sd3(3);
  auto cond = random_cond(2, 1, 4);
  auto s = sampler(/*cfg=*/2.0);
  auto sde = algos::sample_with_logprob(model, cond, s, full_window(s), gen(9));
  s.noise_level = 0.0;
  auto ode = algos::sample_with_logprob(model, cond, s, full_window(s), gen(9));
  EXPECT_TRUE(ode.log_probs.eq(0).all().item<bool>());
  torch::NoGradGuard no_grad;
  auto sigmas = s.scheduler().sigmas;
  auto x = at::randn({2, 1, 8, 8}, gen(9));
  for (int64_t j = 0; j < s.num_inference_steps; ++j) {
    auto t = (sigmas[j] * 1000).expand({2});
    auto v = model(x, cond.prompt_embeds, cond.pooled_prompt_embeds, t);
    auto v_neg = model(x, cond.negative_prompt_embeds, cond.negative_pooled_prompt_embeds, t);
    x = x + (sigmas[j + 1] - sigmas[j]) * (v_neg + 2.0 * (v - v_neg));
  }
  EXPECT_TRUE(torch::allclose(ode.images(), x, 1e-5, 1e-5));
  EXPECT_FALSE(torch::allclose(sde.images(), x, 1e-2, 1e-2));  // the SDE does add noise
}

TEST(Sd3Sampler, StepsOutsideTheWindowAreDeterministicEulerSteps) {
  auto model = tiny_sd3(4);
  auto cond = random_cond(3, 1, 5);
  for (const std::string type : {"sde", "cps"}) {
    const auto s = sampler(/*cfg=*/2.0, type);
    const algos::SdeWindow window{2, 4};
    auto ro = algos::sample_with_logprob(model, cond, s, window, gen(11));
    EXPECT_EQ(ro.window.begin, 2);
    torch::NoGradGuard no_grad;
    for (int64_t j = 0; j < s.num_inference_steps; ++j) {
      auto x = ro.latents.select(1, j);
      auto v = algos::flow_velocity(model, x, ro.sigmas[j], cond, 2.0);
      auto euler = x + (ro.sigmas[j + 1] - ro.sigmas[j]) * v;
      const bool inside = window.contains(j);
      EXPECT_EQ(torch::allclose(ro.latents.select(1, j + 1), euler, 1e-5, 1e-5), !inside)
          << type << " step " << j;
      EXPECT_EQ(ro.log_probs.select(1, j).eq(0).all().item<bool>(), !inside)
          << type << " step " << j;
    }
  }
}

// The rollout's log-probs scored again from the recorded latents through the loss path: ratio 1.
TEST(Sd3Sampler, RecomputedWindowLogProbsReproduceTheRollout) {
  auto model = tiny_sd3(5);
  auto cond = random_cond(2, 2, 6);
  for (const std::string type : {"sde", "cps"}) {
    const auto s = sampler(/*cfg=*/2.5, type);
    const algos::SdeWindow window{1, 5};
    auto ro = algos::sample_with_logprob(model, cond, s, window, gen(12));
    auto adv = torch::tensor({1.0f, -0.5f, 0.25f, -2.0f});
    auto rows = algos::flow_grpo_rows(ro, adv, algos::flow_grpo_train_steps(window, 1.0));
    ASSERT_EQ(rows.at("latents").size(0), 16);
    algos::DiffusionLossConfig loss;  // clip_ratio 1e-4: a ratio off by more clips
    auto out = algos::diffusion_loss(model, rows, loss, s);
    EXPECT_EQ(out.metrics.at("clipfrac").item<double>(), 0.0) << type;
    EXPECT_LT(std::abs(out.metrics.at("ppo_kl").item<double>()), 1e-6) << type;
    // ratio 1: the loss is -mean(A).
    EXPECT_NEAR(out.loss.item<double>(), -rows.at("advantages").mean().item<double>(), 1e-5)
        << type;
  }
}

// ---------------------------------------------------------------------------------------------
// The SDE window

TEST(DrawSdeWindow, SizeZeroIsEveryStepButTheLastAndSizedWindowsFitTheRange) {
  auto s = sampler();
  s.num_inference_steps = 10;
  auto all = algos::draw_sde_window(s, gen(1));
  EXPECT_EQ(all.begin, 0);
  EXPECT_EQ(all.end, 9);
  s.num_inference_steps = 1;
  EXPECT_EQ(algos::draw_sde_window(s, gen(1)).end, 1);

  s.num_inference_steps = 10;
  s.sde_window_size = 3;
  s.sde_window_range = {0, 5};  // verl-omni's SD3.5 example: starts 0, 1 or 2
  std::set<int64_t> starts;
  auto g = gen(2);
  for (int i = 0; i < 200; ++i) {
    auto w = algos::draw_sde_window(s, g);
    EXPECT_EQ(w.size(), 3);
    starts.insert(w.begin);
  }
  EXPECT_EQ(starts, (std::set<int64_t>{0, 1, 2}));
  s.sde_window_range = {6, -1};  // -1: up to num_inference_steps
  starts.clear();
  for (int i = 0; i < 200; ++i) starts.insert(algos::draw_sde_window(s, g).begin);
  EXPECT_EQ(starts, (std::set<int64_t>{6, 7}));
  EXPECT_EQ(algos::draw_sde_window(s, gen(5)).begin, algos::draw_sde_window(s, gen(5)).begin);

  s.sde_window_range = {0, 2};
  expect_invalid_argument_naming([&] { algos::draw_sde_window(s, gen(1)); },
                                 "actor_rollout_ref.rollout.algo.sde_window_range", "[0, 2)");
  s.sde_window_range = {8, 12};
  expect_invalid_argument_naming([&] { algos::draw_sde_window(s, gen(1)); },
                                 "actor_rollout_ref.rollout.algo.sde_window_range");
  s.sde_window_range = {0, -1};
  s.sde_window_size = 11;
  expect_invalid_argument_naming([&] { algos::draw_sde_window(s, gen(1)); },
                                 "actor_rollout_ref.rollout.algo.sde_window_size", "11");
}

// ---------------------------------------------------------------------------------------------
// Rows

TEST(DiffusionRows, FlowGrpoRowsAreSampleMajorWithTheirConditioning) {
  auto model = tiny_sd3(6);
  auto cond = random_cond(3, 1, 7);
  const auto s = sampler(2.0);
  const algos::SdeWindow window{1, 4};
  auto ro = algos::sample_with_logprob(model, cond, s, window, gen(13));
  EXPECT_EQ(algos::flow_grpo_train_steps(window, 1.0), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(algos::flow_grpo_train_steps(window, 0.5), (std::vector<int64_t>{1}));
  EXPECT_EQ(algos::flow_grpo_train_steps(window, 0.7), (std::vector<int64_t>{1, 2}));
  const std::vector<int64_t> steps = {2, 3};
  auto adv = torch::tensor({0.5f, -1.0f, 2.0f});
  auto rows = algos::flow_grpo_rows(ro, adv, steps);
  for (const auto& [name, t] : rows) EXPECT_EQ(t.size(0), 6) << name;
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t k = 0; k < 2; ++k) {
      const int64_t r = b * 2 + k, j = steps[k];
      EXPECT_TRUE(rows["latents"][r].equal(ro.latents[b][j]));
      EXPECT_TRUE(rows["next_latents"][r].equal(ro.latents[b][j + 1]));
      EXPECT_EQ(rows["sigma"][r].item<float>(), ro.sigmas[j].item<float>());
      EXPECT_EQ(rows["sigma_next"][r].item<float>(), ro.sigmas[j + 1].item<float>());
      EXPECT_EQ(rows["old_log_probs"][r].item<float>(), ro.log_probs[b][j].item<float>());
      EXPECT_EQ(rows["advantages"][r].item<float>(), adv[b].item<float>());
      EXPECT_TRUE(rows["prompt_embeds"][r].equal(cond.prompt_embeds[b]));
      EXPECT_TRUE(rows["pooled_prompt_embeds"][r].equal(cond.pooled_prompt_embeds[b]));
      EXPECT_TRUE(rows["negative_prompt_embeds"][r].equal(cond.negative_prompt_embeds[b]));
    }
  }
  expect_invalid_argument_naming(
      [&] {
        algos::flow_grpo_rows(ro, adv, {0, 1});
      },
      "steps", "outside the SDE window");
}

TEST(DiffusionRows, NftRowsDrawDistinctStepsPerSample) {
  auto model = tiny_sd3(7);
  auto cond = random_cond(3, 1, 8);
  const auto s = sampler();
  auto ro = algos::sample_with_logprob(model, cond, s, full_window(s), gen(14));
  auto r = torch::tensor({0.1f, 0.5f, 0.9f});
  auto rows = algos::nft_rows(ro, r, 0.5, gen(15));  // K = 3 of 6 steps
  for (const auto& [name, t] : rows) EXPECT_EQ(t.size(0), 9) << name;
  auto sigmas = ro.sigmas.narrow(0, 0, 6);
  for (int64_t b = 0; b < 3; ++b) {
    std::set<float> drawn;
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t i = b * 3 + k;
      EXPECT_TRUE(rows["x0"][i].equal(ro.images()[b]));
      EXPECT_EQ(rows["r"][i].item<float>(), r[b].item<float>());
      EXPECT_TRUE(rows["prompt_embeds"][i].equal(cond.prompt_embeds[b]));
      const float t = rows["t"][i].item<float>();
      EXPECT_TRUE(sigmas.eq(t).any().item<bool>()) << t << " is no step's sigma";
      drawn.insert(t);
      // xt lies on the line from x0 at its sigma: eps = (xt - (1 - t) x0) / t is finite noise.
      auto eps = (rows["xt"][i] - (1 - t) * rows["x0"][i]) / t;
      EXPECT_LT(eps.abs().max().item<float>(), 10.0f);
    }
    EXPECT_EQ(drawn.size(), 3u);
  }
}

TEST(DiffusionRows, DpoPairsAreTheBestAndWorstOfEachGroup) {
  auto model = tiny_sd3(8);
  auto cond = random_cond(2, 3, 9);
  const auto s = sampler();
  auto ro = algos::sample_with_logprob(model, cond, s, full_window(s), gen(16));
  auto rewards = torch::tensor({0.2f, 0.9f, 0.1f, 0.5f, 0.3f, 0.7f});
  auto rows = algos::dpo_rows(ro, rewards, {0, 0, 0, 1, 1, 1}, 1.0, gen(17));
  for (const auto& [name, t] : rows) EXPECT_EQ(t.size(0), 2) << name;
  auto images = ro.images();
  EXPECT_TRUE(rows["chosen_x0"][0].equal(images[1]));
  EXPECT_TRUE(rows["rejected_x0"][0].equal(images[2]));
  EXPECT_TRUE(rows["chosen_x0"][1].equal(images[5]));
  EXPECT_TRUE(rows["rejected_x0"][1].equal(images[4]));
  EXPECT_TRUE(rows["prompt_embeds"][0].equal(cond.prompt_embeds[1]));
  EXPECT_TRUE(rows["prompt_embeds"][1].equal(cond.prompt_embeds[5]));
  EXPECT_EQ(rows["eps"].sizes(), rows["chosen_x0"].sizes());
  EXPECT_TRUE(rows["sigma"].gt(0).all().item<bool>());
  EXPECT_TRUE(rows["sigma"].le(1).all().item<bool>());
}

// ---------------------------------------------------------------------------------------------
// Losses

struct Tuned {
  models::SD3Transformer2DModel model;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  // Full fine-tuning: a frozen copy of the initial weights is the reference (LoRA: the model with
  // its adapters disabled), and NFT's old policy is the one that sampled.
  models::SD3Transformer2DModel reference{nullptr};
  bool full() const { return !reference.is_empty(); }
};

// Every parameter trained, beside a frozen copy of the start.
Tuned full_tiny_sd3(double lr = 1e-3) {
  Tuned t{tiny_sd3(20), nullptr, tiny_sd3(20)};
  for (auto& p : t.reference->parameters()) p.set_requires_grad(false);
  optim::AdamWConfig adam;
  adam.lr = lr;
  adam.weight_decay = 0;
  t.optimizer = optim::make_adamw(optim::from_module(*t.model), adam);
  return t;
}

Tuned lora_tiny_sd3(bool with_old, double lr = 1e-2) {
  Tuned t{tiny_sd3(20), nullptr};
  lora::LoraConfig cfg;
  cfg.r = 4;
  cfg.alpha = 8;
  cfg.target_modules = {"to_q",       "to_k",       "to_v",       "to_out.0",
                        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"};
  lora::apply_lora(*t.model, cfg, "default");
  if (with_old) {
    lora::apply_lora(*t.model, cfg, "old", /*trainable=*/false);
    lora::set_active_adapter(*t.model, "default");
    lora::copy_adapter(lora::named_tensors(*t.model), "old", "default");
  }
  optim::AdamWConfig adam;
  adam.lr = lr;
  adam.weight_decay = 0;
  t.optimizer = optim::make_adamw(optim::from_module(*t.model), adam);
  return t;
}

// Every column each loss_mode reads, for rows of a rollout of `prompts` x `group` samples
// rewarded by brightness (their mean goes to `reward_mean`).
TensorMap rows_for(const std::string& mode, Tuned& t, const SamplerConfig& s,
                   const algos::DiffusionLossConfig& loss, uint64_t seed, int64_t prompts = 2,
                   int64_t group = 2, double* reward_mean = nullptr) {
  auto cond = random_cond(prompts, group, seed);
  algos::DiffusionRollout ro;
  {
    std::optional<lora::UseAdapter> behaviour;
    if (mode == "diffusion_nft" && !t.full()) behaviour.emplace(*t.model, "old");
    // Not [0, T): CPS's last step has std 0 (a KL to the reference would divide by it).
    ro = algos::sample_with_logprob(t.model, cond, s, algos::draw_sde_window(s, gen(seed)),
                                    gen(seed + 1));
  }
  auto rewards = ro.images().flatten(1).mean(1);
  auto adv = algos::group_advantages(rewards, group, {});
  if (reward_mean) *reward_mean = adv.reward_mean;
  TensorMap rows;
  if (mode == "flow_grpo") {
    rows = algos::flow_grpo_rows(ro, adv.advantages, algos::flow_grpo_train_steps(ro.window, 1.0));
  } else if (mode == "diffusion_nft") {
    rows = algos::nft_rows(ro, algos::nft_reward_prob(adv.advantages, "continuous"), 0.5,
                           gen(seed + 2));
    std::optional<lora::UseAdapter> old;
    if (!t.full()) old.emplace(*t.model, "old");
    for (auto& [k, v] : algos::frozen_outputs("old", t.model, rows, loss, s)) rows[k] = v;
  } else {
    rows = algos::dpo_rows(ro, rewards, adv.group_ids, 1.0, gen(seed + 2));
  }
  if (loss.needs_reference()) {
    if (t.full()) {
      for (auto& [k, v] : algos::frozen_outputs("reference", t.reference, rows, loss, s))
        rows[k] = v;
    } else {
      lora::DisableAdapters reference(*t.model);
      for (auto& [k, v] : algos::frozen_outputs("reference", t.model, rows, loss, s)) rows[k] = v;
    }
  }
  return rows;
}

algos::DiffusionLossConfig loss_config(const std::string& mode) {
  algos::DiffusionLossConfig c;
  c.loss_mode = mode;
  // The reverse-step KL goes with a reverse-process loss only (NFT has ref_kl_coef, DPO none).
  c.kl_loss_coef = algos::is_reverse_process_loss(mode) ? 0.01 : 0.0;
  c.ref_kl_coef = 0.01;
  c.mix_beta = 1.0;
  c.dpo_beta = 500;
  return c;
}

TEST(DiffusionLoss, EachModeRunsWithGradOnlyInTheAdapters) {
  for (const std::string mode : {"flow_grpo", "diffusion_nft", "dpo"}) {
    auto t = lora_tiny_sd3(mode == "diffusion_nft");
    const auto s = sampler(mode == "flow_grpo" ? 2.0 : 1.0, "cps");
    const auto loss = loss_config(mode);
    EXPECT_TRUE(loss.needs_reference());
    auto rows = rows_for(mode, t, s, loss, 30);
    auto out = algos::diffusion_loss(t.model, rows, loss, s);
    ASSERT_EQ(out.loss.dim(), 0) << mode;
    out.loss.backward();
    double adapter_grad = 0;
    for (const auto& p : t.model->named_parameters()) {
      if (!p.value().requires_grad()) {
        EXPECT_FALSE(p.value().grad().defined()) << mode << " " << p.key();
      } else {
        EXPECT_TRUE(lora::is_adapter_tensor(p.key())) << p.key();
        if (p.value().grad().defined()) adapter_grad += p.value().grad().abs().sum().item<double>();
      }
    }
    EXPECT_GT(adapter_grad, 0.0) << mode;
    for (const auto& [name, value] : out.metrics) {
      EXPECT_FALSE(value.requires_grad()) << name;
      EXPECT_TRUE(std::isfinite(value.item<double>())) << mode << " " << name;
    }
  }
}

// The reference is the model with adapters disabled: the KL terms are 0 while the adapters add
// nothing (LoRA B = 0) and grow once they do.
TEST(DiffusionLoss, ReferenceColumnsAreTheModelWithAdaptersDisabled) {
  for (const std::string mode : {"flow_grpo", "diffusion_nft", "dpo"}) {
    auto t = lora_tiny_sd3(mode == "diffusion_nft");
    const auto s = sampler();
    const auto loss = loss_config(mode);
    const std::string metric = mode == "dpo" ? "reward_margin" : "kl";
    auto rows = rows_for(mode, t, s, loss, 40);
    auto before = algos::diffusion_loss(t.model, rows, loss, s).metrics.at(metric);
    EXPECT_NEAR(before.item<double>(), 0.0, 1e-7) << mode;
    {
      torch::NoGradGuard no_grad;
      for (auto& [name, p] : lora::named_tensors(*t.model)) {
        if (lora::is_lora_b_tensor(name) && name.find(".default.") != std::string::npos)
          p.add_(at::randn(p.sizes(), gen(41)) * 0.1);
      }
    }
    auto after = algos::diffusion_loss(t.model, rows, loss, s).metrics.at(metric);
    EXPECT_GT(std::abs(after.item<double>()), 1e-6) << mode;
  }
}

TEST(DiffusionLoss, AMissingFrozenColumnIsAnErrorNamingIt) {
  const std::vector<std::pair<std::string, std::string>> needs = {
      {"flow_grpo", "ref_prev_sample_mean"},
      {"diffusion_nft", "old_velocity"},
      {"diffusion_nft", "ref_velocity"},
      {"dpo", "ref_chosen_pred"},
      {"dpo", "ref_rejected_pred"}};
  for (const auto& [mode, column] : needs) {
    auto t = lora_tiny_sd3(mode == "diffusion_nft");
    const auto s = sampler();
    const auto loss = loss_config(mode);
    auto rows = rows_for(mode, t, s, loss, 50);
    rows.erase(column);
    expect_invalid_argument_naming([&] { algos::diffusion_loss(t.model, rows, loss, s); }, column,
                                   "missing column");
  }
  auto t = lora_tiny_sd3(false);
  auto loss = loss_config("flow_grpo");
  expect_invalid_argument_naming(
      [&] { algos::frozen_outputs("old", t.model, {}, loss, sampler()); }, "role", "old");
  expect_invalid_argument_naming(
      [&] { algos::frozen_outputs("critic", t.model, {}, loss, sampler()); }, "role", "critic");
}

TEST(DiffusionLoss, FlowMatchingLossTrainsTheVelocityAndDropsCaptions) {
  auto model = tiny_sd3(9);
  auto cond = random_cond(4, 1, 10);
  TensorMap rows{{"images", at::randn({4, 1, 8, 8}, gen(11))}};
  cond.add_to(rows);
  algos::FlowMatchingLossConfig config;
  config.caption_dropout = 0.5;
  auto out = algos::flow_matching_loss(model, rows, config, gen(12));
  out.loss.backward();
  EXPECT_TRUE(std::isfinite(out.loss.item<double>()));
  EXPECT_GT(model->blocks[0]->attn->to_q->weight.grad().abs().sum().item<double>(), 0.0);
  // With every caption dropped the positive prompt cannot matter.
  config.caption_dropout = 1.0;
  auto a = algos::flow_matching_loss(model, rows, config, gen(13)).loss;
  rows["prompt_embeds"] = torch::zeros_like(rows["prompt_embeds"]);
  EXPECT_TRUE(torch::allclose(a, algos::flow_matching_loss(model, rows, config, gen(13)).loss));
  rows.erase("negative_prompt_embeds");
  expect_invalid_argument_naming([&] { algos::flow_matching_loss(model, rows, config, gen(13)); },
                                 "negative_prompt_embeds");
}

// ---------------------------------------------------------------------------------------------
// Advantages and configs

TEST(GroupAdvantages, AreGroupRelativeWithTheBatchStd) {
  auto rewards = torch::tensor({1.0f, 3.0f, 0.0f, 0.0f, 2.0f, 4.0f});
  auto out = algos::group_advantages(rewards, 2, {});
  EXPECT_EQ(out.group_ids, (std::vector<int64_t>{0, 0, 1, 1, 2, 2}));
  // torch.std's unbiased estimate of the batch, as verl-omni's compute_flow_grpo_outcome_advantage.
  const double std = rewards.std(/*unbiased=*/true).item<double>();
  EXPECT_NEAR(out.reward_mean, 10.0 / 6, 1e-6);
  EXPECT_NEAR(out.reward_std, rewards.std(/*unbiased=*/false).item<double>(), 1e-6);  // logged
  auto want = torch::tensor({-1.0, 1.0, 0.0, 0.0, -1.0, 1.0}) / (std + 1e-4);
  EXPECT_TRUE(torch::allclose(out.advantages, want.to(torch::kFloat), 1e-5, 1e-6));
  expect_invalid_argument_naming([&] { algos::group_advantages(rewards, 4, {}); }, "group_size",
                                 "groups of 4");
}

TEST(DiffusionConfig, ValidateErrorsNameVerlOmniKeys) {
  auto check_sampler = [](auto change, const std::string& key, const std::string& value = "") {
    auto s = sampler();
    change(s);
    expect_invalid_argument_naming([&] { s.validate(); }, key, value);
  };
  check_sampler([](SamplerConfig& s) { s.sde_type = "ddim"; },
                "actor_rollout_ref.rollout.algo.sde_type", "ddim");
  check_sampler([](SamplerConfig& s) { s.noise_level = -1; },
                "actor_rollout_ref.rollout.algo.noise_level");
  check_sampler([](SamplerConfig& s) { s.num_inference_steps = 0; },
                "actor_rollout_ref.rollout.pipeline.num_inference_steps");
  check_sampler([](SamplerConfig& s) { s.true_cfg_scale = 0.5; },
                "actor_rollout_ref.rollout.pipeline.true_cfg_scale");
  check_sampler([](SamplerConfig& s) { s.height = 0; },
                "actor_rollout_ref.rollout.pipeline.height");
  sampler().validate();

  auto check_loss = [](auto change, const std::string& key) {
    algos::DiffusionLossConfig c;
    change(c);
    expect_invalid_argument_naming([&] { c.validate(); }, key);
  };
  const std::string key = "actor_rollout_ref.actor.diffusion_loss.";
  check_loss([](auto& c) { c.loss_mode = "grpo"; }, key + "loss_mode");
  check_loss([](auto& c) { c.clip_ratio = -1; }, key + "clip_ratio");
  check_loss([](auto& c) { c.adv_clip_max = 0; }, key + "adv_clip_max");
  check_loss([](auto& c) { c.mix_beta = 0; }, key + "mix_beta");
  check_loss([](auto& c) { c.ref_kl_coef = -1; }, key + "ref_kl_coef");
  check_loss([](auto& c) { c.dpo_beta = 0; }, key + "dpo_beta");
  check_loss([](auto& c) { c.kl_loss_coef = -1; }, "actor_rollout_ref.actor.kl_loss_coef");
  algos::DiffusionLossConfig plain;
  plain.validate();
  EXPECT_FALSE(plain.needs_reference());  // flow_grpo without a KL
}

// ---------------------------------------------------------------------------------------------
// A few AdamW steps through diffusion_loss raise an easy reward: bright images.

// Mean reward of the first and the last 3 rollouts.
std::pair<double, double> train_on_brightness(const std::string& mode, int steps,
                                              bool full = false) {
  auto t = full ? full_tiny_sd3() : lora_tiny_sd3(mode == "diffusion_nft");
  const auto s = sampler();
  auto loss = loss_config(mode);
  loss.kl_loss_coef = 0;
  loss.ref_kl_coef = 0;
  std::vector<double> rewards(static_cast<size_t>(steps));
  for (int step = 0; step < steps; ++step) {
    auto rows = rows_for(mode, t, s, loss, 100 + 10 * step, 2, 6, &rewards[step]);
    t.optimizer->zero_grad();
    algos::diffusion_loss(t.model, rows, loss, s).loss.backward();
    t.optimizer->step();
    if (mode == "diffusion_nft" && !full) {
      lora::ema_update(lora::named_tensors(*t.model), "old", "default",
                       algos::ema_decay("linear_to_0_5", step));
    }
  }
  double first = 0, last = 0;
  for (int i = 0; i < 3; ++i) first += rewards[i] / 3, last += rewards[steps - 1 - i] / 3;
  return {first, last};
}

TEST(DiffusionLossTraining, FlowGrpoRaisesAnEasyReward) {
  auto [first, last] = train_on_brightness("flow_grpo", 15);
  EXPECT_GT(last, first + 0.05) << "reward " << first << " -> " << last;
}

TEST(DiffusionLossTraining, NftRaisesAnEasyReward) {
  auto [first, last] = train_on_brightness("diffusion_nft", 15);
  EXPECT_GT(last, first + 0.05) << "reward " << first << " -> " << last;
}

TEST(DiffusionLossTraining, DpoRaisesAnEasyReward) {
  auto [first, last] = train_on_brightness("dpo", 15);
  EXPECT_GT(last, first + 0.05) << "reward " << first << " -> " << last;
}

// The same with every parameter trained (lora_rank 0): the reference is a frozen copy.
TEST(DiffusionLossTraining, EachModeRaisesAnEasyRewardWithFullFineTuning) {
  for (const std::string mode : {"flow_grpo", "diffusion_nft", "dpo"}) {
    auto [first, last] = train_on_brightness(mode, 15, /*full=*/true);
    EXPECT_GT(last, first + 0.05) << mode << ": reward " << first << " -> " << last;
  }
}

// ---------------------------------------------------------------------------------------------
// Sharded on 2 ranks (tests/workers/sd3_rl_worker.cpp), one prompt group each

std::vector<double> json_values(const nlohmann::json& j) {
  return j.get<std::vector<double>>();
}

// Each rank samples what one process samples for its prompts, both ranks use one SDE window, the
// advantages are those of the gathered rewards (global std) and each rank's loss is its rows'.
TEST(DiffusionRLSharded, TwoRanksSampleAndScoreAsOneProcessWithGlobalAdvantages) {
  const std::string dir = make_temp_dir("sd3-rl");
  auto result = launch_workers(2, {"--out", dir}, 300, "sd3_rl_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto model = build_sd3(SD3Scenario{});
  std::vector<nlohmann::json> ranks;
  std::vector<algos::DiffusionRollout> rollouts;
  std::vector<torch::Tensor> rewards;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(
        nlohmann::json::parse(std::ifstream(dir + "/rank_" + std::to_string(r) + ".json")));
    rollouts.push_back(sd3_rl_rollout(model, r));
    rewards.push_back(sd3_rl_rewards(rollouts.back()));
    EXPECT_EQ(ranks[r]["window"], ranks[0]["window"]);
    EXPECT_EQ(ranks[r]["window"][0].get<int64_t>(), rollouts.back().window.begin);
    auto got = torch::tensor(json_values(ranks[r]["rewards"])).to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(got, rewards.back(), 1e-5, 1e-5)) << "rank " << r;
  }
  auto all = torch::cat(rewards);
  auto want = algos::diffusion_group_advantages(all, std::vector<int64_t>{0, 0, 1, 1});
  for (int r = 0; r < 2; ++r) {
    auto adv = torch::tensor(json_values(ranks[r]["advantages"])).to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(adv, want.narrow(0, 2 * r, 2), 1e-3, 1e-3))
        << "rank " << r << ": " << adv << " vs " << want;
    EXPECT_EQ(ranks[r]["group_ids"].get<std::vector<int64_t>>(), (std::vector<int64_t>{r, r}));
    EXPECT_NEAR(ranks[r]["reward_mean"].get<double>(), all.mean().item<double>(), 1e-6);
    auto loss = sd3_rl_loss(model, rollouts[r], adv);
    EXPECT_NEAR(ranks[r]["loss"].get<double>(), loss.loss.item<double>(), 1e-5) << "rank " << r;
    EXPECT_LT(std::abs(ranks[r]["ppo_kl"].get<double>()), 1e-6) << "rank " << r;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardrl::testing
