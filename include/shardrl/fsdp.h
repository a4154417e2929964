// fully_shard for the LibTorch C++ frontend, after PyTorch FSDP2.
//
// Every parameter is split on dim 0 across the shard group (padded to equal shards); a rank keeps
// only its fp32 shard. A unit (usually one transformer block) all-gathers its parameters with one
// collective right before its forward, frees them after it (reshard_after_forward), gathers them
// again before its backward (unless that backward reads none: backward_reads_params, below) and
// reduce-scatters its gradients with one collective after it.
//
// The C++ frontend has no forward hooks, so the unit boundary is a type: declare a block as
// `fsdp::Unit<BlockImpl>` instead of `BlockImpl`'s holder and call it as usual (`x = block(x)`).
// Before fully_shard() it is a plain module holder; after, the call runs the FSDP schedule.
//
//   for (auto& block : model->blocks) fsdp::fully_shard(block, mesh, options);
//   fsdp::fully_shard(model, mesh, options);   // root: the parameters no block owns
//   auto loss = loss_fn(model(tokens));        // model is an fsdp::Unit<ModelImpl>
//   loss.backward();                           // grads land in the shards
//   auto shards = model.fsdp().sharded_parameters();   // what the optimizer steps
//
// When something throws: a forward or backward that throws on every rank at the same point (a
// bad batch, an error in the loss) can be retried. The next forward or backward finishes the
// collectives the failed one started, discards what they reduced and reshards every unit; call
// zero_grad() first, since grads accumulated before the exception stay, as in unsharded LibTorch.
// A collective that fails (a lost peer, a timeout) cannot be retried: its buffer was never
// filled and the ranks may be at different collectives. From then on every forward, backward,
// unshard(), grad_norm() and full_parameters() of the model throws, naming the unit whose
// collective failed; restart the job from a checkpoint.
#pragma once

#include <torch/torch.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "shardrl/dist.h"

namespace shardrl::fsdp {

// Parses "bf16"/"bfloat16", "fp16"/"float16", "fp32"/"float32"; errors name `field`.
torch::ScalarType parse_dtype(const std::string& name, const std::string& field);

struct MixedPrecision {
  torch::ScalarType param_dtype = torch::kFloat;  // unsharded params and compute
  // Gradient reduce-scatter, and no_sync's unsharded grads kept between micro-batches when it is
  // wider than param_dtype (as FSDP2: bf16 params, fp32 sums).
  torch::ScalarType reduce_dtype = torch::kFloat;
  // Root outputs are cast to this when set (e.g. fp32 logits for the loss).
  std::optional<torch::ScalarType> output_dtype;
};

struct Options {
  bool reshard_after_forward = true;  // the root always keeps its params until after backward
  MixedPrecision mixed_precision;
  int prefetch = 1;  // units whose all-gather starts ahead of use, in forward and backward order
  // Where the shard group's ranks share a host (the shared-memory transport), they share one image
  // of each unit's unsharded params in /dev/shm: each rank writes only its own rows and reads its
  // peers' where they are, with no copy-out, and no rank holds a private copy of the unit. A unit
  // resharded after forward keeps its rows there, and its backward reads them again instead of
  // gathering. The host holds one copy of the params in the compute dtype for the whole job; falls
  // back to private copies where /dev/shm cannot hold it. Writing an unsharded param in place
  // writes the rows every rank of the host reads (FSDP drops such writes at reshard either way).
  bool host_shared_params = true;
};

// One sharded parameter as the optimizer and checkpoints see it.
struct ShardedParameter {
  std::string name;     // fully qualified, as in the unsharded model
  torch::Tensor shard;  // fp32 master shard [ceil(dim0 / N), ...], zero padded; .grad()
  std::vector<int64_t> global_shape;  // the unsharded shape
  int64_t row_offset = 0;             // first dim-0 row this rank holds
  int64_t valid_rows = 0;             // rows of `shard` that are real (the rest is padding)
};

struct MemoryStats {
  int64_t sharded_param_bytes = 0;    // fp32 master shards
  int64_t sharded_grad_bytes = 0;     // reduced gradient shards
  int64_t unsharded_param_bytes = 0;  // all-gathered parameters currently allocated
  int64_t unsharded_grad_bytes = 0;   // gradients waiting for reduce-scatter (no_sync)
};

class UnitState;

// What a pass over the shards needs in compute memory while some of them are offloaded.
enum class ShardUse {
  kParams,  // the param shards (gathering full params, say)
  kGrads,   // the grad shards (measuring, scaling or accumulating them)
  kStep,    // params, grads and the optimizer state: an optimizer step
};

// One unit of a sharded model as layers above FSDP (offload) see it: its sharded storage, not its
// schedule. Compares equal for the same unit.
class ShardedUnit {
 public:
  explicit ShardedUnit(UnitState* state) : state_(state) {}
  // This rank's fp32 shards of every param of the unit, back to back (undefined: no params).
  torch::Tensor flat_shard() const;
  // The params' shard leaves, views into flat_shard in order; their .grad() are the grad shards.
  std::vector<torch::Tensor> shards() const;
  bool operator==(const ShardedUnit& other) const { return state_ == other.state_; }

