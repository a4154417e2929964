// verl-omni's diffusion algorithms against tests/python/diffusion_algos_reference.py, a reference
// written from verl-omni's own code (flow_match_sde.py, diffusion_algos.py, losses.py, the MixGRPO
// pipeline), on rows ShardRL's sampler produced: every SDE type's step (sde, cps, dance_sde), every
// reverse-process loss mode with the reference KL and a teacher term added, DiffusionNFT's loss
// and reward probabilities, Diffusion-DPO, the group advantages, the old-policy decay schedules
// and MixGRPO's windows.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "model_test_util.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/weights.h"
#include "test_util.h"

namespace shardrl::testing::diffusion_reference {
namespace {

namespace lora = models::lora;
using algos::TensorMap;
using nlohmann::json;

constexpr int64_t kTextLen = 5, kTextDim = 12, kSteps = 6;

at::Generator gen(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

// 3 prompts x 4 samples with a negative prompt for CFG.
algos::Conditioning conditioning(uint64_t seed) {
  auto g = gen(seed);
  const int64_t prompts = 3, group = 4, b = prompts * group;
  algos::Conditioning c;
  c.prompt_embeds = at::randn({prompts, kTextLen, kTextDim}, g).repeat_interleave(group, 0);
  c.pooled_prompt_embeds = at::randn({prompts, kTextDim}, g).repeat_interleave(group, 0);
  c.negative_prompt_embeds = at::randn({1, kTextLen, kTextDim}, g).expand({b, -1, -1}).contiguous();
  c.negative_pooled_prompt_embeds = at::randn({1, kTextDim}, g).expand({b, -1}).contiguous();
  return c;
}

// The policy with two adapters that differ from each other and from the base: "old" samples,
// "default" is trained, adapters disabled is the reference.
models::SD3Transformer2DModel policy() {
  torch::manual_seed(3);
  models::SD3Transformer2DModel model(tiny_sd3_config(kTextDim));
  lora::LoraConfig cfg;
  cfg.r = 4;
  cfg.alpha = 8;
  cfg.target_modules = {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj"};
  lora::apply_lora(*model, cfg, "default");
  lora::apply_lora(*model, cfg, "old", /*trainable=*/false);
  torch::NoGradGuard no_grad;
  auto g = gen(11);
  for (auto& p : model->named_parameters()) {
    if (p.key().find("lora_B") != std::string::npos)
      p.value().copy_(at::randn(p.value().sizes(), g) * 0.05);
  }
  lora::set_active_adapter(*model, "default");
  return model;
}

algos::SamplerConfig sampler(const std::string& sde_type) {
  algos::SamplerConfig s;
  s.num_inference_steps = kSteps;
  s.shift = 3.0;
  s.noise_level = 0.8;
  s.sde_type = sde_type;
  s.true_cfg_scale = 2.0;
  s.height = s.width = 8;
  return s;
}

algos::DiffusionLossConfig loss_config(const std::string& mode) {
  algos::DiffusionLossConfig c;
  c.loss_mode = mode;
  c.clip_ratio = 1e-4;   // the demo's: the ratios here stray ~1e-4 from 1
  c.adv_clip_max = 1.5;  // below some advantages: the clamp acts
  c.mix_beta = 0.7;
  c.ref_kl_coef = 0.3;
  c.adaptive_weight_min = 1e-5;
  c.dpo_beta = 50.0;
  c.kl_mask_threshold = 5e-5;  // between the SDE types' KL to the old policy
  c.add_kl_coefficient = true;
  if (algos::is_reverse_process_loss(mode)) {
    c.kl_loss_coef = 0.1;
    c.distill_loss_coef = 0.5;
    c.distill_loss_mode = "distill_fm_mse";
  }
  return c;
}

const std::vector<std::string> kReverseModes = {
    "flow_grpo", "dance_grpo", "flow_dppo", "grpo_guard", "kl", "distill_kl", "distill_fm_mse"};
const std::vector<std::string> kSdeTypes = {"sde", "cps", "dance_sde"};
const std::vector<std::string> kAdvModes = {"continuous", "positive_only", "negative_only",
                                            "one_only", "binary"};

std::vector<double> values(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kDouble).contiguous().reshape({-1});
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

// What ShardRL computed, and the inputs the reference reads.
struct Computed {
  TensorMap inputs;                          // to the reference
  std::map<std::string, torch::Tensor> got;  // ShardRL's values, by the reference's output names
  json config;
};

Computed compute() {
  Computed c;
  auto model = policy();
  torch::manual_seed(5);
  models::SD3Transformer2DModel teacher(tiny_sd3_config(kTextDim));
  const auto cond = conditioning(21);
  // One trained step per SDE type: the first (sigma 1, where "sde" uses sigmas[1]), a middle one
  // and the last but one.
  const std::map<std::string, int64_t> step_of = {{"sde", 0}, {"cps", 2}, {"dance_sde", 4}};
  torch::Tensor rewards;
  algos::DiffusionRollout nft_rollout;
  for (const auto& type : kSdeTypes) {
    const auto s = sampler(type);
    algos::DiffusionRollout ro;
    {
      lora::UseAdapter old(*model, "old");
      ro = algos::sample_with_logprob(model, cond, s, {0, kSteps - 1}, gen(31));
    }
    if (type == "sde") {
      rewards = ro.images().flatten(1).mean(1) * 10;
      nft_rollout = ro;
    }
    auto adv = algos::diffusion_group_advantages(
        rewards, std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2});
    auto rows = algos::flow_grpo_rows(ro, adv, {step_of.at(type)});
    {
      lora::UseAdapter old(*model, "old");
      for (auto& [k, v] : algos::recompute_log_probs(model, rows, s)) rows[k] = v;
    }
    {
      lora::DisableAdapters ref(*model);
      for (auto& [k, v] : algos::frozen_outputs("reference", model, rows, loss_config("kl"), s))
        rows[k] = v;
    }
    for (const auto* mode : {"distill_kl", "distill_fm_mse"}) {
      for (auto& [k, v] : algos::frozen_outputs("teacher", teacher, rows, loss_config(mode), s))
        rows[k] = v;
    }
    torch::NoGradGuard no_grad;
    const auto current = algos::policy_step(model, rows, s);
    const std::string p = type + "/";
    c.inputs[p + "x"] = rows["latents"];
    c.inputs[p + "prev"] = rows["next_latents"];
    c.inputs[p + "v"] = current.velocity;
    c.inputs[p + "sigma"] = rows["sigma"];
    c.inputs[p + "sigma_next"] = rows["sigma_next"];
    for (const auto* k :
         {"old_log_probs", "advantages", "old_prev_sample_mean", "ref_prev_sample_mean",
          "teacher_prev_sample_mean", "teacher_noise_pred"}) {
      c.inputs[p + k] = rows[k];
    }
    c.got[p + "log_prob"] = current.step.log_prob;
    c.got[p + "mean"] = current.step.prev_sample_mean;
    c.got[p + "std_dev_t"] = current.step.std_dev_t.reshape({-1});
    c.got[p + "sqrt_dt"] = current.step.sqrt_dt.reshape({-1});
    for (const auto& mode : kReverseModes) {
      auto out = algos::diffusion_loss(model, rows, loss_config(mode), s);
      c.got[p + mode + "/loss"] = out.loss;
      for (const auto& [name, value] : out.metrics) c.got[p + mode + "/" + name] = value;
    }
  }
  // Rewards with a singleton group, and the advantages of each setting.
  c.inputs["rewards"] = rewards.narrow(0, 0, 9);
  const std::vector<int64_t> uids = {0, 0, 0, 0, 1, 1, 1, 1, 2};
  c.inputs["uids"] = torch::tensor(uids, torch::kLong);
  for (bool global_std : {true, false}) {
    for (bool norm : {true, false}) {
      algos::DiffusionAdvantageConfig a;
      a.global_std = global_std;
      a.normalize_by_std = norm;
      c.got[fmt::format("advantages/global{}_norm{}", int(global_std), int(norm))] =
          algos::diffusion_group_advantages(rewards.narrow(0, 0, 9), uids, a);
    }
  }
  const auto adv9 = algos::diffusion_group_advantages(rewards.narrow(0, 0, 9), uids);
  for (const auto& mode : kAdvModes) {
    c.got["reward_prob/" + mode] = algos::nft_reward_prob(adv9, mode, 1.5);
  }

  // DiffusionNFT on rows of the "sde" rollout.
  {
    const auto s = sampler("sde");
    auto adv = algos::diffusion_group_advantages(
        rewards, std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2});
    auto loss = loss_config("diffusion_nft");
    auto rows =
        algos::nft_rows(nft_rollout, algos::nft_reward_prob(adv, "continuous", 1.5), 0.5, gen(41));
    {
      lora::UseAdapter old(*model, "old");
      for (auto& [k, v] : algos::frozen_outputs("old", model, rows, loss, s)) rows[k] = v;
    }
    {
      lora::DisableAdapters ref(*model);
      for (auto& [k, v] : algos::frozen_outputs("reference", model, rows, loss, s)) rows[k] = v;
    }
    auto out = algos::diffusion_loss(model, rows, loss, s);
    torch::NoGradGuard no_grad;
    auto cond_rows = algos::Conditioning::from(rows);
    auto t = rows["t"];
    c.inputs["nft/v"] = model(rows["xt"], cond_rows.prompt_embeds, cond_rows.pooled_prompt_embeds,
                              (t * 1000.0).contiguous())
                            .to(torch::kFloat);
    c.inputs["nft/v_old"] = rows["old_velocity"];
    c.inputs["nft/v_ref"] = rows["ref_velocity"];
    for (const auto* k : {"x0", "xt", "t", "r"}) c.inputs[std::string("nft/") + k] = rows[k];
    c.got["nft/loss"] = out.loss;
    for (const auto& [name, value] : out.metrics) c.got["nft/" + name] = value;

    // Diffusion-DPO on the best and worst of each group.
    auto dloss = loss_config("dpo");
    std::vector<int64_t> groups = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2};
    auto drows = algos::dpo_rows(nft_rollout, rewards, groups, 3.0, gen(43));
    {
      lora::DisableAdapters ref(*model);
      for (auto& [k, v] : algos::frozen_outputs("reference", model, drows, dloss, s)) drows[k] = v;
    }
    auto dout = algos::diffusion_loss(model, drows, dloss, s);
    const auto pairs = algos::dpo_make_pairs(rewards, groups);
    auto interleave = [](const torch::Tensor& a, const torch::Tensor& b) {
      auto both = torch::stack({a, b}, 1);
      auto shape = both.sizes().vec();
      shape.erase(shape.begin());
      shape[0] = 2 * a.size(0);
      return both.reshape(shape);
    };
    auto x0 = interleave(drows["chosen_x0"], drows["rejected_x0"]);
    auto eps = algos::repeat_for_pairs(drows["eps"]);
    auto sigma = algos::repeat_for_pairs(drows["sigma"]);
    auto pair_cond = algos::Conditioning::from(drows).index_select(
        torch::arange(pairs.num_pairs()).repeat_interleave(2));
    c.inputs["dpo/latent"] = x0;
    c.inputs["dpo/noise"] = eps;
    c.inputs["dpo/pred"] = model(algos::flow_interpolate(x0, eps, sigma), pair_cond.prompt_embeds,
                                 pair_cond.pooled_prompt_embeds, (sigma * 1000.0).contiguous())
                               .to(torch::kFloat);
    c.inputs["dpo/ref_pred"] = interleave(drows["ref_chosen_pred"], drows["ref_rejected_pred"]);
    c.inputs["dpo/scores"] = rewards.index_select(0, pairs.index_tensor());
    c.got["dpo/loss"] = dout.loss;
    for (const auto& [name, value] : dout.metrics) c.got["dpo/" + name] = value;
  }

