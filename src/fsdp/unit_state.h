// The runtime state of one FSDP unit (FSDP2's FSDPParamGroup) and of the root that schedules all
// units of a model (FSDP2's FSDPState of the root).
#pragma once

#include <deque>

#include "fsdp/collectives.h"
#include "fsdp/param_slot.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"

namespace shardrl::fsdp {

class RootContext;

class UnitState {
 public:
  UnitState(std::shared_ptr<torch::nn::Module> module, const dist::DeviceMesh& mesh,
            const Options& options);

  enum class Stage { kSharded, kUnsharding, kUnsharded };

  // Collective steps. Every rank calls them in the same order.
  // Starts the all-gather of the unit's params (prefetch); a no-op unless sharded.
  void unshard();
  // Waits for the all-gather (starting it if nobody prefetched it) and fills the params.
  void wait_for_unshard();
  // `for_backward`: after a forward whose backward will come (post_forward). With the host-shared
  // image the unit then keeps its hold on the gathered rows, and that backward reads them again
  // instead of gathering (FSDP2 gathers again; no rank can change them in between).
  void reshard(bool for_backward = false);
  // Reduce-scatters the unsharded grads (or keeps them under no_sync) and frees them.
  void reduce_grads();

  // Hooks from the autograd graph.
  void pre_backward();
  void post_backward();

  // Throws, naming the unit, once a collective of this model has failed: its buffers were never
  // filled and the ranks' collectives may be out of step, so nothing may run on it again.
  void check_usable() const;

  // Builds the slots and the flat shard from the module's parameters `named`.
  void shard_parameters(const std::vector<std::pair<std::string, torch::Tensor>>& named);
  // The shards as layers above FSDP (offload) see this unit.
  ShardedUnit view() { return ShardedUnit(this); }

  std::shared_ptr<torch::nn::Module> module;
  std::string path;  // where the unit sits in its root ("root", "blocks.1"), for messages
  dist::DeviceMesh mesh;
  Options options;
  std::vector<ParamSlot> params;
  torch::Tensor flat_shard;  // fp32, this rank's shards of every param, back to back
  Stage stage = Stage::kSharded;
  RootContext* root = nullptr;  // set on the root's first forward
  std::unique_ptr<RootContext> owned_root;
  bool is_root = false;
  bool post_backward_done = false;
  bool backward_expected = false;  // its last forward's outputs needed grad: a backward will come
  // fsdp::backward_reads_params of the module's type. false: resharded after every forward, and
  // its backward (the grads of an embedding lookup) runs on the sharded params, gathering nothing.
  bool backward_reads_params = true;
  std::shared_ptr<ShardResidency> residency;  // null: every shard is always resident
  bool held_unsharded = false;  // FSDPModule::unshard(): reshard() keeps the params until released

 private:
  // Forgets an all-gather that will never be read: the unit is sharded, its params unfilled.
  void drop_gather();
  // The params' storage freed; unless `keep_rows`, this rank no longer reads the host-shared
  // image's last gather.
  void free_unsharded(bool keep_rows = false);
  // Backward of a unit parked by reshard(true): its params point at the image's rows again.
  void reuse_parked_gather();
  // Collective, at the unit's first gather: maps the host-shared image where the options and the
  // transport allow it.
  void map_host_image();
  torch::Tensor gather_output_;      // rank-major; undefined when gathering into the params
  bool gathering_in_place_ = false;  // the pending gather writes the params' own storage
  // A no_sync backward ran since the last reduce-scatter: the params' kept sums (in a wider
  // reduce_dtype) go on the wire as they are. The same on every rank, whichever grads it had.
  bool kept_grads_since_reduce_ = false;
  dist::Pending gather_pending_;
  // Where the host's ranks share one image of the unsharded params (Options::host_shared_params):
  // each param's place in it (bytes) and this unit's gathers into it so far. Null: each rank
  // gathers into storage of its own.
  std::shared_ptr<dist::HostImage> image_;
  std::vector<int64_t> image_offsets_;
  uint64_t image_gathers_ = 0;
  bool image_tried_ = false;
  // Resharded after a forward, still holding the image's rows for its backward: the peers do not
  // overwrite them until this rank releases them.
  bool parked_ = false;
};

// Per-model schedule: the units in order, the pending reduce-scatters and the end-of-backward work.
class RootContext {
 public:
  explicit RootContext(UnitState* root);

  std::vector<UnitState*> units;          // root first, then the others in module order
  std::vector<UnitState*> forward_order;  // non-root units in the order this forward ran them
  bool requires_gradient_sync = true;
  bool backward_callback_queued = false;
  int backward_task = -1;  // the autograd graph task finalize_backward is queued on
  // Set by the first collective of this model that failed (the unit, the op, the cause); from
  // then on every unit refuses to run.
  std::string failure;

  // Records a failed collective of `unit` (only the first one counts) and drops the reduce-
  // scatters in flight, which can no longer be trusted.
  void fail(const UnitState& unit, const std::string& op, const std::string& cause);

  void begin_forward();
  void prefetch_after_in_forward(UnitState* unit);
  void prefetch_before_in_backward(UnitState* unit);
  void on_backward_started();
  // A backward that threw never runs its queued finalize_backward (autograd drops the callbacks
  // of a failed graph task). Called when the next forward or backward finds it so: waits for the
  // collectives it started (every rank that threw at the same place started them too, so the
  // ranks stay in step), discards what they reduced and reshards every unit. Grads that reached
  // the grad shards or the unsharded params before the exception stay, as the .grad of an
  // unsharded model keeps what autograd accumulated before it threw; zero_grad() drops them.
  void abandon_stale_backward();
  // Bounded: at most one reduce-scatter stays in flight while the next unit computes.
  void enqueue_reduce(UnitState* unit, dist::Pending pending, std::function<CreatedGrads()> apply);
  void drain_reduces();
  // Runs once the whole backward is done: reduces what no post-backward reduced, drains the
  // reduce-scatters, drops grads no rank had and reshards every unit.
  void finalize_backward();

 private:
  struct InFlightReduce {
    UnitState* unit;
    dist::Pending pending;
    std::function<CreatedGrads()> apply;
  };
  void apply_oldest_reduce();
  // After the reduce-scatters: drops each grad shard this backward created that no rank had a
  // grad for.
  void drop_unused_grads();
  UnitState* root_;
  std::deque<InFlightReduce> reduces_;
  std::vector<CreatedGrads> created_grads_;  // checked once per backward
};

}  // namespace shardrl::fsdp