 private:
  UnitState* state_;
};

// Where a unit's sharded state lives while a layer above FSDP keeps it out of compute memory.
// FSDP asks for it only where it reads or writes the shards; the offload layer implements it.
class ShardResidency {
 public:
  virtual ~ShardResidency() = default;
  // This rank's flat shard in compute memory as the all-gather input: the shard itself, or a
  // temporary copy while the shard stays offloaded.
  virtual torch::Tensor gather_input(const ShardedUnit& unit) = 0;
  // Brings what `use` needs into compute memory; release() sends it back where it belongs.
  virtual void acquire(const ShardedUnit& unit, ShardUse use) = 0;
  virtual void release(const ShardedUnit& unit, ShardUse use) = 0;
};

// The factor clip_grad_norm_ scales grads by for this total norm (>= 1: no clipping).
inline double clip_coefficient(double total_norm, double max_norm) {
  return max_norm / (total_norm + 1e-6);
}

// Operations on a sharded unit and every unit below it (the whole model when called on the root).
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<UnitState> state) : state_(std::move(state)) {}

  std::vector<ShardedParameter> sharded_parameters() const;
  // false: keep accumulating unsharded grads locally (no_sync); the next backward with true
  // reduce-scatters the total once.
  void set_requires_gradient_sync(bool sync);
  void set_reshard_after_forward(bool reshard);
  // Total norm over all shards of every rank, equal to the unsharded model's norm. Grads are
  // scaled only when the norm is finite and above max_norm; a non-finite norm is returned as is.
  double clip_grad_norm_(double max_norm);
  // The total norm alone, without clipping.
  double grad_norm();
  // Runs fn over the shards with what `use` needs resident in compute memory: once with every
  // shard, or, while an offload layer keeps state out of compute memory, once per unit with that
  // unit's state brought in and sent back afterwards. Shards come in sharded_parameters() order.
  void for_each_resident(ShardUse use,
                         const std::function<void(std::vector<ShardedParameter>&)>& fn);
  // The units this handle covers (root first), for layers that extend FSDP such as offload.
  std::vector<ShardedUnit> units() const;
  bool is_root() const;
  // Hands every unit in scope to `residency` (null: all shards resident again).
  void set_residency(const std::shared_ptr<ShardResidency>& residency) const;
  ShardResidency* residency() const;
  void zero_grad();
  // Every parameter at full size, gathered one tensor at a time (fp32 masters).
  std::map<std::string, torch::Tensor> full_parameters() const;
  MemoryStats memory() const;
  // Payload bytes this rank sent in FSDP collectives since the last reset.
  uint64_t bytes_sent() const;
  void reset_bytes_sent();
  // Frees the gathered params (and ends an unshard()).
  void reshard();
  // Params created under EmptyInit whose shards no loader has filled yet (qualified names). Any
  // all-gather (a forward, unshard()) errors while one is left.
  std::vector<std::string> awaiting_load() const;
  // Loaders call this, on every rank of the shard group, once they wrote the shards of `names`.
  void mark_loaded(const std::vector<std::string>& names);
  // FSDP2's unshard(): all-gathers every unit in scope now, one collective each, and keeps them
  // gathered until reshard(): forwards and backwards in between gather nothing (e.g. a reference
  // forward with adapters disabled and the policy forward on the same micro-batch). Prefer
  // UnshardScope, which reshards on exit.
  void unshard();
  const dist::DeviceMesh& mesh() const;

 private:
  std::shared_ptr<UnitState> state_;
};

