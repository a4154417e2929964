// The runtime state of one FSDP unit and of the root that schedules all units of a model.
#pragma once

#include <deque>

#include "shardrl/dist.h"
#include "shardrl/fsdp.h"

namespace shardrl::fsdp {

// Where one parameter lives: in the unit's flat shard buffer and, unsharded, in the module.
struct ParamSlot {
  std::string name;         // relative to the unit's module
  torch::Tensor unsharded;  // the module's parameter; its storage is freed while sharded
  std::vector<int64_t> shape;
  int64_t rows = 1;        // dim 0 (1 for scalars)
  int64_t row_numel = 1;   // elements per dim-0 row
  int64_t chunk_rows = 1;  // rows per rank, padded: ceil(rows / N)
  int64_t shard_numel() const { return chunk_rows * row_numel; }
  int64_t offset = 0;          // of this param's shard in the unit's flat shard buffer
  torch::Tensor shard;         // fp32 leaf view into the flat buffer, [chunk_rows, ...]
  bool awaiting_load = false;  // created under EmptyInit; its shard holds no values yet
  int64_t valid_rows_on(int rank) const {
    return std::max<int64_t>(0, std::min(chunk_rows, rows - rank * chunk_rows));
  }
};

class RootContext;
class UnitState;

// Where a unit's sharded state lives while the offload layer keeps it out of compute memory.
// FSDP asks for it only where it reads or writes the shards; the offload layer implements it.
class ShardResidency {
 public:
  virtual ~ShardResidency() = default;
  // This rank's flat shard in compute memory as the all-gather input: the shard itself, or a
  // temporary copy while the shard stays offloaded.
  virtual torch::Tensor gather_input(UnitState& unit) = 0;
  // Brings what `use` needs into compute memory; release() sends it back where it belongs.
  virtual void acquire(UnitState& unit, ShardUse use) = 0;
  virtual void release(UnitState& unit, ShardUse use) = 0;
};

class UnitState {
 public:
  UnitState(std::shared_ptr<torch::nn::Module> module, const dist::DeviceMesh& mesh,
            const Options& options);

  enum class Stage { kSharded, kGathering, kUnsharded };

  // Collective steps. Every rank calls them in the same order.
  void start_gather();
  // Waits for the all-gather (starting it if nobody prefetched it) and fills the params.
  void finish_gather();
  void reshard();
  // Reduce-scatters the unsharded grads (or keeps them under no_sync) and frees them.
  void reduce_grads();

  // Hooks from the autograd graph.
  void pre_backward();
  void post_backward();

  std::shared_ptr<torch::nn::Module> module;
  dist::DeviceMesh mesh;
  Options options;
  std::vector<ParamSlot> params;
  torch::Tensor flat_shard;  // fp32, this rank's shards of every param, back to back
  // Builds the slots and the flat shard from the module's parameters `named`.
  void shard_parameters(const std::vector<std::pair<std::string, torch::Tensor>>& named);
  Stage stage = Stage::kSharded;
  RootContext* root = nullptr;  // set on the root's first forward
  std::unique_ptr<RootContext> owned_root;
  bool is_root = false;
  bool post_backward_done = false;
  std::shared_ptr<ShardResidency> residency;  // null: every shard is always resident
  bool held_unsharded = false;  // FSDPModule::unshard(): reshard() keeps the params until released

 private:
  torch::Tensor gather_output_;
  dist::Pending gather_pending_;
};

// Per-model schedule: the units in order, the pending reduce-scatters and the end-of-backward work.
class RootContext {
 public:
  explicit RootContext(UnitState* root);

  std::vector<UnitState*> units;          // root first, then the others in module order
  std::vector<UnitState*> forward_order;  // non-root units in the order this forward ran them
  bool requires_gradient_sync = true;
  bool backward_callback_queued = false;

  void begin_forward();
  void prefetch_after_in_forward(UnitState* unit);
  void prefetch_before_in_backward(UnitState* unit);
  void on_backward_started();
  // Bounded: at most one reduce-scatter stays in flight while the next unit computes.
  void enqueue_reduce(dist::Pending pending, std::function<void()> apply);
  void drain_reduces();
  void finish_backward();

 private:
  struct InFlightReduce {
    dist::Pending pending;
    std::function<void()> apply;
  };
  UnitState* root_;
  std::deque<InFlightReduce> reduces_;
};

}  // namespace shardrl::fsdp
