// Internals shared by the process group and the world that builds it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "comm/shm_transport.h"
#include "compat.h"
#include "shardrl/dist.h"

namespace shardrl::dist {

// Every rank bumps a counter in the store from a background thread. When a collective fails, the
// counters that stopped moving name the dead ranks; a store that stops answering means rank 0,
// which hosts it, is gone or cut off. A rank that is merely slow keeps beating and is not blamed.
//
// Nothing here waits unboundedly on the store: across hosts a partition leaves a store request
// unanswered for as long as TCP retransmits (a quarter of an hour), and LibTorch's TCPStore bounds
// only get() and wait() by its timeout. So the probe runs on a thread of its own that is abandoned
// when it misses its deadline, and the heartbeat thread is abandoned, not joined, when it is stuck.
class Liveness {
 public:
  Liveness(c10::intrusive_ptr<c10d::Store> heartbeat_store,
           c10::intrusive_ptr<c10d::Store> probe_store, int rank, std::chrono::milliseconds period,
           std::string store_address);
  ~Liveness();
  std::string describe_unresponsive(const std::vector<int>& ranks);

 private:
  // Shared with the heartbeat thread, which may outlive this object.
  struct Beat {
    c10::intrusive_ptr<c10d::Store> store;
    std::mutex mutex;
    std::condition_variable wake;
    bool stop = false, done = false;
  };
  // The heartbeat counts of `ranks`, or nullopt when the store does not answer by the deadline.
  std::optional<std::vector<int64_t>> read_heartbeats(const std::vector<int>& ranks);

  c10::intrusive_ptr<c10d::Store> probe_store_;
  int rank_;
  std::chrono::milliseconds period_;
  std::string store_address_;
  std::shared_ptr<Beat> beat_;
  std::thread thread_;
};

struct ProcessGroup::Impl {
  std::string name;
  int rank = 0;
  std::vector<int> global_ranks;
  c10::intrusive_ptr<compat::Backend> backend;
  int world_rank = 0;
  std::chrono::milliseconds timeout{0};
  bool is_nccl = false;
  // NCCL's device (the rank's cuda:LOCAL_RANK), through which host tensors are staged.
  torch::Device device{torch::kCPU};

  // NCCL moves GPU memory only. A host tensor (a count, a metric, a flag) goes through the
  // group's device and back, so callers need not know the backend.
  torch::Tensor staged(const torch::Tensor& tensor) const {
    return is_nccl && tensor.is_cpu() ? tensor.to(device) : tensor;
  }
  // The bulk collectives of a CPU group whose ranks share a host; null: they go through Gloo.
  std::unique_ptr<ShmTransport> shm;
  std::string no_shm_because;  // why a CPU group of several ranks has no shm
  bool failed = false;         // a collective failed: the transport is abandoned, not torn down
  std::shared_ptr<Liveness> liveness;
};

}  // namespace shardrl::dist
