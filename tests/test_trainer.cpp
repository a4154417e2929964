// The trainer: config checking, `shardrl train` on real ranks, metrics.jsonl and resume.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>

#include <unistd.h>

#include "../src/trainer/tasks.h"
#include "expect_error.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/weights.h"
#include "test_util.h"
#include "workers/llama_scenario.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const auto path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(TrainerConfig, FileThenOverridesWithTypesKept) {
  const auto dir = make_temp_dir("trainer_config");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto config =
      trainer::task_config(path, {"actor_rollout_ref.actor.optim.lr=0.5", "trainer.save_freq=3",
                                  "actor_rollout_ref.actor.optim.betas=[0.8, 0.9]"});
  EXPECT_EQ(trainer::get<int64_t>(config, "trainer.total_training_steps"), 4);
  EXPECT_EQ(trainer::get<int64_t>(config, "trainer.save_freq"), 3);
  EXPECT_DOUBLE_EQ(trainer::get<double>(config, "actor_rollout_ref.actor.optim.lr"), 0.5);
  auto engine = trainer::engine_config(config, "language_model", "actor");
  EXPECT_DOUBLE_EQ(engine.optim.beta1, 0.8);
  EXPECT_EQ(engine.micro_batch_size_per_gpu, 2);
  EXPECT_EQ(engine.optim.schedule.total_training_steps, 4);
  EXPECT_TRUE(engine.fsdp.host_shared_params);
  auto private_copies =
      trainer::task_config(path, {"actor_rollout_ref.actor.fsdp_config.host_shared_params=false"});
  EXPECT_FALSE(
      trainer::engine_config(private_copies, "language_model", "actor").fsdp.host_shared_params);
  // Untouched defaults survive.
  EXPECT_EQ(trainer::get<std::string>(config, "trainer.resume_mode"), "auto");
}

TEST(TrainerConfig, ErrorsNameTheKeyAndTheFile) {
  const auto dir = make_temp_dir("trainer_config_errors");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(path, {"trainer.totl_training_steps=3"}); },
      {"trainer.totl_training_steps", "unknown"});
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(path, {"actor_rollout_ref.actor.optim.lr=fast"}); },
      {"actor_rollout_ref.actor.optim.lr", "a number"});
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(path, {"trainer.save_freq=2.5"}); }, {"trainer.save_freq"});
  const auto bad =
      write_file(dir, "bad.yaml", std::string(kSmallLmConfig) + "data:\n  shuffle: true\n");
  expect_error_naming<std::invalid_argument>([&] { trainer::task_config(bad, {}); }, {"bad.yaml"});
  const auto unknown =
      write_file(dir, "unknown.yaml", "trainer:\n  task: lm_pretrain\nalgorithm:\n  kl_ctrl: 1\n");
  expect_error_naming<std::invalid_argument>([&] { trainer::task_config(unknown, {}); },
                                             {"unknown.yaml", "'algorithm'"});
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(dir + "/missing.yaml", {}); }, {"missing.yaml"});
  const auto no_task = write_file(dir, "no_task.yaml", "trainer:\n  total_training_steps: 3\n");
  expect_error_naming<std::invalid_argument>([&] { trainer::task_config(no_task, {}); },
                                             {"trainer.task"});
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(path, {"trainer.task=painting"}); }, {"painting", "lm_pretrain"});
}

// Keys ShardRL used to spell its own way are errors naming verl's key that replaced them.
TEST(TrainerConfig, OldKeyNamesAreErrorsNamingVerlsKey) {
  const auto dir = make_temp_dir("trainer_config_renamed");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(path, {"trainer.resume=auto"}); },
      {"'trainer.resume'", "trainer.resume_mode"});
  expect_error_naming<std::invalid_argument>(
      [&] { trainer::task_config(path, {"trainer.max_ckpt_to_keep=3"}); },
      {"'trainer.max_ckpt_to_keep'", "trainer.max_actor_ckpt_to_keep"});
  const auto grpo = write_file(dir, "grpo.yaml", "trainer:\n  task: lm_grpo\n");
  for (const std::string key : {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
                                "loss_agg_mode", "kl_loss_coef", "kl_loss_type"}) {
    expect_error_naming<std::invalid_argument>(
        [&] { trainer::task_config(grpo, {"algorithm." + key + "=1"}); },
        {"'algorithm." + key + "'", "actor_rollout_ref.actor." + key});
  }
  // The evaluation sampler's values sit under val_kwargs as verl-omni nests them.
  for (const auto& [key, nested] :
       {std::pair{"num_inference_steps", "pipeline"}, std::pair{"noise_level", "algo"}}) {
    const std::string old_key = std::string("actor_rollout_ref.rollout.val_kwargs.") + key;
    expect_error_naming<std::invalid_argument>(
        [&] { trainer::task_config(grpo, {old_key + "=1"}); },
        {"'" + old_key + "'",
         std::string("actor_rollout_ref.rollout.val_kwargs.") + nested + "." + key});
  }
  // verl's names are accepted where verl has them (the checkpoint folder aside: it is no file).
  auto config = trainer::task_config(
      grpo,
      {"actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.use_kl_loss=true",
       "trainer.max_actor_ckpt_to_keep=4", "trainer.resume_mode=resume_path",
       "trainer.resume_from_path=/tmp/x"},
      trainer::ConfigChecks::kValues);
  EXPECT_DOUBLE_EQ(trainer::get<double>(config, "actor_rollout_ref.actor.clip_ratio"), 0.3);
  EXPECT_EQ(trainer::engine_config(config, "language_model", "actor").checkpoint.max_ckpt_to_keep,
            4);
}

ProcessResult train(const std::string& config, const std::vector<std::string>& overrides) {
  std::vector<std::string> argv = {bin("shardrl"), "train", config};
  argv.insert(argv.end(), overrides.begin(), overrides.end());
  return run_process(argv, {}, 300);
}

