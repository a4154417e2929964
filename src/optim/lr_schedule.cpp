#include "shardrl/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace shardrl::optim {
namespace {

constexpr double kPi = 3.14159265358979323846;

void check_config(const LRScheduleConfig& config) {
  if (config.warmup_style != "constant" && config.warmup_style != "cosine") {
    throw std::invalid_argument("warmup_style: unknown value \"" + config.warmup_style +
                                "\" (expected \"constant\" or \"cosine\")");
  }
  if (config.warmup_style == "cosine" && config.total_training_steps <= 0) {
    // Without a horizon the cosine would keep oscillating instead of decaying once.
    throw std::invalid_argument(
        "total_training_steps: must be > 0 for warmup_style \"cosine\", got " +
        std::to_string(config.total_training_steps));
  }
  if (!(config.min_lr_ratio >= 0.0 && config.min_lr_ratio <= 1.0)) {
    throw std::invalid_argument("min_lr_ratio: must be in [0, 1], got " +
                                std::to_string(config.min_lr_ratio));
  }
}

}  // namespace

int64_t effective_warmup_steps(const LRScheduleConfig& config) {
  if (config.lr_warmup_steps > 0) return config.lr_warmup_steps;
  // Truncation toward zero, as Python's int() does in verl.
  return static_cast<int64_t>(config.lr_warmup_steps_ratio *
                              static_cast<double>(config.total_training_steps));
}

double lr_multiplier(const LRScheduleConfig& config, int64_t step) {
  check_config(config);
  if (step < 0) {
    throw std::invalid_argument("step: must be >= 0, got " + std::to_string(step));
  }
  const int64_t warmup = effective_warmup_steps(config);
  const double s = static_cast<double>(step);
  if (step < warmup) return s / static_cast<double>(std::max<int64_t>(1, warmup));
  if (config.warmup_style == "constant") return 1.0;

  const double m = config.min_lr_ratio;
  const double progress =
      (s - static_cast<double>(warmup)) /
      static_cast<double>(std::max<int64_t>(1, config.total_training_steps - warmup));
  const double x = std::cos(kPi * config.num_cycles * 2.0 * progress);
  return std::max(m, x * (1.0 - m) * 0.5 + (1.0 + m) * 0.5);
}

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer, LRScheduleConfig config)
    : optimizer_(optimizer), config_(std::move(config)) {
  check_config(config_);
  for (const auto& group : optimizer_.param_groups()) base_lrs_.push_back(group.options().get_lr());
  if (base_lrs_.empty()) throw std::invalid_argument("optimizer: has no param groups");
  apply();
}

double LRScheduler::step() {
  ++last_step_;
  apply();
  return current_lr();
}

double LRScheduler::current_lr() const {
  return optimizer_.param_groups().front().options().get_lr();
}

void LRScheduler::set_last_step(int64_t step) {
  if (step < 0) throw std::invalid_argument("step: must be >= 0, got " + std::to_string(step));
  last_step_ = step;
  apply();
}

void LRScheduler::apply() {
  auto& groups = optimizer_.param_groups();
  if (groups.size() != base_lrs_.size()) {
    // A group added after construction has no recorded base lr to scale.
    throw std::logic_error("LRScheduler: optimizer had " + std::to_string(base_lrs_.size()) +
                           " param groups at construction, now " + std::to_string(groups.size()));
  }
  const double f = lr_multiplier(config_, last_step_);
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(base_lrs_[i] * f);
}

}  // namespace shardrl::optim
