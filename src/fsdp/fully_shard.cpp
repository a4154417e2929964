// fully_shard(), the unit boundary hooks and the model-wide operations of FSDPModule.
#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/grads.h"
#include "fsdp/trace.h"
#include "fsdp/unit_state.h"

namespace shardrl::fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Which modules are units, so a root can find the units below it on its first forward.
struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<UnitState>> units;

  std::shared_ptr<UnitState> find(const torch::nn::Module* m) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = units.find(m);
    return it == units.end() ? nullptr : it->second.lock();
  }
  void add(const torch::nn::Module* m, const std::shared_ptr<UnitState>& unit) {
    std::lock_guard<std::mutex> lock(mutex);
    units[m] = unit;
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// The root whose forward is running on this thread.
thread_local RootContext* t_active_root = nullptr;

thread_local bool t_empty_init = false;

UnitState* unit_from(AutogradContext* ctx) {
  return reinterpret_cast<UnitState*>(ctx->saved_data["unit"].toInt());
}

// Identity on a unit's outputs; its backward runs before the unit's backward: re-gather.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static variable_list forward(AutogradContext* ctx, at::TensorList outputs, int64_t unit) {
    ctx->saved_data["unit"] = unit;
    return variable_list(outputs.begin(), outputs.end());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    unit_from(ctx)->pre_backward();
    grads.emplace_back();  // for the unit argument
    return grads;
  }
};

// Identity on a unit's inputs; its backward runs once the unit's backward has produced the input
// grads, after every parameter grad of the unit was accumulated (AccumulateGrad nodes run first).
struct PostBackward : public torch::autograd::Function<PostBackward> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, int64_t unit) {
    ctx->saved_data["unit"] = unit;
    return variable_list(inputs.begin(), inputs.end());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    unit_from(ctx)->post_backward();
    grads.emplace_back();
    return grads;
  }
};

// Applies fn to the tensors of `all` that require grad, keeping the order of `all`.
std::vector<torch::Tensor> wrap_requiring_grad(std::vector<torch::Tensor> all, UnitState& unit,
                                               variable_list (*fn)(const at::TensorList&,
                                                                   const int64_t&)) {
  std::vector<size_t> where;
  std::vector<torch::Tensor> picked;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].defined() && all[i].requires_grad()) {
      where.push_back(i);
      picked.push_back(all[i]);
    }
  }
  if (picked.empty()) return all;
  auto wrapped = fn(at::TensorList(picked), reinterpret_cast<int64_t>(&unit));
  for (size_t k = 0; k < where.size(); ++k) all[where[k]] = wrapped[k];
  return all;
}

variable_list apply_pre_backward(const at::TensorList& t, const int64_t& u) {
  return PreBackward::apply(t, u);
}
variable_list apply_post_backward(const at::TensorList& t, const int64_t& u) {
  return PostBackward::apply(t, u);
}

void init_root(const std::shared_ptr<UnitState>& unit) {
  unit->is_root = true;
  unit->owned_root = std::make_unique<RootContext>(unit.get());
  RootContext* root = unit->owned_root.get();
  root->units.push_back(unit.get());
  unit->root = root;
  unit->path = "root";
  for (const auto& item : unit->module->named_modules("", /*include_self=*/false)) {
    auto sub = registry().find(item.value().get());
    if (!sub) continue;
    TORCH_CHECK(!sub->root, "fully_shard: a unit belongs to two sharded roots");
    sub->root = root;
    sub->path = item.key();
    root->units.push_back(sub.get());
  }
}

RootContext& root_of(const std::shared_ptr<UnitState>& unit) {
  if (!unit->root) init_root(unit);
  return *unit->root;
}

// Parameter names as the unsharded model spells them, keyed by the (stable) parameter tensor.
std::unordered_map<const c10::TensorImpl*, std::string> qualified_names(
    const torch::nn::Module& m) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  return names;
}

