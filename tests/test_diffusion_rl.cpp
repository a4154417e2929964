// Diffusion RL on the DiT: rollouts with recorded log-probs, the Flow-GRPO / NFT / DPO updates
// end to end on a deliberately easy reward, the reward classifier, and the demo driver on 2 ranks.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "shardrl/algos/dit_rl.h"
#include "shardrl/data.h"
#include "shardrl/models/classifier.h"
#include "shardrl/models/lora.h"
#include "shardrl/optim.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace lora = models::lora;
const std::string kFashion = "/usr/share/datasets/fashion-mnist";

models::DiTConfig tiny_dit_config() {
  models::DiTConfig c;
  c.input_size = 8;
  c.patch_size = 2;
  c.hidden_size = 32;
  c.depth = 1;
  c.num_heads = 2;
  c.num_classes = 3;
  c.frequency_embedding_size = 32;
  return c;
}

// adaLN-Zero starts at velocity 0 with no gradient to the blocks: move every weight off zero.
models::DiT tiny_dit(uint64_t seed) {
  torch::manual_seed(seed);
  models::DiT model(tiny_dit_config());
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.1);
  return model;
}

at::Generator gen(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

algos::dit::RolloutConfig rollout_config(double guidance = 1.0) {
  algos::dit::RolloutConfig r;
  r.num_steps = 6;
  r.noise_level = 0.7;
  r.guidance_scale = guidance;
  return r;
}

TEST(DiffusionRollout, RecordsShapesAndLogProbsThatARecomputeReproduces) {
  auto model = tiny_dit(1);
  const auto config = rollout_config(/*guidance=*/2.0);
  auto labels = torch::tensor({0, 1, 2, 1}, torch::kLong);
  auto ro = algos::dit::sample_with_logprob(model, labels, config, gen(5));
  EXPECT_EQ(ro.latents.sizes(), (std::vector<int64_t>{4, 7, 1, 8, 8}));
  EXPECT_EQ(ro.log_probs.sizes(), (std::vector<int64_t>{4, 6}));
  EXPECT_TRUE(ro.timesteps[2].equal(config.scheduler().timesteps));
  EXPECT_TRUE(torch::isfinite(ro.log_probs).all().item<bool>());
  for (int64_t j = 0; j < config.num_steps; ++j) {
    auto again = algos::dit::rollout_step(model, ro, j, config);
    EXPECT_TRUE(torch::allclose(again.log_prob, ro.log_probs.select(1, j), 1e-5, 1e-5))
        << "step " << j;
    // The same step by hand: the CFG velocity, then the SDE step scored on the recorded sample.
    auto sched = config.scheduler();
    auto x = ro.latents.select(1, j);
    auto sigma = sched.sigmas[j].expand({4});
    auto v = algos::cfg_combine(model(x, sigma, torch::full({4}, 3, torch::kLong)),
                                model(x, sigma, labels), 2.0);
    algos::SdeStepOptions opts;
    opts.prev_sample = ro.latents.select(1, j + 1);
    auto manual = algos::sde_step_with_logprob(sched, v, x, j, opts);
    EXPECT_TRUE(torch::allclose(manual.log_prob, ro.log_probs.select(1, j), 1e-4, 1e-4));
  }
}

TEST(DiffusionRollout, IsSeededAndNoiseLevelZeroIsTheOdeSample) {
  auto model = tiny_dit(2);
  auto labels = torch::tensor({0, 2}, torch::kLong);
  auto config = rollout_config();
  auto a = algos::dit::sample_with_logprob(model, labels, config, gen(9));
  auto b = algos::dit::sample_with_logprob(model, labels, config, gen(9));
  auto c = algos::dit::sample_with_logprob(model, labels, config, gen(10));
  EXPECT_TRUE(a.latents.equal(b.latents));
  EXPECT_TRUE(a.log_probs.equal(b.log_probs));
  EXPECT_FALSE(a.latents.equal(c.latents));

  config.noise_level = 0.0;
  auto ode = algos::dit::sample_with_logprob(model, labels, config, gen(9));
  auto sched = config.scheduler();
  torch::NoGradGuard no_grad;
  auto x = at::randn({2, 1, 8, 8}, gen(9), torch::kFloat);
  for (int64_t j = 0; j < config.num_steps; ++j) {
    auto v = model(x, sched.sigmas[j].expand({2}), labels);
    x = x + v * (sched.sigmas[j + 1] - sched.sigmas[j]);
  }
  EXPECT_TRUE(torch::allclose(ode.images(), x, 1e-5, 1e-5));
  EXPECT_FALSE(torch::allclose(a.images(), x, 1e-2, 1e-2));  // the SDE does add noise
}

// The easy reward: bright images.
torch::Tensor brightness(const torch::Tensor& images, const torch::Tensor&) {
  return images.flatten(1).mean(1);
}

struct Tuned {
  models::DiT model;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::map<std::string, torch::Tensor> base_before;
};

Tuned lora_tiny_dit(bool with_old) {
  Tuned t{tiny_dit(3), nullptr, {}};
  lora::LoraConfig cfg;
  cfg.r = 4;
  cfg.alpha = 8;
  cfg.target_modules = {"qkv", "proj", "fc1", "fc2"};
  lora::apply_lora(*t.model, cfg, "default");
  if (with_old) {
    lora::apply_lora(*t.model, cfg, "old", /*trainable=*/false);
    lora::set_active_adapter(*t.model, "default");
    lora::copy_adapter(lora::named_tensors(*t.model), "old", "default");
  }
  for (const auto& item : t.model->named_parameters()) {
    if (!lora::is_adapter_tensor(item.key()))
      t.base_before[item.key()] = item.value().detach().clone();
  }
  optim::AdamWConfig adam;
  adam.lr = 1e-2;
  adam.weight_decay = 0;
  t.optimizer = optim::make_adamw(optim::from_module(*t.model), adam);
  return t;
}

// Mean reward of the first and last `k` steps.
std::pair<double, double> run_steps(Tuned& t, const algos::dit::DiffusionRLConfig& config,
                                    int steps,
                                    std::vector<algos::dit::RLStepResult>* results = nullptr) {
  std::vector<double> rewards;
  for (int s = 0; s < steps; ++s) {
    auto labels = torch::tensor({0, 1}, torch::kLong).repeat_interleave(config.group_size);
    auto r = algos::dit::diffusion_rl_step(t.model, *t.optimizer, brightness, labels, s, config,
                                           gen(100 + s));
    rewards.push_back(r.reward_mean);
    if (results) results->push_back(r);
  }
  const int k = 3;
  double first = 0, last = 0;
  for (int i = 0; i < k; ++i) first += rewards[i] / k, last += rewards[steps - 1 - i] / k;
  return {first, last};
}

void expect_base_frozen(Tuned& t) {
  for (const auto& item : t.model->named_parameters()) {
    if (!lora::is_adapter_tensor(item.key())) {
      EXPECT_TRUE(item.value().equal(t.base_before.at(item.key()))) << item.key();
    }
  }
}

algos::dit::DiffusionRLConfig easy_config(const std::string& algorithm) {
  algos::dit::DiffusionRLConfig c;
  c.algorithm = algorithm;
  c.rollout = rollout_config();
  c.group_size = 6;
  c.micro_batch_size = 6;
  return c;
}

TEST(DiffusionRL, FlowGrpoRaisesAnEasyRewardWithLoraOnly) {
  auto t = lora_tiny_dit(false);
  auto config = easy_config("flow_grpo");
  config.mini_batches = 2;  // the second optimizer step sees a moved policy: the ratio clips
  config.flow_grpo.beta = 0.01;
  std::vector<algos::dit::RLStepResult> results;
  auto [first, last] = run_steps(t, config, 20, &results);
  EXPECT_GT(last, first + 0.05) << "reward " << first << " -> " << last;
  // The KL to the reference starts at 0 (LoRA B = 0) and grows; the clip engages.
  EXPECT_NEAR(results[0].metrics.at("kl").item<double>(), 0.0, 1e-5);
  EXPECT_GT(results.back().metrics.at("kl").item<double>(), 0.0);
  double clip = 0;
  for (auto& r : results) clip += r.metrics.at("clipfrac").item<double>();
  EXPECT_GT(clip, 0.0);
  EXPECT_TRUE(results.back().rollout.ref_means.defined());
  expect_base_frozen(t);
}

TEST(DiffusionRL, FlowGrpoPerTimestepBackwardEqualsOneSummedLoss) {
  auto t = lora_tiny_dit(false);
  const auto config = rollout_config();
  auto labels = torch::tensor({0, 0, 1, 1}, torch::kLong);
  auto ro = algos::dit::sample_with_logprob(t.model, labels, config, gen(4));
  auto adv = torch::tensor({1.0, -1.0, 0.5, -0.5});
  // Move the adapters off zero, so the gradient of B is not the only one.
  t.model->zero_grad();
  algos::FlowGrpoLossConfig loss;
  loss.loss_divisor = algos::grad_accum_divisor("flow_grpo", 1, config.num_steps);
  algos::dit::flow_grpo_backward(t.model, ro, adv, config, loss);
  std::vector<torch::Tensor> per_step;
  for (const auto& p : t.model->parameters()) {
    if (p.requires_grad()) per_step.push_back(p.grad().clone());
  }
  t.model->zero_grad();
  torch::Tensor total;
  for (int64_t j = 0; j < config.num_steps; ++j) {
    auto l = algos::dit::flow_grpo_timestep_loss(t.model, ro, adv, j, config, loss).loss;
    total = total.defined() ? total + l : l;
  }
  total.backward();
  size_t i = 0;
  for (const auto& p : t.model->parameters()) {
    if (!p.requires_grad()) continue;
    EXPECT_TRUE(torch::allclose(p.grad(), per_step[i++], 1e-5, 1e-7));
  }
  EXPECT_GT(per_step.back().abs().sum().item<double>(), 0.0);
}

TEST(DiffusionRL, NftRaisesAnEasyRewardAndTheOldAdapterFollows) {
  auto t = lora_tiny_dit(true);
  auto config = easy_config("nft");
  config.timestep_fraction = 0.5;
  config.nft_decay_schedule = "linear_to_0_5";
  auto [first, last] = run_steps(t, config, 10);
  EXPECT_GT(last, first + 0.1) << "reward " << first << " -> " << last;
  // The old adapter moved with the trained one (decay < 1), but lags it.
  auto& fc1 = *lora::lora_linears(*t.model).front().second;
  EXPECT_GT(fc1.lora_B("old").abs().sum().item<double>(), 0.0);
  EXPECT_FALSE(fc1.lora_B("old").equal(fc1.lora_B("default")));
  expect_base_frozen(t);
}

TEST(DiffusionRL, DpoPrefersTheBetterSampleOfEachPair) {
  auto t = lora_tiny_dit(false);
  auto config = easy_config("dpo");
  config.dpo.beta = 500;
  std::vector<algos::dit::RLStepResult> results;
  auto [first, last] = run_steps(t, config, 10, &results);
  // At the start the policy is the reference: no pair is preferred yet.
  EXPECT_EQ(results[0].metrics.at("implicit_acc").item<double>(), 0.0);
  double acc = 0;
  for (size_t i = 5; i < results.size(); ++i)
    acc += results[i].metrics.at("implicit_acc").item<double>() / 5;
  EXPECT_GT(acc, 0.5);
  EXPECT_GT(last, first) << "reward " << first << " -> " << last;
  expect_base_frozen(t);
}

TEST(DiffusionRL, ConfigErrorsNameTheField) {
  auto config = easy_config("ppo2");
  expect_invalid_argument_naming([&] { config.validate(); }, "algorithm", "ppo2");
  config = easy_config("flow_grpo");
  config.group_size = 1;
  expect_invalid_argument_naming([&] { config.validate(); }, "group_size", "1");
  config = easy_config("flow_grpo");
  config.rollout.noise_level = 0;
  expect_invalid_argument_naming([&] { config.validate(); }, "rollout.noise_level");
}

TEST(RewardClassifier, LearnsFashionMnistQuickly) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_file(kFashion + "/train-images-idx3-ubyte.gz",
                                          "the Debian package dataset-fashion-mnist"));
  data::ImageDatasetOptions ds;
  ds.image_size = 14;
  auto train = data::load_image_dataset(kFashion + "/train-images-idx3-ubyte.gz",
                                        kFashion + "/train-labels-idx1-ubyte.gz", ds);
  auto test = data::load_image_dataset(kFashion + "/t10k-images-idx3-ubyte.gz",
                                       kFashion + "/t10k-labels-idx1-ubyte.gz", ds);
  models::ClassifierConfig c;
  c.input_size = 14;
  torch::manual_seed(0);
  models::ImageClassifier net(c);
  models::ClassifierFitOptions fit;
  fit.steps = 800;
  std::vector<double> losses;
  fit.log = [&](int64_t, double loss, double) { losses.push_back(loss); };
  models::fit_classifier(net, train.images, train.labels, fit);
  EXPECT_LT(losses.back(), losses.front());
  const double acc = models::classifier_accuracy(net, test.images, test.labels);
  // 14x14 and 800 steps keep the test short (~15 s, about 83%); the demo's 28x28 classifier
  // prints its t10k accuracy (86% after 400 steps on 2 ranks).
  EXPECT_GT(acc, 0.80) << "t10k accuracy";
  auto x = test.images.narrow(0, 0, 16);
  auto y = test.labels.narrow(0, 0, 16);
  auto p = models::classifier_reward(net, x, y, "prob");
  EXPECT_TRUE(((p >= 0) & (p <= 1)).all().item<bool>());
  EXPECT_TRUE(torch::allclose(models::classifier_reward(net, x, y, "log_prob").exp(), p));
  expect_invalid_argument_naming([&] { models::classifier_reward(net, x, y, "logit"); },
                                 "reward_mode", "logit");
}

