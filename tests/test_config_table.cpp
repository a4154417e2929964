// The config table: `shardrl train` checks every key against it before any rank starts.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "../src/trainer/config_table.h"
#include "../src/trainer/tasks.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

ProcessResult shardrl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {bin("shardrl")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, 300);
}

// A bad value stops `shardrl train` before any rank starts: nothing ran, nothing was written.
void expect_stopped_before_any_rank(const ProcessResult& result, const std::string& run_dir,
                                    const std::vector<std::string>& expected) {
  EXPECT_NE(result.exit_code, 0) << result.output;
  for (const auto& words : expected) {
    EXPECT_NE(result.output.find(words), std::string::npos) << words << "\n" << result.output;
  }
  EXPECT_EQ(result.output.find("rank(s)"), std::string::npos) << result.output;
  EXPECT_FALSE(fs::exists(run_dir)) << run_dir;
  EXPECT_LT(result.seconds, 30) << result.output;
}

struct BadValue {
  std::string kind, config;  // an example config
  std::vector<std::string> overrides;
  std::vector<std::string> expected;  // each in the error
};

void PrintTo(const BadValue& bad, std::ostream* os) {
  *os << bad.kind;
}

// Each kind of check the table makes, as an override: the error names the key, what it takes,
// what it got and the override it came from.
const std::vector<BadValue>& bad_values() {
  static const std::vector<BadValue> all = {
      {"IntegerBelowItsRange",
       "arithmetic_grpo.yaml",
       {"actor_rollout_ref.rollout.n=0"},
       {"override 'actor_rollout_ref.rollout.n=0': config key 'actor_rollout_ref.rollout.n' must "
        "be an integer >= 1, got 0"}},
      {"NumberOutsideItsInterval",
       "arithmetic_grpo.yaml",
       {"actor_rollout_ref.rollout.top_p=1.5"},
       {"config key 'actor_rollout_ref.rollout.top_p' must be a number in (0, 1], got 1.5"}},
      {"NumberWhereAnIntegerGoes",
       "lm_pretrain.yaml",
       {"trainer.total_training_steps=2.5"},
       {"override 'trainer.total_training_steps=2.5'", "'trainer.total_training_steps'"}},
      {"WrongTypeForANullDefault",
       "arithmetic_grpo.yaml",
       {"actor_rollout_ref.actor.clip_ratio_low=wide"},
       {"config key 'actor_rollout_ref.actor.clip_ratio_low' must be a number >= 0, or null "
        "(clip_ratio), got \"wide\""}},
      {"UnknownChoice",
       "arithmetic_grpo.yaml",
       {"actor_rollout_ref.actor.loss_agg_mode=mean"},
       {"config key 'actor_rollout_ref.actor.loss_agg_mode' must be one of token-mean, token-sum, "
        "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm, got \"mean\""}},
      {"UnknownDiffusionChoice",
       "fmnist_nft.yaml",
       {"actor_rollout_ref.rollout.algo.sde_type=ode"},
       {"config key 'actor_rollout_ref.rollout.algo.sde_type' must be one of sde, cps, "
        "dance_sde, got \"ode\""}},
      {"TextNotMatchingItsPattern",
       "arithmetic_grpo.yaml",
       {"data.operators=/"},
       {"config key 'data.operators' must be a string of +, - and * (at least one), got \"/\""}},
      {"ListOfTheWrongSize",
       "lm_pretrain.yaml",
       {"actor_rollout_ref.actor.optim.betas=[0.9]"},
       {"config key 'actor_rollout_ref.actor.optim.betas' must be a list of 2, each a number in "
        "[0, 1), got [0.9]"}},
      {"MissingFolder",
       "smollm2_grpo.yaml",
       {"actor_rollout_ref.model.path=/nonexistent"},
       {"override 'actor_rollout_ref.model.path=/nonexistent': config key "
        "'actor_rollout_ref.model.path': '/nonexistent' does not exist"}},
      {"FolderWithoutItsFile",
       "smollm2_grpo.yaml",
       {"actor_rollout_ref.model.path=/usr/share"},
       {"config key 'actor_rollout_ref.model.path': '/usr/share' holds no config.json"}},
      {"RequiredPathLeftEmpty",
       "fmnist_flow_grpo.yaml",
       {},
       {"config key 'actor_rollout_ref.model.text_encoder_path' is empty: it must name a folder "
        "holding modules.json (the prompt encoder, a sentence-transformers folder"}},
      {"KeysBetweenThem",
       "lm_pretrain.yaml",
       {"trainer.resume_mode=resume_path"},
       {"config key 'trainer.resume_from_path' must name a checkpoint directory when "
        "trainer.resume_mode is resume_path"}},
      {"EveryBadKeyAtOnce",
       "arithmetic_grpo.yaml",
       {"actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.temperature=0"},
       {"2 config keys are wrong:\n  override 'actor_rollout_ref.rollout.n=0': config key "
        "'actor_rollout_ref.rollout.n' must be",
        "\n  override 'actor_rollout_ref.rollout.temperature=0': config key "
        "'actor_rollout_ref.rollout.temperature' must be a number > 0, got 0"}},
  };
  return all;
}