// Units scoped by this handle: the whole model for the root, the unit alone otherwise.
std::vector<UnitState*> scoped_units(const std::shared_ptr<UnitState>& unit) {
  RootContext& root = root_of(unit);
  if (unit->is_root) return root.units;
  return {unit.get()};
}

}  // namespace

torch::ScalarType parse_dtype(const std::string& name, const std::string& field) {
  static const std::unordered_map<std::string, torch::ScalarType> known = {
      {"bf16", torch::kBFloat16}, {"bfloat16", torch::kBFloat16}, {"fp16", torch::kHalf},
      {"float16", torch::kHalf},  {"half", torch::kHalf},         {"fp32", torch::kFloat},
      {"float32", torch::kFloat}, {"float", torch::kFloat}};
  auto it = known.find(name);
  if (it == known.end()) {
    throw std::invalid_argument(
        fmt::format("{}: unknown dtype '{}' (expected bf16, fp16 or fp32)", field, name));
  }
  return it->second;
}

EmptyInit::EmptyInit(bool enabled) : previous_(t_empty_init) {
  t_empty_init = previous_ || enabled;
}

EmptyInit::~EmptyInit() {
  t_empty_init = previous_;
}

bool has_no_values(const torch::Tensor& param) {
  return param.numel() > 0 && param.storage().nbytes() == 0;
}

torch::Tensor new_parameter(c10::IntArrayRef shape,
                            const std::function<void(torch::Tensor&)>& init) {
  torch::NoGradGuard no_grad;
  if (t_empty_init) {
    // Sized like the param but with an empty storage, the state fully_shard leaves an unsharded
    // param in: reading it throws ("data is not allocated yet") instead of reading garbage.
    torch::Tensor empty = torch::empty({0});
    empty.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    return empty;
  }
  torch::Tensor param = torch::empty(shape);
  init(param);
  return param;
}

namespace detail {

std::shared_ptr<UnitState> shard_module(const std::shared_ptr<torch::nn::Module>& module,
                                        const dist::DeviceMesh& mesh, const Options& options,
                                        bool backward_reads_params) {
  TORCH_CHECK(options.prefetch >= 0, "fully_shard: prefetch must be >= 0");
  // Parameters of units sharded earlier (the children) stay theirs.
  std::unordered_set<const c10::TensorImpl*> owned;
  for (const auto& child : module->modules(/*include_self=*/false)) {
    if (!registry().find(child.get())) continue;
    for (const auto& p : child->parameters()) owned.insert(p.unsafeGetTensorImpl());
  }
  std::vector<std::pair<std::string, torch::Tensor>> mine;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (owned.count(impl) || !seen.insert(impl).second) continue;
    mine.emplace_back(item.key(), item.value());
  }
  auto unit = std::make_shared<UnitState>(module, mesh, options);
  unit->backward_reads_params = backward_reads_params;
  unit->shard_parameters(mine);
  // Buffers live where the unit computes (parameters get there through their shards).
  torch::NoGradGuard no_grad;
  for (auto& buffer : module->buffers(/*recurse=*/true)) {
    if (buffer.defined() && buffer.device() != mesh.device())
      buffer.set_data(buffer.to(mesh.device()));
  }
  registry().add(module.get(), unit);
  return unit;
}