std::vector<std::string> demo_argv(const std::vector<std::string>& overrides,
                                   const std::string& config = "fmnist_flow_grpo.yaml") {
  std::vector<std::string> argv = {bin("shardrl"), "train",
                                   std::string(SHARDRL_SOURCE_DIR) + "/examples/configs/" + config};
  argv.insert(argv.end(), overrides.begin(), overrides.end());
  return argv;
}

ProcessResult train_demo(const std::vector<std::string>& overrides) {
  return run_process(demo_argv(overrides), {}, 300);
}

// The main job shrunk to seconds: 14x14 images, a one-block DiT, a few steps of everything.
std::vector<std::string> tiny_demo(const std::string& dir) {
  return {"data.image_size=14",
          "actor_rollout_ref.model.config={patch_size: 2, hidden_size: 32, depth: 1, num_heads: 4}",
          "reward_model.steps=20",
          "pretrain.steps=20",
          "pretrain.cache_dir=" + dir + "/cache",
          "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.rollout.groups_per_gpu=1",
          "actor_rollout_ref.rollout.num_steps=3",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "evaluation.per_class=2",
          "trainer.save_freq=1"};
}

// The main job's config, shrunk: `shardrl train` starts 2 ranks, writes the pictures and one
// metrics line per RL step; a second run finds both supervised stages cached; a run stopped
// after 2 steps and resumed to 3 logs the same rewards as an uninterrupted run of 3.
TEST(FmnistDemo, TrainsOnTwoRanksCachesTheSupervisedStageAndResumes) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_file(kFashion + "/train-images-idx3-ubyte.gz",
                                          "the Debian package dataset-fashion-mnist"));
  const auto dir = make_temp_dir("fmnist_demo");
  const auto tiny = tiny_demo(dir);
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), tiny.begin(), tiny.end());
    return extra;
  };
  auto first = train_demo(
      with({"trainer.default_local_dir=" + dir + "/resumed", "trainer.total_training_steps=2"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("classifier test accuracy"), std::string::npos) << first.output;
  for (const char* f : {"samples_before.png", "samples_after.png", "reward_curve.png"}) {
    auto png = data::read_png(dir + "/resumed/" + f);
    EXPECT_GT(png.numel(), 0) << f;
  }
  auto metrics = read_jsonl(dir + "/resumed/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 2u);
  for (const char* key :
       {"reward_mean", "reward_std", "clipfrac", "grad_norm", "lr", "kl", "loss", "step_time",
        "time_rollout", "time_reference", "time_update", "time_weight_sync", "time_offload"}) {
    EXPECT_TRUE(metrics[0].contains(key)) << key << " missing in " << metrics[0].dump();
  }

  auto resumed = train_demo(with({"trainer.default_local_dir=" + dir + "/resumed",
                                  "trainer.total_training_steps=3", "trainer.resume_mode=auto"}));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("classifier: cached"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("pretrained DiT: cached"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("pretrain step"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;

  auto straight = train_demo(
      with({"trainer.default_local_dir=" + dir + "/straight", "trainer.total_training_steps=3"}));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  expect_same_metrics(dir + "/resumed/metrics.jsonl", dir + "/straight/metrics.jsonl", 3,
                      {"reward_mean", "grad_norm"});
}

// Flow-GRPO, DiffusionNFT and Diffusion-DPO through their example configs (the trainer's state
// offloaded to files between phases, the rollout on a weight-synced replica): pre-empted with
// SIGTERM after a few steps, resumed with trainer.resume_mode=auto, every step logs what an
// uninterrupted run logs (NFT's "old" adapter, which follows by EMA, comes back from the checkpoint
// too).
class DemoAlgorithm : public ::testing::TestWithParam<std::string> {};

TEST_P(DemoAlgorithm, ResumesAfterAKillBitwise) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_file(kFashion + "/train-images-idx3-ubyte.gz",
                                          "the Debian package dataset-fashion-mnist"));
  const std::string config = "fmnist_" + GetParam() + ".yaml";
  const auto dir = make_temp_dir("fmnist_" + GetParam());
  auto overrides = [&](const std::string& run) {
    auto o = tiny_demo(dir);
    o.push_back("trainer.default_local_dir=" + dir + "/" + run);
    o.push_back("trainer.total_training_steps=6");
    o.push_back("trainer.resume_mode=auto");
    return o;
  };
  auto straight = run_process(demo_argv(overrides("straight"), config), {}, 300);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string metrics = dir + "/killed/metrics.jsonl";
  auto killed = run_process_until(
      demo_argv(overrides("killed"), config),
      [&] { return std::filesystem::exists(metrics) && read_jsonl(metrics).size() >= 3; }, SIGTERM);
  ASSERT_TRUE(killed.stopped) << killed.output;
  ASSERT_NE(killed.exit_code, 0) << killed.output;
  auto resumed = run_process(demo_argv(overrides("killed"), config), {}, 300);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  expect_same_metrics(metrics, dir + "/straight/metrics.jsonl", 6, {"reward_mean", "grad_norm"});
}

INSTANTIATE_TEST_SUITE_P(EveryAlgorithm, DemoAlgorithm,
                         ::testing::Values("flow_grpo", "nft", "dpo"));

}  // namespace
}  // namespace shardrl::testing
