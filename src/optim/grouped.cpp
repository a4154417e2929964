// Grouped optimizers and the per-param access that offload and per-unit stepping need.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unordered_set>

#include "compat.h"
#include "shardrl/optim.h"

namespace shardrl::optim {
namespace {

using torch::optim::Optimizer;
using torch::optim::OptimizerParamGroup;

std::vector<OptimizerParamGroup> mirror_groups(
    const std::vector<std::unique_ptr<Optimizer>>& optimizers) {
  if (optimizers.empty()) {
    throw std::invalid_argument("GroupedOptimizer: optimizers must not be empty");
  }
  std::vector<OptimizerParamGroup> groups;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t i = 0; i < optimizers.size(); ++i) {
    if (!optimizers[i]) {
      throw std::invalid_argument(fmt::format("GroupedOptimizer: optimizers[{}] is null", i));
    }
    for (const auto& group : optimizers[i]->param_groups()) {
      for (const auto& p : group.params()) {
        if (!seen.insert(p.unsafeGetTensorImpl()).second) {
          throw std::invalid_argument(fmt::format(
              "GroupedOptimizer: optimizers[{}] holds a parameter of shape {} that an earlier "
              "optimizer holds too (the parameter sets must be disjoint)",
              i, fmt::join(p.sizes(), "x")));
        }
      }
      groups.emplace_back(group.params(), group.options().clone());
    }
  }
  return groups;
}

std::unique_ptr<torch::optim::OptimizerOptions> first_defaults(
    const std::vector<std::unique_ptr<Optimizer>>& optimizers) {
  mirror_groups(optimizers);  // names what is wrong before anything is read
  return optimizers.front()->defaults().clone();
}

// Narrows every group of `optimizer`'s leaves to the params `pick` accepts, for its lifetime.
class Narrowed {
 public:
  Narrowed(Optimizer& optimizer, const std::function<bool(const torch::Tensor&)>& pick) {
    for (Optimizer* leaf : leaf_optimizers(optimizer)) {
      for (auto& group : leaf->param_groups()) {
        std::vector<torch::Tensor> kept;
        for (const auto& p : group.params()) {
          if (pick(p)) kept.push_back(p);
        }
        saved_.emplace_back(&group.params(), std::move(group.params()));
        group.params() = std::move(kept);
      }
    }
  }
  ~Narrowed() {
    for (auto& [where, params] : saved_) *where = std::move(params);
  }
  Narrowed(const Narrowed&) = delete;
  Narrowed& operator=(const Narrowed&) = delete;

 private:
  std::vector<std::pair<std::vector<torch::Tensor>*, std::vector<torch::Tensor>>> saved_;
};

}  // namespace

GroupedOptimizer::GroupedOptimizer(std::vector<std::unique_ptr<Optimizer>> optimizers)
    : Optimizer(mirror_groups(optimizers), first_defaults(optimizers)),
      optimizers_(std::move(optimizers)) {}

torch::Tensor GroupedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode grad_mode(true);
    loss = closure();
  }
  size_t mirrored = 0;
  for (auto& optimizer : optimizers_) {
    for (auto& group : optimizer->param_groups()) {
      group.options().set_lr(param_groups_.at(mirrored++).options().get_lr());
    }
    optimizer->step();
  }
  return loss;
}

void GroupedOptimizer::save(torch::serialize::OutputArchive&) const {
  throw std::logic_error("GroupedOptimizer::save: save each sub-optimizer (optimizer(i))");
}

void GroupedOptimizer::load(torch::serialize::InputArchive&) {
  throw std::logic_error("GroupedOptimizer::load: load each sub-optimizer (optimizer(i))");
}

Optimizer& GroupedOptimizer::optimizer(size_t index) {
  if (index >= optimizers_.size()) {
    throw std::out_of_range(fmt::format("GroupedOptimizer::optimizer: index {} >= {} optimizers",
                                        index, optimizers_.size()));
  }
  return *optimizers_[index];
}

std::vector<Optimizer*> leaf_optimizers(Optimizer& optimizer) {
  auto* grouped = dynamic_cast<GroupedOptimizer*>(&optimizer);
  if (!grouped) return {&optimizer};
  std::vector<Optimizer*> out;
  for (size_t i = 0; i < grouped->size(); ++i) {
    for (Optimizer* leaf : leaf_optimizers(grouped->optimizer(i))) out.push_back(leaf);
  }
  return out;
}

std::vector<const Optimizer*> leaf_optimizers(const Optimizer& optimizer) {
  auto leaves = leaf_optimizers(const_cast<Optimizer&>(optimizer));
  return {leaves.begin(), leaves.end()};
}

torch::optim::OptimizerParamState* find_state(Optimizer& optimizer, const torch::Tensor& param) {
  auto it = optimizer.state().find(compat::optimizer_state_key(param));
  return it == optimizer.state().end() ? nullptr : it->second.get();
}

std::vector<torch::Tensor> state_tensors(const torch::optim::OptimizerParamState& state) {
  std::vector<torch::Tensor> all;
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    all = {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    all = {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    all = {s->momentum_buffer()};
  } else if (auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    all = {s->square_avg(), s->momentum_buffer(), s->grad_avg()};
  } else if (auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    all = {s->sum()};
  } else {
    throw std::invalid_argument(fmt::format(
        "optimizer state of type {} is not supported (Adam, AdamW, SGD, RMSprop, Adagrad are)",
        c10::demangle(typeid(state).name())));
  }
  std::vector<torch::Tensor> defined;
  for (auto& t : all) {
    if (t.defined()) defined.push_back(std::move(t));
  }
  return defined;
}

void step_only(Optimizer& optimizer, const std::vector<torch::Tensor>& params) {
  std::unordered_set<const c10::TensorImpl*> picked;
  for (const auto& p : params) picked.insert(p.unsafeGetTensorImpl());
  Narrowed narrowed(optimizer,
                    [&](const torch::Tensor& p) { return picked.count(p.unsafeGetTensorImpl()); });
  optimizer.step();
}

int64_t optimizer_state_bytes(const Optimizer& optimizer) {
  int64_t total = 0;
  std::unordered_set<const c10::StorageImpl*> seen;
  for (const Optimizer* leaf : leaf_optimizers(optimizer)) {
    for (const auto& entry : leaf->state()) {
      for (const auto& t : state_tensors(*entry.second)) {
        // Keyed by storage, not data pointer: an offloaded storage has none and counts 0 bytes.
        if (seen.insert(t.storage().unsafeGetStorageImpl()).second) total += t.storage().nbytes();
      }
      total += sizeof(int64_t);  // step counter
    }
  }
  return total;
}

}  // namespace shardrl::optim