namespace detail {
// `backward_reads_params`: fsdp::backward_reads_params of the module's type.
std::shared_ptr<UnitState> shard_module(const std::shared_ptr<torch::nn::Module>& module,
                                        const dist::DeviceMesh& mesh, const Options& options,
                                        bool backward_reads_params);
// Gathers params, moves the inputs to the mesh's device, casts and wraps them; returns them in
// the same order.
std::vector<torch::Tensor> pre_forward(UnitState& unit, std::vector<torch::Tensor> inputs);
// Wraps outputs so their backward re-gathers, reshards; returns them in the same order.
std::vector<torch::Tensor> post_forward(UnitState& unit, std::vector<torch::Tensor> outputs);

template <class T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, torch::Tensor>;
template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};

template <class T>
void collect_tensors(std::vector<torch::Tensor>& out, const T& value) {
  if constexpr (is_tensor_v<T>) {
    out.push_back(value);
  } else if constexpr (std::is_same_v<std::decay_t<T>, std::vector<torch::Tensor>>) {
    out.insert(out.end(), value.begin(), value.end());
  } else if constexpr (is_tuple<std::decay_t<T>>::value) {
    std::apply([&](const auto&... items) { (collect_tensors(out, items), ...); }, value);
  }
}

template <class T>
void replace_tensors(T& value, const std::vector<torch::Tensor>& with, size_t& next) {
  if constexpr (is_tensor_v<T>) {
    value = with[next++];
  } else if constexpr (std::is_same_v<std::decay_t<T>, std::vector<torch::Tensor>>) {
    for (auto& t : value) t = with[next++];
  } else if constexpr (is_tuple<std::decay_t<T>>::value) {
    std::apply([&](auto&... items) { (replace_tensors(items, with, next), ...); }, value);
  }
}
}  // namespace detail

// A module holder whose call is an FSDP unit boundary once fully_shard() has run on it.
template <class ModuleImpl>
class Unit : public torch::nn::ModuleHolder<ModuleImpl> {
 public:
  using torch::nn::ModuleHolder<ModuleImpl>::ModuleHolder;

  template <class... Args>
  auto operator()(Args&&... args) {
    if (!state_) return this->get()->forward(std::forward<Args>(args)...);
    // Arguments are taken by value so tensors can be swapped for their wrapped versions.
    std::tuple<std::decay_t<Args>...> values(std::forward<Args>(args)...);
    std::vector<torch::Tensor> inputs;
    detail::collect_tensors(inputs, values);
    inputs = detail::pre_forward(*state_, std::move(inputs));
    size_t next = 0;
    detail::replace_tensors(values, inputs, next);
    auto result = std::apply([this](auto&... a) { return this->get()->forward(a...); }, values);
    std::vector<torch::Tensor> outputs;
    detail::collect_tensors(outputs, result);
    outputs = detail::post_forward(*state_, std::move(outputs));
    next = 0;
    detail::replace_tensors(result, outputs, next);
    return result;
  }