std::vector<torch::Tensor> pre_forward(UnitState& unit, std::vector<torch::Tensor> inputs) {
  if (unit.is_root && t_active_root == unit.root)
    t_active_root = nullptr;  // an earlier forward threw
  if (!t_active_root) {
    auto self = registry().find(unit.module.get());
    RootContext& root = root_of(self);
    TORCH_CHECK(unit.is_root,
                "FSDP unit called on its own: call the root module that fully_shard() was "
                "applied to last");
    t_active_root = &root;
    root.begin_forward();
  }
  TORCH_CHECK(
      unit.root == t_active_root,
      "FSDP unit called from a root it does not belong to (shard children before the root)");
  unit.wait_for_unshard();
  if (!unit.is_root) unit.root->forward_order.push_back(&unit);
  unit.root->prefetch_after_in_forward(&unit);

  const auto param_dtype = unit.options.mixed_precision.param_dtype;
  const auto device = unit.mesh.device();
  for (auto& t : inputs) {
    if (!t.defined()) continue;
    if (t.device() != device) t = t.to(device, /*non_blocking=*/true);
    if (t.is_floating_point() && t.scalar_type() != param_dtype) t = t.to(param_dtype);
  }
  if (torch::GradMode::is_enabled()) {
    inputs = wrap_requiring_grad(std::move(inputs), unit, apply_post_backward);
  }
  trace::record(trace::Event::kForwardBegin, unit);
  return inputs;
}

std::vector<torch::Tensor> post_forward(UnitState& unit, std::vector<torch::Tensor> outputs) {
  trace::record(trace::Event::kForwardEnd, unit);
  bool needs_backward = false;
  if (torch::GradMode::is_enabled()) {
    for (const auto& t : outputs) needs_backward |= t.defined() && t.requires_grad();
  }
  unit.backward_expected = needs_backward;
  if (needs_backward) outputs = wrap_requiring_grad(std::move(outputs), unit, apply_pre_backward);
  if (unit.is_root) {
    if (auto dtype = unit.options.mixed_precision.output_dtype) {
      for (auto& t : outputs) {
        if (t.defined() && t.is_floating_point()) t = t.to(*dtype);
      }
    }
    t_active_root = nullptr;
    // No backward will come to reshard: do it now (eval and reference forwards).
    if (!needs_backward) {
      for (auto* u : unit.root->units) u->reshard();
    }
  } else if (!needs_backward || !unit.backward_reads_params) {
    unit.reshard();
  } else if (unit.options.reshard_after_forward) {
    unit.reshard(/*for_backward=*/true);
  }
  return outputs;
}

}  // namespace detail

std::vector<ShardedParameter> FSDPModule::sharded_parameters() const {
  const auto names = qualified_names(*state_->module);
  const int rank = state_->mesh.shard_group().rank();
  std::vector<ShardedParameter> out;
  for (UnitState* unit : scoped_units(state_)) {
    for (const auto& slot : unit->params) {
      ShardedParameter p;
      p.name = names.at(slot.unsharded().unsafeGetTensorImpl());
      p.shard = slot.shard();
      p.global_shape = slot.shape();
      p.row_offset = slot.row_offset_on(rank);
      p.valid_rows = slot.valid_rows_on(rank);
      out.push_back(std::move(p));
    }
  }
  return out;
}

std::vector<std::string> FSDPModule::awaiting_load() const {
  const auto names = qualified_names(*state_->module);
  std::vector<std::string> out;
  for (UnitState* unit : scoped_units(state_)) {
    for (const auto& slot : unit->params) {
      if (slot.awaiting_load) out.push_back(names.at(slot.unsharded().unsafeGetTensorImpl()));
    }
  }
  return out;
}

void FSDPModule::mark_loaded(const std::vector<std::string>& loaded) {
  const std::unordered_set<std::string> wanted(loaded.begin(), loaded.end());
  const auto names = qualified_names(*state_->module);
  for (UnitState* unit : scoped_units(state_)) {
    for (auto& slot : unit->params) {
      if (wanted.count(names.at(slot.unsharded().unsafeGetTensorImpl())))
        slot.awaiting_load = false;
    }
  }
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  root_of(state_).requires_gradient_sync = sync;
}

void FSDPModule::set_reshard_after_forward(bool reshard) {
  for (UnitState* unit : scoped_units(state_)) unit->options.reshard_after_forward = reshard;
}