class BadConfigValue : public ::testing::TestWithParam<BadValue> {};

TEST_P(BadConfigValue, StopsTrainBeforeAnyRankNamingTheKey) {
  const auto& bad = GetParam();
  const auto dir = make_temp_dir("config_bad_value");
  std::vector<std::string> args = {
      "train", std::string(SHARDRL_SOURCE_DIR "/examples/configs/") + bad.config,
      "trainer.default_local_dir=" + dir + "/run", "sft.cache_dir=" + dir + "/cache"};
  if (bad.config.rfind("fmnist", 0) == 0) args.back() = "pretrain.cache_dir=" + dir + "/cache";
  if (bad.config == "lm_pretrain.yaml") args.pop_back();
  args.insert(args.end(), bad.overrides.begin(), bad.overrides.end());
  expect_stopped_before_any_rank(shardrl(args), dir + "/run", bad.expected);
}

INSTANTIATE_TEST_SUITE_P(EveryKind, BadConfigValue, ::testing::ValuesIn(bad_values()),
                         [](const ::testing::TestParamInfo<BadValue>& info) {
                           return info.param.kind;
                         });

// In a file, the error names the file.
TEST(BadConfigValue, InAFileNamesTheFile) {
  const auto dir = make_temp_dir("config_bad_value_file");
  const auto path =
      write_file(dir + "/grpo.yaml", "trainer:\n  task: lm_grpo\n  default_local_dir: " + dir +
                                         "/run\nactor_rollout_ref:\n  rollout:\n    n: 0\n");
  expect_stopped_before_any_rank(
      shardrl({"train", path}), dir + "/run",
      {path + ": config key 'actor_rollout_ref.rollout.n' must be an integer >= 1, got 0"});
}