  bool is_sharded() const { return state_ != nullptr; }
  FSDPModule fsdp() const {
    TORCH_CHECK(state_, "fsdp(): fully_shard() has not been applied to this module");
    return FSDPModule(state_);
  }

 private:
  template <class M>
  friend void fully_shard(Unit<M>& unit, const dist::DeviceMesh& mesh, const Options& options);
  std::shared_ptr<UnitState> state_;
};

// Scoped FSDPModule::unshard(): one gather of the whole model (when given the root) for
// everything run inside the scope, resharded on exit.
//
//   { fsdp::UnshardScope gathered(model.fsdp());
//     { lora::DisableAdapters off(*model); ref = model(x); }
//     loss_fn(model(x), ref).backward(); }   // the backward gathers nothing either
class UnshardScope {
 public:
  explicit UnshardScope(FSDPModule module);
  ~UnshardScope();
  UnshardScope(const UnshardScope&) = delete;
  UnshardScope& operator=(const UnshardScope&) = delete;

 private:
  FSDPModule module_;
};

// Deferred initialisation: FSDP2 builds a large model on the meta device, shards it, then loads
// it; LibTorch's C++ modules cannot be built on the meta device, so this is the C++ equivalent.
// While an EmptyInit is alive on this thread, new_parameter() gives each param its shape and no
// bytes and skips its initialiser: the model is built without allocating anything unsharded.
// fully_shard() then allocates only this rank's shard of such a param (zeros), and a loader fills
// it (checkpoint::load_hf_from_rank0, load_hf, checkpoint::load). Layers that create their params
// otherwise (LibTorch's own modules, LoRA adapters) allocate and initialise them as usual.
//
//   models::LlamaForCausalLM model{nullptr};
//   { fsdp::EmptyInit empty; model = models::LlamaForCausalLM(config); }
//   models::shard_llama(model, mesh, options);
//   auto sharded = model.fsdp();
//   checkpoint::load_hf_from_rank0(hf_dir, sharded);   // rank 0 reads, the others receive
class EmptyInit {
 public:
  // enabled = false: a scope that changes nothing (for code that builds empty only sometimes).
  explicit EmptyInit(bool enabled = true);
  ~EmptyInit();
  EmptyInit(const EmptyInit&) = delete;
  EmptyInit& operator=(const EmptyInit&) = delete;

 private:
  bool previous_;
};

// A parameter tensor of `shape` (fp32, CPU) filled by `init`; inside an EmptyInit scope, one with
// the shape and no storage bytes, `init` not called.
torch::Tensor new_parameter(c10::IntArrayRef shape,
                            const std::function<void(torch::Tensor&)>& init);

// Whether `param` has elements but no bytes behind them: built under EmptyInit (or an unsharded
// param that fully_shard has freed).
bool has_no_values(const torch::Tensor& param);

// Whether the backward of a module of this type reads the module's own parameters. It does by
// default, and a unit is all-gathered again for its backward, as FSDP2 does. A module whose params
// are only looked up by index specialises this to false: an embedding's weight gradient scatters
// the output's gradient into the rows looked up, and never reads the weight. A unit of such a
// module gathers nothing for its backward and is resharded after forward even where
// reshard_after_forward is false (keeping it would only hold memory). It is a promise of the
// module type: its backward must not reach its params' values (their storage is freed; reading
// it throws), so a module with adapters or a weight tied into another computation must not make it.
template <class ModuleImpl>
struct backward_reads_params : std::true_type {};

// Shards the parameters of `unit` that no already-sharded unit below it owns. Shard children
// first, then the root, as with FSDP2.
template <class M>
void fully_shard(Unit<M>& unit, const dist::DeviceMesh& mesh, const Options& options = {}) {
  TORCH_CHECK(!unit.state_, "fully_shard: this module is already sharded");
  unit.state_ = detail::shard_module(unit.ptr(), mesh, options, backward_reads_params<M>::value);
}

}  // namespace shardrl::fsdp
