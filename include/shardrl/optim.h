// Optimizers over sharded parameters. AdamW is element-wise, so stepping each rank's fp32 shard
// with torch::optim::AdamW is numerically the unsharded update; zero padding stays zero.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "shardrl/fsdp.h"

namespace shardrl::optim {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  // Params exempt from weight decay: every 1-D (or 0-D) param when no_decay_1d, and names that
  // contain one of these substrings (biases and norms, as in verl and most LLM recipes).
  bool no_decay_1d = true;
  std::vector<std::string> no_decay_name_patterns = {"bias", "norm", "ln_"};
};

// One optimizer input: a tensor to step, its name and the unsharded shape the decay rule reads.
struct NamedParameter {
  std::string name;
  torch::Tensor tensor;
  std::vector<int64_t> global_shape;
};

std::vector<NamedParameter> from_sharded(const std::vector<fsdp::ShardedParameter>& params);
std::vector<NamedParameter> from_module(const torch::nn::Module& module);

bool exempt_from_weight_decay(const NamedParameter& param, const AdamWConfig& config);

// AdamW with two param groups (decay, no decay); frozen params are left out.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<NamedParameter>& params,
                                                const AdamWConfig& config);

// Bytes of optimizer state (moments, step counters) the optimizer holds.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

struct StepResult {
  double grad_norm = 0.0;
  bool skipped = false;  // the norm was not finite: no update was made
};

// Clips to max_norm over all shards (max_norm <= 0: measure only), then steps unless the norm is
// not finite, in which case the step is skipped, grads are dropped and a warning is logged.
StepResult clip_and_step(fsdp::FSDPModule& model, torch::optim::Optimizer& optimizer,
                         double max_norm);

}  // namespace shardrl::optim