  // Old-policy decay and MixGRPO windows.
  const std::vector<int64_t> decay_steps = {0, 1, 2, 50, 74, 75, 76, 200, 499, 500, 1000, 5000};
  for (const auto* schedule : {"copy", "linear_to_0_5", "delayed_linear_to_0_999"}) {
    std::vector<double> d;
    for (auto step : decay_steps) d.push_back(algos::ema_decay(schedule, step));
    c.got[std::string("decay/") + schedule] = torch::tensor(d, torch::kDouble);
  }
  json windows = json::object();
  std::vector<int64_t> steps;
  for (int64_t i = 1; i <= 40; ++i) steps.push_back(i);
  struct WindowCase {
    const char* name;
    const char* strategy;
    int64_t size, first, last, seed, iters;
  };
  for (const auto& w : {WindowCase{"random_seed42", "random", 2, 0, 5, 42, 1},
                        WindowCase{"random_seed0_wide", "random", 3, 1, 9, 0, 1},
                        WindowCase{"random_seed_big", "random", 1, 0, 10, 123456789012, 1},
                        WindowCase{"progressive", "progressive", 2, 0, 7, 0, 1},
                        WindowCase{"progressive_every3", "progressive", 3, 1, 10, 0, 3}}) {
    algos::SamplerConfig s = sampler("sde");
    s.num_inference_steps = 10;
    s.mix_grpo = true;
    s.sample_strategy = w.strategy;
    s.sde_window_size = w.size;
    s.sde_window_range = {w.first, w.last};
    s.sde_window_seed = w.seed;
    s.iters_per_group = w.iters;
    std::vector<int64_t> got;
    for (auto step : steps) {
      auto window = algos::draw_sde_window(s, gen(1), step);
      got.push_back(window.begin);
      got.push_back(window.end);
    }
    c.got[std::string("window/") + w.name] = torch::tensor(got, torch::kLong);
    windows[w.name] = {{"sample_strategy", w.strategy},
                       {"sde_window_size", w.size},
                       {"sde_window_range", {w.first, w.last}},
                       {"sde_window_seed", w.seed},
                       {"iters_per_group", w.iters},
                       {"steps", steps}};
  }

