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
  // Params exempt from weight decay: every 1-D (or 0-D) param when no_decay_1d (biases and the
  // scales of LayerNorm / RMSNorm, as in verl and most LLM recipes), and names that contain one of
  // these substrings. Not "norm": adaLN's modulation (diffusers' `norm1.linear.weight`) is a full
  // matrix that decays like every other linear's, as Hugging Face's Trainer decays it.
  bool no_decay_1d = true;
  std::vector<std::string> no_decay_name_patterns = {"bias"};
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

// Several optimizers over disjoint parameter sets behind one Optimizer: base vs LoRA params, or
// expert vs non-expert ones, each with its own lr, weight decay or algorithm. step() steps them
// all, zero_grad() clears every param's grad. The state stays in the sub-optimizers, so this
// optimizer's own state() is empty: code that reaches optimizer state goes through
// leaf_optimizers(). param_groups() mirror the sub-optimizers' groups in order, and an lr set
// there (as LRScheduler does) is passed down at every step.
class GroupedOptimizer : public torch::optim::Optimizer {
 public:
  explicit GroupedOptimizer(std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers);

  torch::Tensor step(LossClosure closure = nullptr) override;
  // The state is the sub-optimizers': save and load each of them instead.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  size_t size() const { return optimizers_.size(); }
  torch::optim::Optimizer& optimizer(size_t index);

 private:
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers_;
};

// The optimizers that hold state: a grouped optimizer's sub-optimizers, or the optimizer itself.
std::vector<torch::optim::Optimizer*> leaf_optimizers(torch::optim::Optimizer& optimizer);
std::vector<const torch::optim::Optimizer*> leaf_optimizers(
    const torch::optim::Optimizer& optimizer);

// `param`'s state in `optimizer` (a leaf optimizer), or null before its first step.
torch::optim::OptimizerParamState* find_state(torch::optim::Optimizer& optimizer,
                                              const torch::Tensor& param);
// The tensors of one parameter's state (Adam, AdamW, SGD, RMSprop, Adagrad); an unknown state
// type is an error that names it.
std::vector<torch::Tensor> state_tensors(const torch::optim::OptimizerParamState& state);

// Steps only `params`, leaving every other parameter and its state alone. The update of each
// stepped param is bit for bit what a full step makes (every supported optimizer is per-param).
void step_only(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params);

// Bytes of optimizer state (moments, step counters) the optimizer holds in memory.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

struct StepResult {
  double grad_norm = 0.0;
  bool skipped = false;  // the norm was not finite: no update was made
};

// Clips to max_norm over all shards (max_norm <= 0: measure only), then steps unless the norm is
// not finite, in which case the step is skipped, grads are dropped and a warning is logged. The
// norm covers every sub-optimizer of a grouped optimizer. While state is offloaded, each unit's
// params, grads and optimizer state come in for its part of the step and go back after it.
StepResult clip_and_step(fsdp::FSDPModule& model, torch::optim::Optimizer& optimizer,
                         double max_norm);

}  // namespace shardrl::optim