TEST(Trainer, BadResumeModeNamesTheKey) {
  const auto dir = make_temp_dir("trainer_resume_mode");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto result = train(path, {"trainer.default_local_dir=" + dir, "trainer.resume_mode=sometimes"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("trainer.resume_mode"), std::string::npos) << result.output;
  result = train(path, {"trainer.default_local_dir=" + dir, "trainer.resume_mode=resume_path"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("trainer.resume_from_path"), std::string::npos) << result.output;
}

// verl's actor_rollout_ref.nccl_timeout, in seconds, bounds every collective; a value that could
// not is refused before any rank starts. (tests/test_multihost.cpp shows the value reaching the
// process groups: a cut link ends the run after it, and the error names it.)
TEST(Trainer, NcclTimeoutIsVerlsKeyAndBadValuesNameIt) {
  const auto dir = make_temp_dir("trainer_nccl_timeout");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  EXPECT_EQ(trainer::get<int64_t>(trainer::task_config(path, {}), "actor_rollout_ref.nccl_timeout"),
            600);
  for (const std::string bad : {"0", "-5", "2592001"}) {
    auto result =
        train(path, {"trainer.default_local_dir=" + dir, "actor_rollout_ref.nccl_timeout=" + bad});
    EXPECT_NE(result.exit_code, 0) << bad;
    EXPECT_NE(result.output.find("config key 'actor_rollout_ref.nccl_timeout' must be an integer "
                                 "in [1, 2592000], got " +
                                 bad),
              std::string::npos)
        << result.output;
  }
  auto result =
      train(path, {"trainer.default_local_dir=" + dir, "actor_rollout_ref.nccl_timeout=2.5"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("actor_rollout_ref.nccl_timeout"), std::string::npos)
      << result.output;
}

TEST(Trainer, MissingDataFileNamesTheKeyAndTheFile) {
  const auto dir = make_temp_dir("trainer_missing_data");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto result = train(path, {"data.train_files=" + dir + "/no_such_corpus.txt"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("data.train_files"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("no_such_corpus.txt"), std::string::npos) << result.output;
}

// trainer.logger as verl names it, through `shardrl train`: console and tensorboard without file
// (no metrics.jsonl; TensorBoard's reader finds every metric at every step), the console's step
// lines with the throughput and the ETA, a single name for a list of one, and an unknown logger
// stopping the run before any rank starts.
TEST(Trainer, LoggersAsVerlNamesThem) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_tensorboard_reader());
  const auto dir = make_temp_dir("trainer_loggers");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto watched =
      run_process({bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/tb_run",
                   "trainer.logger=[console, tensorboard]"},
                  {{"TENSORBOARD_DIR", dir + "/tb"}}, 300);
  ASSERT_EQ(watched.exit_code, 0) << watched.output;
  EXPECT_FALSE(fs::exists(dir + "/tb_run/metrics.jsonl"));
  ASSERT_EQ(event_files(dir + "/tb").size(), 1u);
  expect_checks_pass(
      read_tensorboard(
          {"scalars", dir + "/tb",
           json({{"tags",
                  {"loss", "grad_norm", "lr", "perf/tokens_per_s", "step_time", "memory_rss_gb"}},
                 {"steps", {1, 2, 3, 4}}})
               .dump()}),
      4);
  // Tokens trained per second and the ETA from the mean step so far; none after the last step.
  const std::regex line(
      R"(\[rank 0\] step 2/4 loss=\S+ grad_norm=\S+ \| [0-9.]+ tok/s \| [0-9.]+m?s/step, ETA [0-9.]+m?s\n)");
  EXPECT_TRUE(std::regex_search(watched.output, line)) << watched.output;
  const std::regex last(
      R"(\[rank 0\] step 4/4 loss=\S+ grad_norm=\S+ \| [0-9.]+ tok/s \| [0-9.]+m?s/step\n)");
  EXPECT_TRUE(std::regex_search(watched.output, last)) << watched.output;

  // `logger: console`, as configs in the wild have it: the console alone.
  auto console =
      run_process({bin("shardrl"), "train", path,
                   "trainer.default_local_dir=" + dir + "/console_run", "trainer.logger=console"},
                  {{"TENSORBOARD_DIR", dir + "/tb_console"}}, 300);
  ASSERT_EQ(console.exit_code, 0) << console.output;
  EXPECT_NE(console.output.find("step 4/4"), std::string::npos) << console.output;
  EXPECT_FALSE(fs::exists(dir + "/console_run/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir + "/tb_console"));

  auto wandb =
      run_process({bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/wandb_run",
                   "trainer.logger=[console, wandb]"},
                  {}, 60);
  EXPECT_NE(wandb.exit_code, 0);
  for (const char* expected :
       {"override 'trainer.logger=[console, wandb]': config key 'trainer.logger' must be a list, "
        "each one of console, file, tensorboard, got [\"console\",\"wandb\"]"}) {
    EXPECT_NE(wandb.output.find(expected), std::string::npos) << wandb.output;
  }
  EXPECT_EQ(wandb.output.find("[rank"), std::string::npos) << "a rank started\n" << wandb.output;
}

// A run stopped after 4 steps and continued to 6 logs the same losses as a run of 6 steps: the
// model, optimizer, schedule and data order all come back from the checkpoint.
TEST(Trainer, TrainsOnTwoRanksLogsMetricsAndResumesBitwise) {
  const auto dir = make_temp_dir("trainer_lm");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto first = train(path, {"trainer.default_local_dir=" + dir + "/resumed"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto metrics = read_jsonl(dir + "/resumed/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  for (const char* key : {"step", "loss", "grad_norm", "lr", "step_time", "memory_params_gb",
                          "memory_optimizer_gb", "memory_rss_gb"}) {
    EXPECT_TRUE(metrics[0].contains(key)) << key << " missing in " << metrics[0].dump();
  }
  EXPECT_TRUE(fs::exists(dir + "/resumed/checkpoints/global_step_4"));

  // The checkpoint load shows its progress (here at every tensor: SHARDRL_PROGRESS_SECONDS=0), on
  // rank 0 only, and how long it took.
  auto second =
      run_process({bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/resumed",
                   "trainer.total_training_steps=6"},
                  {{"SHARDRL_PROGRESS_SECONDS", "0"}}, 300);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  const std::string load = "checkpoint load from " + dir + "/resumed/checkpoints/global_step_4: ";
  EXPECT_NE(second.output.find("[rank 0] " + load), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("(100%)"), std::string::npos) << second.output;
  EXPECT_TRUE(std::regex_search(
      second.output, std::regex(R"(checkpoint load from \S+: ([0-9.]+ KB)/\1 in [0-9.]+m?s \()")))
      << second.output;
  EXPECT_EQ(second.output.find("[rank 1] " + load), std::string::npos) << second.output;
  // Straight through with private unsharded params: the ranks' host-shared image (the default,
  // above) trains to the same bits.
  auto straight = train(
      path, {"trainer.default_local_dir=" + dir + "/straight", "trainer.total_training_steps=6",
             "actor_rollout_ref.actor.fsdp_config.host_shared_params=false"});
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  expect_same_metrics(dir + "/resumed/metrics.jsonl", dir + "/straight/metrics.jsonl", 6,
                      {"step", "loss"});
  auto reference = read_jsonl(dir + "/straight/metrics.jsonl");
  ASSERT_EQ(reference.size(), 6u);
  EXPECT_LT(reference[5]["loss"].get<double>(), reference[0]["loss"].get<double>());
}

// The torchrun way: its agent starts the ranks and hosts the store (no `shardrl launch`). A run
// that torchrun started and resumed trains to the bits of one `shardrl train` ran straight, with
// the same one thread a rank (torchrun's default).
TEST(Trainer, TorchrunTrainsAndResumesAsShardrlLaunchDoes) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch"}));
  const auto dir = make_temp_dir("trainer_torchrun");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto torchrun = [&](const std::vector<std::string>& overrides) {
    std::vector<std::string> argv = {SHARDRL_PYTHON,
                                     "-m",
                                     "torch.distributed.run",
                                     "--nnodes",
                                     "1",
                                     "--nproc-per-node",
                                     "2",
                                     "--master-addr",
                                     "127.0.0.1",
                                     "--master-port",
                                     std::to_string(free_port()),
                                     "--no-python",
                                     bin("shardrl"),
                                     "train",
                                     path};
    argv.insert(argv.end(), overrides.begin(), overrides.end());
    auto result = run_process(argv, {}, 300);
    for (const char* noise : {"failed to bind", "frame #"})
      EXPECT_EQ(result.output.find(noise), std::string::npos) << noise << "\n" << result.output;
    return result;
  };
  auto first = torchrun({"trainer.default_local_dir=" + dir + "/resumed"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto second =
      torchrun({"trainer.default_local_dir=" + dir + "/resumed", "trainer.total_training_steps=6"});
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  auto straight =
      run_process({bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/straight",
                   "trainer.total_training_steps=6"},
                  {{"OMP_NUM_THREADS", "1"}}, 300);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  expect_same_metrics(dir + "/resumed/metrics.jsonl", dir + "/straight/metrics.jsonl", 6,
                      {"step", "loss", "grad_norm"});
}

// Damage to a checkpoint `shardrl train` wrote, of every kind a disk or a copy can do.
struct Damage {
  std::string kind, file, reason;  // reason: what the error and the warning say
  std::function<void(const std::string& path)> apply;
};

void flip_byte(const std::string& path, int64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  const char c = static_cast<char>(f.get());
  f.seekp(at);
  f.put(static_cast<char>(c ^ 0x01));
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const std::vector<Damage>& damages() {
  static const std::vector<Damage> all = {
      // One bit of a number (an optimizer step count, 4 -> 5): still valid JSON, so only the
      // checksum can tell.
      {"flipped byte in the index", "index.json", "is damaged: its crc32 is",
       [](const std::string& p) {
         const auto at = slurp(p).find("\"step\": 4");
         ASSERT_NE(at, std::string::npos);
         flip_byte(p, static_cast<int64_t>(at + 8));
       }},
      {"flipped byte in a shard", "model_rank1.safetensors", "is damaged: crc32",
       [](const std::string& p) { flip_byte(p, static_cast<int64_t>(fs::file_size(p) / 2)); }},
      {"truncated shard", "optim_rank0.safetensors", "is truncated",
       [](const std::string& p) { fs::resize_file(p, fs::file_size(p) - 100); }},
      {"missing shard", "model_rank0.safetensors", "is missing",
       [](const std::string& p) { fs::remove(p); }},
      {"missing index checksum", "index.json.crc32", "is missing",
       [](const std::string& p) { fs::remove(p); }},
      {"garbage index", "index.json", "is damaged: not valid JSON",
       [](const std::string& p) { std::ofstream(p, std::ios::trunc) << "{\"step\": 4, garbage"; }},
  };
  return all;
}

// Each kind of damage to the newest checkpoint (global_step_4 of a 4-step run that saved at 2
// and 4): `shardrl inspect` exits non-zero naming the file and why; resume_mode=resume_path on it
// is an error naming the same; resume_mode=auto warns naming it, resumes from global_step_2, and
// logs what an uninterrupted run logs from there.
TEST(Trainer, DamagedCheckpointsAreNamedAndAutoResumePassesOverThem) {
  const auto dir = make_temp_dir("trainer_damaged");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  // Straight through with private unsharded params: the ranks' host-shared image (the default,
  // above) trains to the same bits.
  auto straight = train(
      path, {"trainer.default_local_dir=" + dir + "/straight", "trainer.total_training_steps=6",
             "actor_rollout_ref.actor.fsdp_config.host_shared_params=false"});
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  auto base = train(path, {"trainer.default_local_dir=" + dir + "/base"});
  ASSERT_EQ(base.exit_code, 0) << base.output;
  auto whole = run_process({bin("shardrl"), "inspect", dir + "/base/checkpoints/global_step_4"});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_NE(whole.output.find("index.json: ok"), std::string::npos) << whole.output;

  for (const auto& d : damages()) {
    SCOPED_TRACE(d.kind);
    const std::string run = dir + "/" + d.file + "-" + std::to_string(&d - damages().data());
    fs::copy(dir + "/base", run, fs::copy_options::recursive);
    const std::string ckpt = run + "/checkpoints/global_step_4";
    const std::string file = ckpt + "/" + d.file;
    d.apply(file);
    const std::string named = file + " " + d.reason;

    auto inspect = run_process({bin("shardrl"), "inspect", ckpt});
    EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
    EXPECT_NE(inspect.output.find(named), std::string::npos) << inspect.output;
    EXPECT_NE(inspect.output.find("checksums FAILED"), std::string::npos) << inspect.output;

    auto by_path =
        train(path, {"trainer.default_local_dir=" + run, "trainer.total_training_steps=6",
                     "trainer.resume_mode=resume_path", "trainer.resume_from_path=" + ckpt});
    EXPECT_NE(by_path.exit_code, 0) << by_path.output;
    for (const std::string& expected :
         {"'trainer.resume_from_path': checkpoint " + ckpt + " is damaged", named}) {
      EXPECT_NE(by_path.output.find(expected), std::string::npos) << by_path.output;
    }

    auto resumed =
        train(path, {"trainer.default_local_dir=" + run, "trainer.total_training_steps=6"});
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    for (const std::string& expected :
         {"passing over damaged checkpoint " + ckpt, named,
          "resumed from " + run + "/checkpoints/global_step_2 at step 2"}) {
      EXPECT_NE(resumed.output.find(expected), std::string::npos) << resumed.output;
    }
    expect_same_metrics(run + "/metrics.jsonl", dir + "/straight/metrics.jsonl", 6,
                        {"step", "loss"});
  }
}

// Every checkpoint damaged: auto stops with an error naming each (rather than silently start
// over and overwrite them), and leaves every byte of them as it was.
TEST(Trainer, AutoResumeWithOnlyDamagedCheckpointsStopsAndTouchesNothing) {
  const auto dir = make_temp_dir("trainer_all_damaged");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto base = train(path, {"trainer.default_local_dir=" + dir});
  ASSERT_EQ(base.exit_code, 0) << base.output;
  const std::string root = dir + "/checkpoints";
  damages()[0].apply(root + "/global_step_4/index.json");
  damages()[2].apply(root + "/global_step_2/optim_rank0.safetensors");
  auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      if (e.is_regular_file()) files[e.path().string()] = slurp(e.path().string());
    }
    return files;
  };
  const auto before = snapshot();
  auto result = train(path, {"trainer.default_local_dir=" + dir, "trainer.total_training_steps=6"});
  EXPECT_NE(result.exit_code, 0) << result.output;
  for (const std::string& named :
       {root + "/global_step_4/index.json is damaged", "every checkpoint under " + root,
        root + "/global_step_2/optim_rank0.safetensors is truncated",
        std::string("trainer.resume_mode=disable")}) {
    EXPECT_NE(result.output.find(named), std::string::npos) << named << "\n" << result.output;
  }
  EXPECT_EQ(result.output.find("resumed from"), std::string::npos) << result.output;
  EXPECT_TRUE(snapshot() == before) << "a checkpoint was changed while choosing one";
}

// Resuming from global_step_2 past a damaged global_step_4 and saving at step 3 with
// trainer.max_actor_ckpt_to_keep=2: rotation removes the damaged later checkpoint, not the whole
// earlier one, and the run goes on from step 3 as if never interrupted.
TEST(Trainer, RotationAfterAFallbackKeepsTheWholeCheckpoints) {
  const auto dir = make_temp_dir("trainer_rotation_fallback");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  // Straight through with private unsharded params: the ranks' host-shared image (the default,
  // above) trains to the same bits.
  auto straight = train(
      path, {"trainer.default_local_dir=" + dir + "/straight", "trainer.total_training_steps=6",
             "actor_rollout_ref.actor.fsdp_config.host_shared_params=false"});
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string run = dir + "/run", root = run + "/checkpoints";
  auto base = train(path, {"trainer.default_local_dir=" + run});
  ASSERT_EQ(base.exit_code, 0) << base.output;
  damages()[1].apply(root + "/global_step_4/model_rank1.safetensors");
  auto to_3 = train(path, {"trainer.default_local_dir=" + run, "trainer.total_training_steps=3",
                           "trainer.max_actor_ckpt_to_keep=2"});
  ASSERT_EQ(to_3.exit_code, 0) << to_3.output;
  EXPECT_TRUE(fs::exists(root + "/global_step_2"));
  EXPECT_TRUE(fs::exists(root + "/global_step_3"));
  EXPECT_FALSE(fs::exists(root + "/global_step_4"));
  for (const char* step : {"2", "3"}) {
    auto inspect = run_process({bin("shardrl"), "inspect", root + "/global_step_" + step});
    EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  }
  auto to_6 = train(path, {"trainer.default_local_dir=" + run, "trainer.total_training_steps=6"});
  ASSERT_EQ(to_6.exit_code, 0) << to_6.output;
  EXPECT_NE(to_6.output.find("resumed from " + root + "/global_step_3 at step 3"),
            std::string::npos)
      << to_6.output;
  expect_same_metrics(run + "/metrics.jsonl", dir + "/straight/metrics.jsonl", 6, {"step", "loss"});
}

// The disk fills during a save: the run stops on both ranks with an error naming the file it could
// not write and why, `latest` still names the last whole checkpoint, the partial files are gone
// (a full disk is not left full), and once there is room the run resumes from that checkpoint to
// the bits of a run that never failed. The disk is a 1 MiB tmpfs in a mount namespace of its own:
// global_step_2 (600 KB) fits, global_step_4 beside it does not.
TEST(Trainer, FullDiskDuringASaveKeepsTheLastCheckpointAndResumes) {
  if (geteuid() != 0) {
    if (running_in_ci()) GTEST_FAIL() << "needs root to mount a tmpfs (CI=true)";
    GTEST_SKIP() << "needs root to mount a tmpfs";
  }
  SHARDRL_REQUIRE_DEPENDENCY(missing_program("unshare", "util-linux"));
  const auto dir = make_temp_dir("trainer_full_disk");
  const auto path = write_file(dir, "lm.yaml", kSmallLmConfig);
  auto straight = train(path, {"trainer.default_local_dir=" + dir + "/straight"});
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string disk = dir + "/disk", out = dir + "/out";
  fs::create_directories(disk);
  fs::create_directories(out);
  // $1 the disk, $2 shardrl, $3 the config, $4 where the results go (outside the disk).
  const char* script = R"(set -u
mount -t tmpfs -o size=1m tmpfs "$1" || exit 90
"$2" train "$3" trainer.default_local_dir="$1/run" > "$4/full.log" 2>&1
echo $? > "$4/full.rc"
ls -A "$1/run/checkpoints" > "$4/listing"
cp "$1/run/checkpoints/latest" "$4/latest"
mount -o remount,size=8m "$1" || exit 91
"$2" train "$3" trainer.default_local_dir="$1/run" > "$4/room.log" 2>&1
echo $? > "$4/room.rc"
cp "$1/run/metrics.jsonl" "$4/metrics.jsonl"
)";
  auto ns = run_process({"unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                         disk, bin("shardrl"), path, out},
                        {}, 300);
  ASSERT_EQ(ns.exit_code, 0) << ns.output;
  const std::string full = slurp(out + "/full.log");
  EXPECT_NE(slurp(out + "/full.rc"), "0\n") << full;
  for (const std::string& expected : {"cannot write " + disk + "/run/checkpoints/.tmp-step-4/",
                                      std::string("No space left on device")}) {
    EXPECT_NE(full.find(expected), std::string::npos) << expected << "\n" << full;
  }
  EXPECT_EQ(slurp(out + "/listing"), "global_step_2\nlatest\n") << full;
  EXPECT_EQ(slurp(out + "/latest"), "global_step_2\n");
  const std::string room = slurp(out + "/room.log");
  ASSERT_EQ(slurp(out + "/room.rc"), "0\n") << room;
  EXPECT_NE(room.find("resumed from " + disk + "/run/checkpoints/global_step_2 at step 2"),
            std::string::npos)
      << room;
  expect_same_metrics(out + "/metrics.jsonl", dir + "/straight/metrics.jsonl", 4, {"step", "loss"});
}

// GRPO for the decoder on single-digit addition, from a supervised stage that gets about half the
// answers right: the exact-match reward rises.
TEST(Trainer, LmGrpoRaisesTheArithmeticReward) {
  const auto dir = make_temp_dir("trainer_grpo");
  std::vector<std::string> argv = {
      bin("shardrl"),
      "train",
      std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
      "trainer.default_local_dir=" + dir,
      "trainer.total_training_steps=40",
      "trainer.save_freq=-1"};
  auto result = run_process(argv, {}, 300);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto metrics = read_jsonl(dir + "/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 40u);
  for (const char* key : {"reward_mean", "reward_std", "loss", "grad_norm", "lr", "kl", "clipfrac",
                          "ppo_kl", "response_length", "time_rollout"}) {
    EXPECT_TRUE(metrics[0].contains(key)) << key << " missing in " << metrics[0].dump();
  }
  auto mean_reward = [&](size_t from, size_t to) {
    double sum = 0;
    for (size_t i = from; i < to; ++i) sum += metrics[i]["reward_mean"].get<double>();
    return sum / static_cast<double>(to - from);
  };
  EXPECT_GT(mean_reward(30, 40), mean_reward(0, 10) + 0.08);
}

// verl's other estimators, a GSPO loss and DAPO (dynamic sampling, the overlong penalty,
// clip-higher, the entropy bonus) through `shardrl train` on the arithmetic job: each run logs
// the algorithm's metrics, keeps its loss finite and raises the reward.
TEST(Trainer, LmGrpoTrainsWithVerlsEstimatorsLossesAndDapo) {
  const auto dir = make_temp_dir("trainer_lm_algos");
  struct Case {
    std::string name;
    std::vector<std::string> overrides;
    std::vector<std::string> metrics;
  };
  const std::vector<Case> cases = {
      {"rloo", {"algorithm.adv_estimator=rloo"}, {}},
      {"reinforce_plus_plus", {"algorithm.adv_estimator=reinforce_plus_plus"}, {}},
      {"remax", {"algorithm.adv_estimator=remax"}, {}},
      {"gspo", {"actor_rollout_ref.actor.policy_loss.loss_mode=gspo"}, {}},
      {"dapo",
       {"algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2",
        "reward_model.overlong_buffer.penalty_factor=0.5",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.entropy_coeff=0.001"},
       {"train/num_gen_batches", "actor/entropy_loss"}},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {
        bin("shardrl"),
        "train",
        std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
        "trainer.default_local_dir=" + dir + "/" + c.name,
        "sft.cache_dir=" + dir + "/cache",
        "trainer.total_training_steps=30",
        "trainer.save_freq=-1"};
    argv.insert(argv.end(), c.overrides.begin(), c.overrides.end());
    auto result = run_process(argv, {}, 300);
    ASSERT_EQ(result.exit_code, 0) << c.name << "\n" << result.output;
    auto metrics = read_jsonl(dir + "/" + c.name + "/metrics.jsonl");
    ASSERT_EQ(metrics.size(), 30u) << c.name;
    std::vector<std::string> keys = {"reward_mean",       "pg_loss",       "clipfrac",
                                     "pg_clipfrac_lower", "actor/entropy", "grad_norm"};
    keys.insert(keys.end(), c.metrics.begin(), c.metrics.end());
    for (const auto& key : keys) {
      ASSERT_TRUE(metrics[0].contains(key))
          << c.name << ": " << key << " missing in " << metrics[0].dump();
    }
    for (size_t i = 0; i < 30; ++i) {
      EXPECT_TRUE(std::isfinite(metrics[i]["loss"].get<double>())) << c.name << " step " << i;
      EXPECT_GT(metrics[i]["actor/entropy"].get<double>(), 0) << c.name << " step " << i;
    }
    const auto mean_reward = [&](size_t from, size_t to) {
      double sum = 0;
      for (size_t i = from; i < to; ++i) sum += metrics[i]["reward_mean"].get<double>();
      return sum / static_cast<double>(to - from);
    };
    EXPECT_GT(mean_reward(20, 30), mean_reward(0, 10) + 0.05) << c.name << ": no rise";
    if (c.name == "dapo") {
      double drawn = 0;
      for (const auto& m : metrics) drawn += m["train/num_gen_batches"].get<double>();
      // Some steps met groups that all scored alike and drew again.
      EXPECT_GT(drawn, 30.0) << c.name;
      // The rollout's recorded entropy is the entropy the update's logits give its policy before
      // the step (per micro-batch there, over the rank's batch in the rollout).
      const double recorded = metrics[0]["actor/entropy"].get<double>();
      EXPECT_NEAR(metrics[0]["actor/entropy_loss"].get<double>(), recorded, 0.02 * recorded);
    }
  }
}

// Pre-empted mid-run (SIGTERM to `shardrl train`, which stops its ranks), then started again with
// trainer.resume_mode=auto: the run continues from its last checkpoint and every step, the ones it
// redoes included, logs what an uninterrupted run logs.
// With `watch`, each run also logs to TensorBoard (TENSORBOARD_DIR <run>/tb), dumps its rollouts
// (trainer.rollout_data_dir <run>/rollouts) and validates on 8 held-out problems every 10 steps,
// 3 of its generations going to TensorBoard. The runs go to `dir`.
// The steps of the global_step_N folders under `root`, in order.
std::vector<int64_t> count_steps(const std::string& root) {
  std::vector<int64_t> steps;
  const std::regex name(R"(global_step_(\d+))");
  for (const auto& entry : fs::directory_iterator(root)) {
    std::smatch m;
    const auto file = entry.path().filename().string();
    if (std::regex_match(file, m, name)) steps.push_back(std::stoll(m[1]));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// `keys`: the metrics compared, each step, beside step, reward_mean and loss.
void expect_lm_grpo_resumes_after_a_kill(const std::string& dir,
                                         const std::vector<std::string>& overrides,
                                         bool watch = false,
                                         const std::vector<std::string>& keys = {}) {
  auto argv = [&](const std::string& run) {
    std::vector<std::string> a;
    if (watch) a = {"env", "TENSORBOARD_DIR=" + dir + "/" + run + "/tb"};
    for (const std::string& arg :
         {bin("shardrl"), std::string("train"),
          std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
          "trainer.default_local_dir=" + dir + "/" + run, "sft.cache_dir=" + dir + "/cache",
          std::string("trainer.total_training_steps=24"), std::string("trainer.save_freq=5")}) {
      a.push_back(arg);
    }
    if (watch) {
      for (const std::string& arg :
           {std::string("trainer.logger=[console, file, tensorboard]"),
            "trainer.rollout_data_dir=" + dir + "/" + run + "/rollouts",
            std::string("data.val_size=8"), std::string("trainer.test_freq=10"),
            std::string("trainer.log_val_generations=3")}) {
        a.push_back(arg);
      }
    }
    a.insert(a.end(), overrides.begin(), overrides.end());
    return a;
  };
  auto straight = run_process(argv("straight"), {}, 300);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  const std::string metrics = dir + "/killed/metrics.jsonl";
  auto killed = run_process_until(
      argv("killed"), [&] { return fs::exists(metrics) && read_jsonl(metrics).size() >= 12; },
      SIGTERM);
  ASSERT_TRUE(killed.stopped) << killed.output;
  ASSERT_NE(killed.exit_code, 0) << killed.output;
  ASSERT_LT(read_jsonl(metrics).size(), 24u) << "the run finished before the kill";

  auto resumed = run_process(argv("killed"), {}, 300);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  // Validation before training is line 0.
  std::vector<std::string> compared = {"step", "reward_mean", "loss"};
  compared.insert(compared.end(), keys.begin(), keys.end());
  expect_same_metrics(metrics, dir + "/straight/metrics.jsonl", watch ? 25 : 24, compared);
}

TEST(Trainer, LmGrpoResumesAfterAKillBitwise) {
  expect_lm_grpo_resumes_after_a_kill(make_temp_dir("trainer_grpo_kill"), {});
}

// A run watched as a verl user watches one, killed and resumed: TensorBoard's reader finds each
// step once with the values of metrics.jsonl (the steps the killed run logged after its last
// checkpoint are forgotten, their redone values kept), the validation generations as text at the
// steps validated, and the killed run's event file cut inside any record still reads up to the
// last whole one. Each step's rollouts are dumped as verl dumps them.
TEST(Trainer, LmGrpoWatchedInTensorBoardThroughAKill) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_tensorboard_reader());
  const auto dir = make_temp_dir("trainer_grpo_watched");
  expect_lm_grpo_resumes_after_a_kill(dir, {}, /*watch=*/true);
  if (HasFatalFailure()) return;
  const auto files = event_files(dir + "/killed/tb");
  ASSERT_EQ(files.size(), 2u) << "the killed run's file and the resumed run's";
  const json expect = {{"texts", {{"val/generations", {0, 10, 20, 24}}}},
                       {"text_contains",
                        {"**Generation Results - Step", "### Sample 3", "**Input:** ",
                         "**Output:** ", "**Score:** "}}};
  for (const std::string run : {"killed", "straight"}) {
    SCOPED_TRACE(run);
    expect_checks_pass(read_tensorboard({"run", dir + "/" + run + "/tb",
                                         dir + "/" + run + "/metrics.jsonl", expect.dump()}),
                       30);
    // 16 prompts x 8 answers a step.
    expect_checks_pass(
        read_tensorboard({"rollouts", dir + "/" + run + "/rollouts",
                          dir + "/" + run + "/metrics.jsonl", json({{"samples", 128}}).dump()}),
        25);
  }
  expect_checks_pass(read_tensorboard({"truncated", files[0]}), 20);
  // Three generations, not more.
  std::ifstream first(files[0], std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(first)),
                          std::istreambuf_iterator<char>());
  EXPECT_NE(bytes.find("### Sample 3"), std::string::npos);
  EXPECT_EQ(bytes.find("### Sample 4"), std::string::npos);
  // The answers the dump holds are the prompts' of the task, scored against the right sums.
  const auto samples = read_jsonl(dir + "/straight/rollouts/1.jsonl");
  ASSERT_EQ(samples.size(), 128u);
  for (const auto& sample : samples) {
    const std::string input = sample["input"];
    ASSERT_EQ(input.size(), 4u) << sample.dump();  // "3+4="
    EXPECT_EQ(sample["gts"], std::to_string((input[0] - '0') + (input[2] - '0'))) << sample.dump();
  }
}

// The same with LoRA+ (optim.loraplus_lr_ratio): a GroupedOptimizer, whose two AdamWs' state goes
// through the sharded checkpoint.
TEST(Trainer, LmGrpoWithAGroupedOptimizerResumesAfterAKillBitwise) {
  expect_lm_grpo_resumes_after_a_kill(
      make_temp_dir("trainer_grpo_loraplus_kill"),
      {"actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.optim.lr=1e-3",
       "actor_rollout_ref.actor.optim.loraplus_lr_ratio=8"});
}

// PPO with GAE: the critic (a second trainable engine, its own AdamW) is saved beside the actor
// at every checkpoint and resumed with it, so the resumed run's value losses, critic grad norms
// and actor losses equal the uninterrupted run's bit for bit, the steps of the critic's warmup
// included. trainer.max_critic_ckpt_to_keep rotates the critic's checkpoints once the actor's
// step is saved.
TEST(Trainer, LmPpoWithACriticResumesAfterAKillBitwise) {
  const auto dir = make_temp_dir("trainer_ppo_kill");
  expect_lm_grpo_resumes_after_a_kill(
      dir,
      {"algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-3",
       "trainer.critic_warmup=3", "trainer.max_critic_ckpt_to_keep=1"},
      /*watch=*/false, {"critic/vf_loss", "critic/grad_norm", "critic/values/mean", "grad_norm"});
  if (HasFatalFailure()) return;
  for (const std::string run : {"straight", "killed"}) {
    // Saved at 5, 10, 15, 20 and 24: the actor keeps 2 (the default), the critic 1.
    EXPECT_EQ(count_steps(dir + "/" + run + "/checkpoints"), (std::vector<int64_t>{20, 24}));
    EXPECT_EQ(count_steps(dir + "/" + run + "/checkpoints/critic"), (std::vector<int64_t>{24}));
  }
  const auto metrics = read_jsonl(dir + "/straight/metrics.jsonl");
  // Before trainer.critic_warmup (step 3) the actor does not train.
  EXPECT_FALSE(metrics[0].contains("pg_loss")) << metrics[0].dump();
  EXPECT_FALSE(metrics[1].contains("pg_loss")) << metrics[1].dump();
  EXPECT_TRUE(metrics[2].contains("pg_loss")) << metrics[2].dump();
  for (const auto& m : metrics) EXPECT_TRUE(m.contains("critic/vf_clipfrac")) << m.dump();

  // The actor's step without its critic's: the resume stops naming the critic's folder rather
  // than train the actor against a new critic.
  const auto lost = dir + "/killed/checkpoints/critic/global_step_24";
  fs::remove_all(lost);
  auto resumed = run_process(
      {bin("shardrl"), "train",
       std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
       "trainer.default_local_dir=" + dir + "/killed", "sft.cache_dir=" + dir + "/cache",
       "trainer.total_training_steps=26", "algorithm.adv_estimator=gae"},
      {}, 300);
  EXPECT_NE(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("the critic's checkpoint of step 24, " + lost), std::string::npos)
      << resumed.output;
}

// With FSDP2's offload policy to the file tier (params, grads and AdamW state out of memory during
// the update too), the checkpoint saves and loads unit by unit, each unit in memory only while it
// is written or read; the resumed run still equals the straight one.
TEST(Trainer, LmGrpoWithItsStateInFilesResumesAfterAKillBitwise) {
  const std::string f = "actor_rollout_ref.actor.fsdp_config.";
  expect_lm_grpo_resumes_after_a_kill(
      make_temp_dir("trainer_grpo_offload_kill"),
      {f + "param_offload=true", f + "optimizer_offload=true", f + "offload_policy=true"});
}

// With LoRA the rollout replica gets the frozen base once and then the adapter alone each step. At
// a large lr the adapter moves far in each step, so a replica that missed an update would sample
// from another policy; one that keeps up matches the actor to fp32 rounding at every step.
TEST(Trainer, LmGrpoLoraRolloutReplicaKeepsUpWithTheActor) {
  const auto dir = make_temp_dir("trainer_grpo_lora_sync");
  auto result =
      run_process({bin("shardrl"), "train",
                   std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
                   "trainer.default_local_dir=" + dir + "/run", "sft.cache_dir=" + dir + "/cache",
                   "trainer.total_training_steps=4", "actor_rollout_ref.model.lora_rank=8",
                   "actor_rollout_ref.actor.optim.lr=0.02"},
                  {}, 300);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto metrics = read_jsonl(dir + "/run/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  for (const auto& line : metrics) {
    EXPECT_GT(line["grad_norm"].get<double>(), 0.0) << line.dump();
    EXPECT_LT(line["rollout_probs_diff_mean"].get<double>(), 1e-6) << line.dump();
  }
}

// LoRA+ needs adapters, and a positive ratio: errors name the key.
TEST(Trainer, LoraPlusErrorsNameTheKey) {
  const std::string config =
      std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml");
  const auto dir = make_temp_dir("trainer_loraplus_bad");
  for (const auto& [overrides, expected] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"actor_rollout_ref.actor.optim.loraplus_lr_ratio=4"}, "lora_rank is 0"},
           {{"actor_rollout_ref.model.lora_rank=8",
             "actor_rollout_ref.actor.optim.loraplus_lr_ratio=0"},
            "must be a number > 0"},
           {{"actor_rollout_ref.model.lora_rank=8",
             "actor_rollout_ref.actor.optim.loraplus_lr_ratio=fast"},
            "must be a number > 0, or null (no LoRA+), got \"fast\""}}) {
    std::vector<std::string> argv = {bin("shardrl"), "train", config,
                                     "trainer.default_local_dir=" + dir, "sft.cache_dir=" + dir};
    argv.insert(argv.end(), overrides.begin(), overrides.end());
    const auto result = run_process(argv, {}, 300);
    EXPECT_NE(result.exit_code, 0) << result.output;
    EXPECT_NE(result.output.find("'actor_rollout_ref.actor.optim.loraplus_lr_ratio'"),
              std::string::npos)
        << result.output;
    EXPECT_NE(result.output.find(expected), std::string::npos) << result.output;
  }
}

// The pretrained-chat-model path of lm_grpo (examples/configs/smollm2_grpo.yaml), on a tiny random
// decoder with SmolLM2's real tokenizer and chat template (from `shardrl import` of its GGUF):
// prompts through the chat template, left-padded; held-out validation before, during and after;
// metrics.jsonl, summary.json and reward_curve.png. The real model's run is `make smollm2`.
TEST(Trainer, LmGrpoRunsOnAPretrainedChatModelDirectory) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_smollm2_gguf());
  const auto dir = make_temp_dir("trainer_chat_grpo");
  // The import shows its progress (here at every tensor: SHARDRL_PROGRESS_SECONDS=0).
  auto imported = run_process({bin("shardrl"), "import", smollm2_gguf(), dir + "/imported"},
                              {{"SHARDRL_PROGRESS_SECONDS", "0"}});
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  EXPECT_TRUE(std::regex_search(
      imported.output,
      std::regex(R"(writing \S+imported\S*: [0-9.]+ MB/[0-9.]+ MB \([0-9]+%\), )")))
      << imported.output;
  EXPECT_TRUE(std::regex_search(
      imported.output, std::regex(R"(writing \S+imported\S*: ([0-9.]+ MB)/\1 in [0-9.]+m?s \()")))
      << imported.output;
  const std::string model = dir + "/tiny";
  models::LlamaConfig c = llama_test_config();
  c.vocab_size = 49152;  // SmolLM2's tokenizer
  c.max_position_embeddings = 256;
  c.tie_word_embeddings = true;
  torch::manual_seed(0);
  models::LlamaForCausalLM tiny(c);
  models::save_llama(models::state_dict(*tiny), c, model);
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    fs::copy_file(dir + "/imported/" + file, model + "/" + file);
  }
  auto argv = [&](const std::string& run, const std::vector<std::string>& extra) {
    std::vector<std::string> a = {
        bin("shardrl"),
        "train",
        std::string(SHARDRL_SOURCE_DIR "/examples/configs/smollm2_grpo.yaml"),
        "trainer.default_local_dir=" + dir + "/" + run,
        "actor_rollout_ref.model.path=" + model,
        "trainer.save_freq=1",
        "trainer.test_freq=1",
        "data.train_batch_size=2",
        "data.val_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.model.lora_rank=4"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  // In two parts, as the real job may be run: the second resumes from the first's checkpoint,
  // and the summary still spans both (validation before training is step 0 of metrics.jsonl).
  // The model's weights load with progress (at every tensor: SHARDRL_PROGRESS_SECONDS=0).
  auto first = run_process(argv("run", {"trainer.total_training_steps=1"}),
                           {{"SHARDRL_PROGRESS_SECONDS", "0"}}, 300);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("[rank 0] loading " + model + ": "), std::string::npos)
      << first.output;
  EXPECT_EQ(first.output.find("[rank 1] loading " + model + ": "), std::string::npos)
      << first.output;
  EXPECT_NE(first.output.find("before RL: greedy accuracy on 4 held-out problems"),
            std::string::npos)
      << first.output;
  auto result = run_process(argv("run", {"trainer.total_training_steps=2"}), {}, 300);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("resumed from"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("before RL"), std::string::npos) << result.output;
  const auto metrics = read_jsonl(dir + "/run/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 3u);
  EXPECT_EQ(metrics[0].dump(),
            json({{"step", 0}, {"val/accuracy", metrics[0]["val/accuracy"]}}).dump());
  for (size_t k = 1; k < metrics.size(); ++k) {
    const auto& line = metrics[k];
    EXPECT_EQ(line["step"], k);
    for (const char* key :
         {"reward_mean", "val/accuracy", "perf/rollout_tokens_per_s", "time_rollout",
          "time_weight_sync", "time_update", "response_length", "grad_norm"}) {
      EXPECT_TRUE(line.contains(key)) << key << " missing in " << line.dump();
    }
    EXPECT_LE(line["response_length"].get<double>(), 6.0);
  }
  std::ifstream summary_file(dir + "/run/summary.json");
  const auto summary = json::parse(summary_file);
  EXPECT_EQ(summary.value("eval_accuracy_before", -1.0), metrics[0]["val/accuracy"])
      << summary.dump();
  EXPECT_EQ(summary.value("eval_accuracy_after", -1.0), metrics[2]["val/accuracy"])
      << summary.dump();
  EXPECT_TRUE(fs::exists(dir + "/run/reward_curve.png"));

  // rollout.dtype float16: the rollout replica's weights packed in fp16. The old log-probs are
  // then the actor's own (ppo_kl exactly 0: the step is on-policy), and the rollout's differ from
  // them by more than an fp32 rollout's do, yet little. (At temperature 5: this random model's
  // logits are so peaked that its probabilities are 1 at the usual temperatures.)
  auto one_step = [&](const std::string& run, const std::string& dtype) {
    auto r = run_process(
        argv(run, {"trainer.total_training_steps=1", "actor_rollout_ref.rollout.temperature=5.0",
                   "actor_rollout_ref.rollout.dtype=" + dtype}),
        {}, 300);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const auto lines = read_jsonl(dir + "/" + run + "/metrics.jsonl");
    return lines.size() == 2 ? lines[1] : json::object();
  };
  const auto fp32_step = one_step("fp32", "float32");
  const auto fp16_step = one_step("fp16", "float16");
  ASSERT_TRUE(fp16_step.contains("ppo_kl") && fp32_step.contains("ppo_kl"));
  EXPECT_EQ(fp16_step["ppo_kl"].get<double>(), 0.0) << fp16_step.dump();
  const double fp32_diff = fp32_step["rollout_probs_diff_mean"].get<double>();
  const double fp16_diff = fp16_step["rollout_probs_diff_mean"].get<double>();
  EXPECT_GT(fp16_diff, 10 * fp32_diff) << fp16_diff << " vs fp32's " << fp32_diff;
  EXPECT_GT(fp16_diff, 0.0);
  EXPECT_LT(fp16_diff, 1e-2);
  auto bad_dtype = run_process(argv("bad_dtype", {"trainer.total_training_steps=1",
                                                  "actor_rollout_ref.rollout.dtype=bfloat16"}),
                               {}, 300);
  EXPECT_NE(bad_dtype.exit_code, 0);
  EXPECT_NE(bad_dtype.output.find("actor_rollout_ref.rollout.dtype"), std::string::npos)
      << bad_dtype.output;

  auto too_long = run_process(
      argv("bad", {"trainer.total_training_steps=1", "actor_rollout_ref.rollout.prompt_length=5"}),
      {}, 300);
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.output.find("actor_rollout_ref.rollout.prompt_length"), std::string::npos)
      << too_long.output;
}

}  // namespace
}  // namespace shardrl::testing
