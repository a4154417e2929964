// Learning-rate warmup/decay schedules with verl's names and semantics, so that a verl
// `actor.optim` config block means the same thing here.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardrl::optim {

struct LRScheduleConfig {
  std::string warmup_style = "constant";  // "constant" or "cosine"
  // <= 0: derive the warmup from lr_warmup_steps_ratio * total_training_steps instead.
  int64_t lr_warmup_steps = -1;
  double lr_warmup_steps_ratio = 0.0;
  int64_t total_training_steps = 0;  // required (> 0) by "cosine"
  double min_lr_ratio = 0.0;         // cosine floor, as a fraction of the base lr
  double num_cycles = 0.5;           // 0.5: a single half-cosine from 1 down to min_lr_ratio
};

// Warmup steps actually used: lr_warmup_steps, or int(ratio * total) when that is <= 0.
int64_t effective_warmup_steps(const LRScheduleConfig& config);

// Multiplier of the base lr at zero-indexed optimizer step `step`. Throws std::invalid_argument
// for an unknown warmup_style, a negative step, or an out-of-range field.
double lr_multiplier(const LRScheduleConfig& config, int64_t step);

// Drives the lr of every param group of an optimizer from the schedule, like torch's LambdaLR:
// after construction the lr is base * f(0), after k calls of step() it is base * f(k).
// Base lrs are the groups' lrs at construction; works with any optimizer whose options
// implement get_lr/set_lr (Adam, AdamW, SGD, ...). The optimizer must outlive the scheduler.
class LRScheduler {
 public:
  LRScheduler(torch::optim::Optimizer& optimizer, LRScheduleConfig config);

  // Advances one step and returns the new lr of param group 0.
  double step();
  double current_lr() const;
  int64_t last_step() const { return last_step_; }
  // Checkpoint resume: jumps to `step` and reapplies the lr for it.
  void set_last_step(int64_t step);

  const std::vector<double>& base_lrs() const { return base_lrs_; }
  const LRScheduleConfig& config() const { return config_; }

 private:
  void apply();

  torch::optim::Optimizer& optimizer_;
  LRScheduleConfig config_;
  std::vector<double> base_lrs_;
  int64_t last_step_ = 0;
};

}  // namespace shardrl::optim