double FSDPModule::grad_norm() {
  // After a failed reduce-scatter the grads are incomplete: no norm, no step from them.
  for (UnitState* unit : scoped_units(state_)) unit->check_usable();
  torch::NoGradGuard no_grad;
  // Collected over every unit and summed once, in shard order: the sum's rounding (and the step
  // it clips) is then the same whether the units came into memory together or one by one.
  std::vector<torch::Tensor> squared_norms;
  for_each_resident(ShardUse::kGrads, [&](std::vector<ShardedParameter>& shards) {
    squared_norms.push_back(squared_grad_norms(shards).to(state_->mesh.device()));
  });
  torch::Tensor sum_sq =
      squared_norms.empty()
          ? torch::zeros({1}, torch::dtype(torch::kDouble).device(state_->mesh.device()))
          : at::cat(squared_norms).sum().reshape({1});
  // Shards are disjoint across the shard group and identical across replicas.
  state_->mesh.shard_group().all_reduce(sum_sq);
  return std::sqrt(sum_sq.item<double>());
}

double FSDPModule::clip_grad_norm_(double max_norm) {
  const double total = grad_norm();
  if (!std::isfinite(total)) return total;
  const double coef = clip_coefficient(total, max_norm);
  if (coef < 1.0) {
    for_each_resident(ShardUse::kGrads,
                      [&](std::vector<ShardedParameter>& shards) { scale_grads(shards, coef); });
  }
  return total;
}

torch::Tensor squared_grad_norms(const std::vector<ShardedParameter>& shards) {
  std::map<torch::ScalarType, std::vector<torch::Tensor>> grads;
  std::map<torch::ScalarType, std::vector<int64_t>> positions;
  int64_t count = 0;
  for (const auto& p : shards) {
    const torch::Tensor& grad = p.shard.grad();
    if (!grad.defined()) continue;
    grads[grad.scalar_type()].push_back(grad);
    positions[grad.scalar_type()].push_back(count++);
  }
  if (grads.empty()) return torch::zeros({0}, torch::kDouble);
  // Per-tensor norms in the grad's dtype, squared in fp64: no fp64 copy of any grad.
  auto squares = [](const std::vector<torch::Tensor>& same_dtype) {
    return at::stack(at::_foreach_norm(same_dtype, 2)).to(torch::kDouble).square();
  };
  if (grads.size() == 1) return squares(grads.begin()->second);
  const torch::Device device = grads.begin()->second.front().device();
  torch::Tensor in_order = torch::empty({count}, torch::dtype(torch::kDouble).device(device));
  for (const auto& [dtype, same_dtype] : grads) {
    in_order.index_copy_(0, torch::tensor(positions.at(dtype)).to(device), squares(same_dtype));
  }
  return in_order;
}

void scale_grads(const std::vector<ShardedParameter>& shards, double coef) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : shards) {
    if (p.shard.grad().defined()) grads.push_back(p.shard.mutable_grad());
  }
  if (!grads.empty()) at::_foreach_mul_(grads, coef);
}

void FSDPModule::for_each_resident(ShardUse use,
                                   const std::function<void(std::vector<ShardedParameter>&)>& fn) {
  auto units = scoped_units(state_);
  const bool offloading = std::any_of(units.begin(), units.end(),
                                      [](const UnitState* u) { return u->residency != nullptr; });
  if (!offloading) {
    auto shards = sharded_parameters();
    fn(shards);
    return;
  }
  auto all = sharded_parameters();
  size_t next = 0;
  for (UnitState* unit : units) {
    std::vector<ShardedParameter> shards(all.begin() + next,
                                         all.begin() + next + unit->params.size());
    next += unit->params.size();
    if (shards.empty()) continue;
    if (unit->residency) unit->residency->acquire(unit->view(), use);
    fn(shards);
    if (unit->residency) unit->residency->release(unit->view(), use);
  }
}

std::vector<ShardedUnit> FSDPModule::units() const {
  std::vector<ShardedUnit> out;
  for (UnitState* unit : scoped_units(state_)) out.push_back(unit->view());
  return out;
}