  const auto l = loss_config("flow_grpo");
  c.config = {{"num_inference_steps", kSteps},
              {"shift", 3.0},
              {"noise_level", 0.8},
              {"diffusion_loss",
               {{"clip_ratio", l.clip_ratio},
                {"adv_clip_max", l.adv_clip_max},
                {"mix_beta", l.mix_beta},
                {"ref_kl_coef", l.ref_kl_coef},
                {"adaptive_weight_min", l.adaptive_weight_min},
                {"dpo_beta", l.dpo_beta},
                {"kl_mask_threshold", l.kl_mask_threshold},
                {"add_kl_coefficient", l.add_kl_coefficient}}},
              {"kl_loss_coef", l.kl_loss_coef},
              {"distill_loss_coef", l.distill_loss_coef},
              {"distill_loss_mode", l.distill_loss_mode},
              {"adv_modes", kAdvModes},
              {"decay_steps", decay_steps},
              {"windows", windows}};
  return c;
}

// ShardRL's values and the reference's, computed once for every test below.
struct Compared {
  std::map<std::string, torch::Tensor> got, want;
  std::string error;
};

const Compared& compared() {
  static const Compared result = [] {
    Compared r;
    auto c = compute();
    r.got = c.got;
    const auto dir = make_temp_dir("diffusion_reference");
    std::ofstream(dir + "/config.json") << c.config.dump();
    std::map<std::string, torch::Tensor> inputs;
    for (auto& [k, v] : c.inputs) inputs[k] = v.detach().contiguous();
    models::save_weights(inputs, dir + "/in.safetensors");
    auto run = run_python_reference(
        "diffusion_algos_reference.py",
        {dir + "/config.json", dir + "/in.safetensors", dir + "/out.safetensors"});
    if (run.exit_code != 0) {
      r.error = run.output;
      return r;
    }
    checkpoint::HfWeights file(dir + "/out.safetensors");
    for (const auto& name : file.names()) r.want[name] = file.reader(name).read(name);
    std::filesystem::remove_all(dir);
    return r;
  }();
  return result;
}

// got[name] against want[name], elementwise within rtol / atol.
void expect_matches(const std::string& name, double rtol = 1e-5, double atol = 1e-6) {
  const auto& c = compared();
  ASSERT_TRUE(c.error.empty()) << c.error;
  ASSERT_TRUE(c.got.count(name)) << "ShardRL computed no " << name;
  ASSERT_TRUE(c.want.count(name)) << "the reference computed no " << name;
  auto got = c.got.at(name).detach().to(torch::kDouble).reshape({-1});
  auto want = c.want.at(name).to(torch::kDouble).reshape({-1});
  ASSERT_EQ(got.numel(), want.numel()) << name;
  EXPECT_TRUE(torch::allclose(got, want, rtol, atol))
      << name << ": ShardRL " << fmt::format("{}", fmt::join(values(got), ", ")).substr(0, 600)
      << "\nverl-omni " << fmt::format("{}", fmt::join(values(want), ", ")).substr(0, 600);
}

TEST(VerlOmniReference, SdeStepsOfEverySdeType) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "diffusers", "safetensors"}));
  for (const auto& type : kSdeTypes) {
    SCOPED_TRACE(type);
    for (const auto* out : {"log_prob", "mean", "std_dev_t", "sqrt_dt"}) {
      expect_matches(type + "/" + out);
    }
  }
}

