// LR schedules: the §5 test vector of shared/reference/rl-algorithms.md and the scheduler that
// drives an optimizer's param groups.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardrl/lr_schedule.h"
#include "test_util.h"

namespace shardrl::optim {
namespace {

using shardrl::testing::expect_invalid_argument_naming;

LRScheduleConfig CosineConfig() {
  LRScheduleConfig c;
  c.warmup_style = "cosine";
  c.lr_warmup_steps = 2;
  c.total_training_steps = 10;
  c.min_lr_ratio = 0.1;
  return c;
}

TEST(LrSchedule, CosineMatchesReferenceVector) {
  const std::vector<double> expected = {0.0,  0.5,      1.0,      0.965746, 0.868198, 0.722208,
                                        0.55, 0.377792, 0.231802, 0.134254, 0.1};
  const auto config = CosineConfig();
  for (int64_t s = 0; s <= 10; ++s) {
    EXPECT_NEAR(lr_multiplier(config, s), expected[s], 1e-6) << "step " << s;
  }
}

TEST(LrSchedule, CosineNeverGoesBelowMinRatio) {
  auto config = CosineConfig();
  config.num_cycles = 1.0;  // a full cycle comes back up after the floor, past warmup
  for (int64_t s = 2; s <= 20; ++s) EXPECT_GE(lr_multiplier(config, s), 0.1 - 1e-12);
  EXPECT_NEAR(lr_multiplier(config, 10), 1.0, 1e-12);
}

TEST(LrSchedule, ConstantWithWarmup) {
  LRScheduleConfig config;
  config.lr_warmup_steps = 4;
  const std::vector<double> expected = {0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0};
  for (int64_t s = 0; s < 7; ++s) EXPECT_DOUBLE_EQ(lr_multiplier(config, s), expected[s]);
}

TEST(LrSchedule, ConstantWithoutWarmupIsOne) {
  LRScheduleConfig config;
  EXPECT_DOUBLE_EQ(lr_multiplier(config, 0), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(config, 123), 1.0);
}

TEST(LrSchedule, WarmupFromRatioWhenStepsNotPositive) {
  LRScheduleConfig config;
  config.lr_warmup_steps_ratio = 0.25;
  config.total_training_steps = 10;  // int(2.5) = 2
  for (int64_t w : {-1, 0}) {
    config.lr_warmup_steps = w;
    EXPECT_EQ(effective_warmup_steps(config), 2);
    EXPECT_DOUBLE_EQ(lr_multiplier(config, 1), 0.5);
    EXPECT_DOUBLE_EQ(lr_multiplier(config, 2), 1.0);
  }
  config.lr_warmup_steps = 3;  // explicit steps win over the ratio
  EXPECT_EQ(effective_warmup_steps(config), 3);

  auto cosine = CosineConfig();
  cosine.lr_warmup_steps = -1;
  cosine.lr_warmup_steps_ratio = 0.2;  // W = 2 again: same vector as the explicit config
  EXPECT_NEAR(lr_multiplier(cosine, 3), 0.965746, 1e-6);
}

TEST(LrSchedule, RejectsBadConfig) {
  LRScheduleConfig config;
  config.warmup_style = "linear";
  expect_invalid_argument_naming([&] { lr_multiplier(config, 0); }, "warmup_style", "linear");
  auto cosine = CosineConfig();
  cosine.total_training_steps = 0;
  expect_invalid_argument_naming([&] { lr_multiplier(cosine, 0); }, "total_training_steps", "0");
  cosine = CosineConfig();
  cosine.min_lr_ratio = 1.5;
  expect_invalid_argument_naming([&] { lr_multiplier(cosine, 0); }, "min_lr_ratio", "1.5");
  expect_invalid_argument_naming([&] { lr_multiplier(CosineConfig(), -1); }, "step", "-1");
}

TEST(LrScheduler, DrivesEveryParamGroupOfAdamW) {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({3}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a},
                      std::make_unique<torch::optim::AdamWOptions>(1e-3));
  groups.emplace_back(std::vector<torch::Tensor>{b},
                      std::make_unique<torch::optim::AdamWOptions>(2e-3));
  torch::optim::AdamW opt(std::move(groups), torch::optim::AdamWOptions(5e-3));

  LRScheduler sched(opt, CosineConfig());
  EXPECT_EQ(sched.last_step(), 0);
  EXPECT_DOUBLE_EQ(sched.current_lr(), 0.0);  // f(0) = 0 during warmup
  ASSERT_EQ(sched.base_lrs().size(), 2u);
  EXPECT_DOUBLE_EQ(sched.base_lrs()[1], 2e-3);

  EXPECT_NEAR(sched.step(), 0.5e-3, 1e-15);
  EXPECT_NEAR(opt.param_groups()[1].options().get_lr(), 1e-3, 1e-15);
  sched.step();
  EXPECT_NEAR(sched.step(), 1e-3 * 0.965746, 1e-9);
  EXPECT_EQ(sched.last_step(), 3);
  EXPECT_NEAR(opt.param_groups()[1].options().get_lr(), 2e-3 * 0.965746, 1e-9);

  sched.set_last_step(10);  // resume
  EXPECT_NEAR(sched.current_lr(), 1e-4, 1e-12);
  EXPECT_NEAR(opt.param_groups()[1].options().get_lr(), 2e-4, 1e-12);
}

TEST(LrScheduler, WorksWithAdamAndSgd) {
  auto p = torch::zeros({2}, torch::requires_grad());
  LRScheduleConfig config;
  config.lr_warmup_steps = 2;

  torch::optim::Adam adam({p}, torch::optim::AdamOptions(0.1));
  LRScheduler a(adam, config);
  EXPECT_DOUBLE_EQ(a.current_lr(), 0.0);
  EXPECT_DOUBLE_EQ(a.step(), 0.05);
  EXPECT_DOUBLE_EQ(a.step(), 0.1);

  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.2));
  LRScheduler s(sgd, config);
  EXPECT_DOUBLE_EQ(s.step(), 0.1);
  s.set_last_step(0);
  EXPECT_DOUBLE_EQ(s.current_lr(), 0.0);
}

TEST(LrScheduler, ConstructorRejectsUnknownStyle) {
  auto p = torch::zeros({1}, torch::requires_grad());
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3));
  LRScheduleConfig config;
  config.warmup_style = "wsd";
  expect_invalid_argument_naming([&] { LRScheduler s(opt, config); }, "warmup_style", "wsd");
}

}  // namespace
}  // namespace shardrl::optim
