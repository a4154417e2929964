// Watching a run: the console's step line, and trainer.logger as verl names it. What the loggers
// write is read back in tests/test_trainer.cpp and tests/test_diffusion_rl.cpp, on runs of
// `shardrl train` (TensorBoard's event files by TensorBoard's own reader).
#include <gtest/gtest.h>

#include <fstream>

#include "../src/trainer/tasks.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

TEST(StepLine, ShowsHeadlineMetricsThroughputAndEta) {
  const std::map<std::string, double> metrics = {
      {"reward_mean", 0.8521},       {"loss", -0.0012},  {"grad_norm", 0.31}, {"lr", 1e-3},
      {"perf/images_per_s", 41.234}, {"val/reward", 0.9}};
  const std::string line = trainer::step_line(12, 80, metrics, {"perf/images_per_s", "img/s"}, 3.0);
  EXPECT_EQ(line,
            "12/80 reward_mean=0.8521 loss=-0.0012 grad_norm=0.31 val/reward=0.9 | 41.2 img/s | "
            "3.0s/step, ETA 3m24s");
  // The last step has no ETA; a task without a throughput metric shows none.
  EXPECT_EQ(trainer::step_line(4, 4, {{"loss", 2.5}}, {}, 0.5), "4/4 loss=2.5 | 0.5s/step");
  EXPECT_EQ(trainer::step_line(1, 4, {{"loss", 2.5}, {"perf/tokens_per_s", 51234.4}},
                               {"perf/tokens_per_s", "tok/s"}, 0.5),
            "1/4 loss=2.5 | 51234 tok/s | 0.5s/step, ETA 1.5s");
}

// trainer.logger as verl has it: a list, or a single name (configs in the wild say `console`);
// an unknown logger is an error naming the key and the loggers there are.
TEST(TrainerConfig, LoggerIsAListAndASingleNameIsAListOfOne) {
  const auto dir = make_temp_dir("trainer_logger");
  const auto path = dir + "/lm.yaml";
  std::ofstream(path) << kSmallLmConfig;
  auto loggers = [&](const std::vector<std::string>& overrides) {
    return trainer::configured_loggers(trainer::task_config(path, overrides));
  };
  EXPECT_EQ(loggers({}), (std::vector<std::string>{"console", "file"}));
  EXPECT_EQ(loggers({"trainer.logger=console"}), std::vector<std::string>{"console"});
  EXPECT_EQ(loggers({"trainer.logger=[console, tensorboard]"}),
            (std::vector<std::string>{"console", "tensorboard"}));
  // A list, then a single name over it.
  EXPECT_EQ(loggers({"trainer.logger=[file, tensorboard]", "trainer.logger=tensorboard"}),
            std::vector<std::string>{"tensorboard"});
  EXPECT_TRUE(loggers({"trainer.logger=[]"}).empty());
  for (const std::string bad : {"wandb", "[console, wandb]", "[console, 3]"}) {
    try {
      loggers({"trainer.logger=" + bad});
      ADD_FAILURE() << bad << ": no error";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      for (const char* expected :
           {"override 'trainer.logger=", "'trainer.logger'", "console, file, tensorboard"}) {
        EXPECT_NE(what.find(expected), std::string::npos) << bad << ": " << what;
      }
    }
  }
  expect_invalid_argument_naming([&] { loggers({"trainer.logger=5"}); }, "'trainer.logger'");
  // Other lists do not take a single string.
  expect_invalid_argument_naming(
      [&] { trainer::task_config(path, {"actor_rollout_ref.actor.optim.betas=fast"}); },
      "actor_rollout_ref.actor.optim.betas");
}

TEST(TrainerConfig, TensorBoardGoesWhereVerlPutsIt) {
  const auto dir = make_temp_dir("trainer_tensorboard_dir");
  const auto path = dir + "/lm.yaml";
  std::ofstream(path) << kSmallLmConfig;
  const auto config =
      trainer::task_config(path, {"trainer.project_name=proj", "trainer.experiment_name=exp"});
  unsetenv("TENSORBOARD_DIR");
  EXPECT_EQ(trainer::tensorboard_dir(config), "tensorboard_log/proj/exp");
  setenv("TENSORBOARD_DIR", "/somewhere/tb", 1);
  EXPECT_EQ(trainer::tensorboard_dir(config), "/somewhere/tb");
  unsetenv("TENSORBOARD_DIR");
}

}  // namespace
}  // namespace shardrl::testing