TEST(VerlOmniReference, EveryReverseProcessLossWithReferenceKlAndTeacherTerm) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "diffusers", "safetensors"}));
  for (const auto& type : kSdeTypes) {
    for (const auto& mode : kReverseModes) {
      SCOPED_TRACE(type + " " + mode);
      const std::string p = type + "/" + mode + "/";
      expect_matches(p + "loss", 1e-4, 1e-6);
      expect_matches(p + "policy_loss", 1e-4, 1e-6);
      if (mode != "kl" && !mode.starts_with("distill")) {
        expect_matches(p + "ppo_kl", 1e-4, 1e-6);
        expect_matches(p + "ratio_mean", 1e-5, 1e-6);
      }
      if (mode == "flow_grpo" || mode == "dance_grpo" || mode == "grpo_guard") {
        expect_matches(p + "clipfrac");
      }
      if (mode == "flow_dppo") {
        expect_matches(p + "kl_new_old_mean", 1e-4, 1e-7);
        expect_matches(p + "masked_fraction");
      }
    }
  }
  // The modes and settings exercise what they should: some ratios clip, the trust region drops
  // some samples, and not all.
  const auto& got = compared().got;
  double clipped = 0, masked = 0;
  std::string seen;
  for (const auto& type : kSdeTypes) {
    clipped += got.at(type + "/flow_grpo/clipfrac").item<double>();
    masked += got.at(type + "/flow_dppo/masked_fraction").item<double>();
    seen += fmt::format(" {}: clipfrac {} ratio_mean {} kl_new_old {} masked {};", type,
                        got.at(type + "/flow_grpo/clipfrac").item<double>(),
                        got.at(type + "/flow_grpo/ratio_mean").item<double>(),
                        got.at(type + "/flow_dppo/kl_new_old_mean").item<double>(),
                        got.at(type + "/flow_dppo/masked_fraction").item<double>());
  }
  EXPECT_GT(clipped, 0) << seen;
  EXPECT_LT(clipped, 3) << seen;
  EXPECT_GT(masked, 0) << seen;
  EXPECT_LT(masked, 3) << seen;
}

