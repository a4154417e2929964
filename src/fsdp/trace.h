// A record of the FSDP schedule, for tests: when each unit's all-gather is issued and waited for,
// when its forward and backward compute start and end, when its reduce-scatter is issued, and the
// dtypes and bytes of its collectives. Results alone
// cannot show that prefetch overlaps a gather with compute, that params really compute in bf16 or
// that no_sync defers gradient sync to the last micro-batch; the order of these events can. Off
// unless a test turns it on: then each event is one push under a mutex; off, each call site costs a
// call and one relaxed atomic load. Internal: test workers include it.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace shardrl::fsdp {
class UnitState;
}

namespace shardrl::fsdp::trace {

enum class Event {
  kGatherIssued,  // the unit's all-gather was started (by prefetch or by its own forward)
  kGatherWaited,  // its output arrived and was copied into the params
  // Its backward reads the rows its forward gathered into the host-shared image (which no rank
  // overwrote since): no collective (Options::host_shared_params).
  kGatherReused,
  kForwardBegin,   // the unit's own forward compute starts (params gathered, inputs cast)
  kForwardEnd,     // its forward compute has ended
  kBackwardBegin,  // its backward compute starts (params gathered again)
  kBackwardEnd,    // its backward compute has ended (before its reduce-scatter)
  // The unit's grads were packed and their reduce-scatter started: with gradient sync on, in
  // its post-backward or at the end of the backward. A unit with no trainable param has none.
  kReduceScatterIssued,
};

struct Record {
  Event event;
  // The unit's place in its root's schedule: 0 the root, then the others in module order; -1
  // before the root's first forward found its units.
  int unit = -1;
  // k*Issued: the collective's dtype. The others: the dtype every unsharded param of the unit has
  // (Undefined if they differ).
  torch::ScalarType dtype = torch::ScalarType::Undefined;
  // k*Issued: the bytes the shard group's process group counted for the collective.
  uint64_t bytes = 0;
  // The others: whether every unsharded param of the unit holds its full storage (is gathered).
  bool gathered = false;
};

void set_enabled(bool on);
bool enabled();
// Records `event` for `unit`; `dtype` and `bytes` as Record says for the k*Issued events.
void record(Event event, const UnitState& unit,
            torch::ScalarType dtype = torch::ScalarType::Undefined, uint64_t bytes = 0);
// The records so far, in order, and a fresh start.
std::vector<Record> take();
const char* name(Event event);

}  // namespace shardrl::fsdp::trace
