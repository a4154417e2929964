#include "fsdp/trace.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

#include "fsdp/unit_state.h"

namespace shardrl::fsdp::trace {
namespace {

std::atomic<bool> g_enabled{false};
std::mutex g_mutex;
std::vector<Record> g_records;

}  // namespace

void set_enabled(bool on) {
  g_enabled.store(on, std::memory_order_relaxed);
}

bool enabled() {
  return g_enabled.load(std::memory_order_relaxed);
}

void record(Event event, const UnitState& unit, torch::ScalarType dtype, uint64_t bytes) {
  if (!enabled()) return;
  Record r;
  r.event = event;
  if (unit.root) {
    const auto& units = unit.root->units;
    auto it = std::find(units.begin(), units.end(), &unit);
    if (it != units.end()) r.unit = static_cast<int>(it - units.begin());
  }
  if (event == Event::kGatherIssued || event == Event::kReduceScatterIssued) {
    r.dtype = dtype;
    r.bytes = bytes;
  } else {
    r.gathered = true;
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const torch::Tensor& p = unit.params[k].unsharded();
      if (k == 0) r.dtype = p.scalar_type();
      if (p.scalar_type() != r.dtype) r.dtype = torch::ScalarType::Undefined;
      r.gathered &= p.storage().nbytes() >= static_cast<size_t>(p.numel()) * p.element_size();
    }
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records.push_back(r);
}

std::vector<Record> take() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return std::exchange(g_records, {});
}

const char* name(Event event) {
  switch (event) {
    case Event::kGatherIssued:
      return "gather_issued";
    case Event::kGatherWaited:
      return "gather_waited";
    case Event::kGatherReused:
      return "gather_reused";
    case Event::kForwardBegin:
      return "forward_begin";
    case Event::kForwardEnd:
      return "forward_end";
    case Event::kBackwardBegin:
      return "backward_begin";
    case Event::kBackwardEnd:
      return "backward_end";
    case Event::kReduceScatterIssued:
      return "reduce_scatter_issued";
  }
  return "?";
}

}  // namespace shardrl::fsdp::trace