TEST(VerlOmniReference, NftAndDpoLosses) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "diffusers", "safetensors"}));
  for (const auto* name : {"nft/loss", "nft/policy_loss", "nft/positive_loss", "nft/negative_loss",
                           "nft/kl", "dpo/loss", "dpo/implicit_acc", "dpo/reward_margin"}) {
    expect_matches(name, 1e-4, 1e-6);
  }
}

TEST(VerlOmniReference, AdvantagesRewardProbabilitiesDecayAndMixGrpoWindows) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "diffusers", "safetensors"}));
  for (const auto* name : {"advantages/global1_norm1", "advantages/global1_norm0",
                           "advantages/global0_norm1", "advantages/global0_norm0"}) {
    expect_matches(name);
  }
  for (const auto& mode : kAdvModes) expect_matches("reward_prob/" + mode);
  for (const auto* schedule : {"copy", "linear_to_0_5", "delayed_linear_to_0_999"}) {
    expect_matches(std::string("decay/") + schedule, 0, 1e-12);
  }
  for (const auto* name : {"random_seed42", "random_seed0_wide", "random_seed_big", "progressive",
                           "progressive_every3"}) {
    expect_matches(std::string("window/") + name, 0, 0);
  }
}

}  // namespace
}  // namespace shardrl::testing::diffusion_reference
