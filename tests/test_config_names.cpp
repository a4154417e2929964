// verl-omni's config names: a key renamed to verl's or verl-omni's name stops `shardrl train`
// before any rank starts, with an error naming the old key, the new one and where the old one was
// written; and the repo's example configs load with the names the trainer reads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../src/trainer/tasks.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;

struct Renamed {
  const char* old_key;
  const char* new_key;
};

// Written out here from the list (not read from the trainer's table, which is what is
// under test).
const Renamed kRenamed[] = {
    {"algorithm.kl_beta", "actor_rollout_ref.actor.kl_loss_coef"},
    {"algorithm.clip_range", "actor_rollout_ref.actor.diffusion_loss.clip_ratio"},
    {"algorithm.nft_beta", "actor_rollout_ref.actor.diffusion_loss.mix_beta"},
    {"algorithm.dpo_beta", "actor_rollout_ref.actor.diffusion_loss.dpo_beta"},
    {"algorithm.name", "actor_rollout_ref.model.model_type"},
    {"actor_rollout_ref.rollout.num_steps",
     "actor_rollout_ref.rollout.pipeline.num_inference_steps"},
    {"actor_rollout_ref.rollout.noise_level", "actor_rollout_ref.rollout.algo.noise_level"},
    {"actor_rollout_ref.rollout.guidance_scale",
     "actor_rollout_ref.rollout.pipeline.true_cfg_scale"},
    {"actor_rollout_ref.rollout.shift", "actor_rollout_ref.rollout.pipeline.shift"},
    {"actor_rollout_ref.rollout.groups_per_gpu", "data.train_batch_size"},
    {"actor_rollout_ref.actor.ppo_mini_batches", "actor_rollout_ref.actor.ppo_mini_batch_size"},
    // ShardRL's own name before it took verl's.
    {"actor_rollout_ref.model.enable_activation_checkpointing",
     "actor_rollout_ref.model.enable_gradient_checkpointing"},
    // verl-omni's older flow_grpo names.
    {"train.clip_range", "actor_rollout_ref.actor.diffusion_loss.clip_ratio"},
    {"train.beta", "actor_rollout_ref.actor.kl_loss_coef"},
    {"sample.num_steps", "actor_rollout_ref.rollout.pipeline.num_inference_steps"},
    {"sample.guidance_scale", "actor_rollout_ref.rollout.pipeline.true_cfg_scale"},
};

// Names the test cases' parameters by the old key.
void PrintTo(const Renamed& row, std::ostream* os) {
  *os << row.old_key;
}

// A two-rank diffusion run: were the config accepted, the ranks would start and train the
// reward classifier first.
std::string config_file(const std::string& dir, const std::string& extra_yaml) {
  const auto path = dir + "/config.yaml";
  std::ofstream(path) << "trainer:\n  task: diffusion_rl\n  nproc_per_node: 2\n"
                      << "  default_local_dir: " << dir << "/run\n"
                      << "pretrain:\n  cache_dir: " << dir << "/cache\n"
                      << extra_yaml;
  return path;
}

// "a.b.c" with value v as block YAML: a:\n  b:\n    c: v
std::string nested_yaml(const std::string& dotted_key, const std::string& value) {
  std::string yaml, indent;
  size_t begin = 0;
  while (true) {
    const size_t dot = dotted_key.find('.', begin);
    yaml += indent + dotted_key.substr(begin, dot - begin) + ":";
    if (dot == std::string::npos) return yaml + " " + value + "\n";
    yaml += "\n";
    indent += "  ";
    begin = dot + 1;
  }
}

void expect_stopped_before_any_rank(const ProcessResult& result, const std::string& dir,
                                    const Renamed& row, const std::string& source) {
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("config key '" + std::string(row.old_key) + "' was renamed: use '" +
                               row.new_key + "'"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find(source), std::string::npos) << result.output;
  // No rank started: nothing logged the config or trained the classifier, nothing was written.
  EXPECT_EQ(result.output.find("rank(s)"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("classifier"), std::string::npos) << result.output;
  EXPECT_FALSE(fs::exists(dir + "/run"));
  EXPECT_FALSE(fs::exists(dir + "/cache"));
  EXPECT_LT(result.seconds, 30) << result.output;
}

class RenamedKey : public ::testing::TestWithParam<Renamed> {};

TEST_P(RenamedKey, InTheFileStopsTrainBeforeAnyRankNamingBothKeys) {
  const Renamed& row = GetParam();
  const auto dir = make_temp_dir("renamed_key_file");
  const auto path = config_file(dir, nested_yaml(row.old_key, "1"));
  const auto result = run_process({bin("shardrl"), "train", path}, {}, 60);
  expect_stopped_before_any_rank(result, dir, row, path + ": ");
}

TEST_P(RenamedKey, AsAnOverrideStopsTrainBeforeAnyRankNamingBothKeys) {
  const Renamed& row = GetParam();
  const auto dir = make_temp_dir("renamed_key_override");
  const auto path = config_file(dir, "");
  const std::string override_arg = std::string(row.old_key) + "=1";
  const auto result = run_process({bin("shardrl"), "train", path, override_arg}, {}, 60);
  expect_stopped_before_any_rank(result, dir, row, "override '" + override_arg + "': ");
}

INSTANTIATE_TEST_SUITE_P(EveryRename, RenamedKey, ::testing::ValuesIn(kRenamed),
                         [](const ::testing::TestParamInfo<Renamed>& info) {
                           std::string name = info.param.old_key;
                           for (char& c : name) {
                             if (c == '.') c = '_';
                           }
                           return name;
                         });

// Every example config loads as `shardrl train` reads it: no renamed key, no unknown one, every
// value one its key takes (the files and folders they name aside: the text encoder and SmolLM2
// are given on the command line).
TEST(ConfigNames, EveryExampleConfigLoads) {
  const fs::path dir = fs::path(SHARDRL_SOURCE_DIR) / "examples" / "configs";
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    ++checked;
    try {
      trainer::task_config(entry.path().string(), {}, trainer::ConfigChecks::kValues);
    } catch (const std::invalid_argument& e) {
      ADD_FAILURE() << e.what();
    }
  }
  EXPECT_GE(checked, 6);
}

}  // namespace
}  // namespace shardrl::testing