// A task registered through the public API brings its own rows and defaults for the shared ones,
// and its config is checked as a built-in task's is. A table that contradicts itself is a mistake
// in the code, named when the table is built.
TEST(ConfigTable, ARegisteredTaskBringsItsOwnRows) {
  trainer::Task toy;
  toy.description = "a toy";
  toy.keys = {{"toy.depth", 3, trainer::integer().at_least(1), "the toy's layers"}};
  toy.defaults = {{"trainer.total_training_steps", 7}};
  toy.run = [](const json&, std::shared_ptr<dist::World>) { return 0; };
  trainer::register_task("toy", toy);
  const json defaults = trainer::task_table("toy").defaults();
  EXPECT_EQ(defaults["toy"]["depth"], 3);
  EXPECT_EQ(defaults["trainer"]["total_training_steps"], 7);
  EXPECT_EQ(defaults["trainer"]["task"], "toy");
  EXPECT_EQ(defaults["actor_rollout_ref"]["actor"]["optim"]["lr"], 1e-4);
  const auto dir = make_temp_dir("config_toy");
  const auto path = write_file(dir + "/toy.yaml", "trainer:\n  task: toy\ntoy:\n  depth: 0\n");
  expect_invalid_argument_naming([&] { trainer::task_config(path, {}); },
                                 path + ": config key 'toy.depth'",
                                 "must be an integer >= 1, got 0");
  EXPECT_EQ(trainer::get<int64_t>(trainer::task_config(path, {"toy.depth=5"}), "toy.depth"), 5);

  const auto mistake = [](const std::string& name, const trainer::Task& task,
                          const std::string& expected) {
    trainer::register_task(name, task);
    try {
      trainer::task_table(name);
      ADD_FAILURE() << name << ": no error";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  auto typo = toy;
  typo.defaults = {{"trainer.total_trainig_steps", 7}};
  mistake("toy_typo", typo,
          "task toy_typo: config key 'trainer.total_trainig_steps' has a default but no row");
  auto refused = toy;
  refused.keys = {{"toy.depth", 0, trainer::integer().at_least(1), "the toy's layers"}};
  mistake("toy_refused", refused,
          "task toy_refused: config key 'toy.depth' refuses its own default");
  auto nested = toy;
  nested.keys.push_back({"toy.depth.more", 1, trainer::integer(), "below a value"});
  mistake("toy_nested", nested, "config key 'toy.depth.more' lies below the key 'toy.depth'");
}

// `shardrl config TASK` prints a config `shardrl train` reads back as the task's defaults: every
// key of the table, in YAML, with its description.
TEST(ConfigReference, EveryTaskPrintsItsDefaultsAsAConfig) {
  const auto dir = make_temp_dir("config_reference");
  const auto list = shardrl({"config", "--list"});
  ASSERT_EQ(list.exit_code, 0) << list.output;
  int tasks = 0;
  for (const char* task : {"diffusion_rl", "lm_grpo", "lm_pretrain"}) {
    EXPECT_NE(list.output.find(std::string(task) + ": "), std::string::npos) << list.output;
    const auto printed = shardrl({"config", task});
    ASSERT_EQ(printed.exit_code, 0) << printed.output;
    const auto path = write_file(dir + "/" + task + ".yaml", printed.output);
    const auto table = trainer::task_table(task);
    EXPECT_EQ(trainer::task_config(path, {}, trainer::ConfigChecks::kValues), table.defaults())
        << task;
    for (const auto& row : table.rows()) {
      EXPECT_NE(printed.output.find("# " + row.description + " [" + row.values.describe() + "]"),
                std::string::npos)
          << row.key;
    }
    ++tasks;
  }
  EXPECT_EQ(tasks, 3);
  const auto unknown = shardrl({"config", "painting"});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.output.find("known tasks: diffusion_rl, lm_grpo, lm_pretrain"),
            std::string::npos)
      << unknown.output;
}

// docs/config.md is what the code generates: `make docs` after changing a table.
TEST(ConfigReference, DocsAreCurrent) {
  const auto generated = shardrl({"config", "--markdown"});
  ASSERT_EQ(generated.exit_code, 0) << generated.output;
  std::ifstream in(SHARDRL_SOURCE_DIR "/docs/config.md");
  std::stringstream committed;
  committed << in.rdbuf();
  EXPECT_TRUE(committed.str() == generated.output)
      << "docs/config.md differs from `shardrl config --markdown`: run `make docs`";
  for (const char* key : {"actor_rollout_ref.rollout.n", "trainer.logger", "data.data_dir"}) {
    EXPECT_NE(committed.str().find(std::string("| `") + key + "` |"), std::string::npos) << key;
  }
}

// The resolved config goes to <default_local_dir>/config.yaml and the screen gets one line naming
// it and the keys that differ from the task's defaults; that file runs again as it is.
TEST(ConfigReference, RunConfigRunsAgain) {
  const auto dir = make_temp_dir("config_run_again");
  const auto path = write_file(dir + "/small.yaml", kSmallLmConfig);
  const auto first =
      run_process({bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/first",
                   "trainer.total_training_steps=2"},
                  {}, 300);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string written = dir + "/first/config.yaml";
  ASSERT_TRUE(fs::exists(written));
  EXPECT_NE(first.output.find("config " + written + ": trainer.default_local_dir=" + dir +
                              "/first, trainer.nproc_per_node=2, trainer.total_training_steps=2, "
                              "trainer.save_freq=2, data.train_batch_size=8"),
            std::string::npos)
      << first.output;
  // Not the whole config on the screen: its keys appear once, in that line.
  EXPECT_EQ(first.output.find("reshard_after_forward"), std::string::npos) << first.output;

  const auto again = run_process(
      {bin("shardrl"), "train", written, "trainer.default_local_dir=" + dir + "/again"}, {}, 300);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  const auto first_config = trainer::task_config(written, {}, trainer::ConfigChecks::kValues);
  auto again_config =
      trainer::task_config(dir + "/again/config.yaml", {}, trainer::ConfigChecks::kValues);
  EXPECT_EQ(again_config["trainer"]["default_local_dir"], dir + "/again");
  again_config["trainer"]["default_local_dir"] = dir + "/first";
  EXPECT_EQ(again_config, first_config);
  EXPECT_EQ(trainer::get<int64_t>(first_config, "trainer.total_training_steps"), 2);
  EXPECT_EQ(read_jsonl(dir + "/again/metrics.jsonl").size(), 2u);
}

}  // namespace
}  // namespace shardrl::testing