bool FSDPModule::is_root() const {
  root_of(state_);
  return state_->is_root;
}

void FSDPModule::set_residency(const std::shared_ptr<ShardResidency>& residency) const {
  for (UnitState* unit : scoped_units(state_)) unit->residency = residency;
}

ShardResidency* FSDPModule::residency() const {
  return state_->residency.get();
}

torch::Tensor ShardedUnit::flat_shard() const {
  return state_->params.empty() ? torch::Tensor() : state_->flat_shard;
}

std::vector<torch::Tensor> ShardedUnit::shards() const {
  std::vector<torch::Tensor> out;
  for (const auto& slot : state_->params) out.push_back(slot.shard());
  return out;
}

void FSDPModule::zero_grad() {
  for (UnitState* unit : scoped_units(state_)) {
    for (auto& slot : unit->params) {
      slot.shard().mutable_grad() = torch::Tensor();
      slot.clear_unsharded_grads();
    }
  }
}

std::map<std::string, torch::Tensor> FSDPModule::full_parameters() const {
  const auto names = qualified_names(*state_->module);
  torch::NoGradGuard no_grad;
  auto& group = state_->mesh.shard_group();
  std::map<std::string, torch::Tensor> out;
  for (UnitState* unit : scoped_units(state_)) unit->check_usable();
  for (UnitState* unit : scoped_units(state_)) {
    // Offloaded shards come in one unit at a time; the gathered copies are new tensors.
    if (unit->residency) unit->residency->acquire(unit->view(), ShardUse::kParams);
    for (const auto& slot : unit->params) {
      torch::Tensor gathered =
          torch::empty({group.size() * slot.shard_numel()}, slot.shard().options());
      group.all_gather(slot.shard().detach().reshape(-1), gathered);
      out[names.at(slot.unsharded().unsafeGetTensorImpl())] = slot.full_from_gathered(gathered);
    }
    if (unit->residency) unit->residency->release(unit->view(), ShardUse::kParams);
  }
  return out;
}

MemoryStats FSDPModule::memory() const {
  MemoryStats stats;
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : int64_t{0};
  };
  for (UnitState* unit : scoped_units(state_)) {
    stats.sharded_param_bytes += bytes(unit->flat_shard);
    for (const auto& slot : unit->params) {
      stats.sharded_grad_bytes += bytes(slot.shard().grad());
      stats.unsharded_param_bytes += bytes(slot.unsharded());
      stats.unsharded_grad_bytes += slot.unsharded_grad_bytes();
    }
  }
  return stats;
}

uint64_t FSDPModule::bytes_sent() const {
  const auto& mesh = state_->mesh;
  return mesh.shard_group().bytes_sent() +
         (mesh.replicate_group() ? mesh.replicate_group()->bytes_sent() : 0);
}

void FSDPModule::reset_bytes_sent() {
  const auto& mesh = state_->mesh;
  mesh.shard_group().reset_bytes_sent();
  if (mesh.replicate_group()) mesh.replicate_group()->reset_bytes_sent();
}

void FSDPModule::reshard() {
  for (UnitState* unit : scoped_units(state_)) {
    unit->held_unsharded = false;
    unit->reshard();
  }
}

void FSDPModule::unshard() {
  const auto units = scoped_units(state_);
  try {
    // Every gather is in flight before the first wait, so they overlap.
    for (UnitState* unit : units) unit->unshard();
    for (UnitState* unit : units) {
      unit->wait_for_unshard();
      unit->held_unsharded = true;
    }
  } catch (...) {
    // No half-held model: what was gathered is freed, gathers still in flight are dropped.
    reshard();
    throw;
  }
}

UnshardScope::UnshardScope(FSDPModule module) : module_(std::move(module)) {
  module_.unshard();
}

UnshardScope::~UnshardScope() {
  module_.reshard();
}

const dist::DeviceMesh& FSDPModule::mesh() const {
  return state_->mesh;
}

}  // namespace shardrl::fsdp
