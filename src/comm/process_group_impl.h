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
// counters that stopped moving name the dead ranks; a store that stops answering means its host
// (rank 0, or torchrun's agent) is gone or cut off. A rank that is merely slow keeps beating and
// is not blamed.
//
// Nothing here waits unboundedly on the store: across hosts a partition leaves a store request
// unanswered for as long as TCP retransmits (a quarter of an hour), and LibTorch's TCPStore bounds
// only get() and wait() by its timeout. So every request runs on a thread of its own that is
// abandoned when it misses its deadline, and the heartbeat thread is abandoned, not joined, when
// it is stuck.
//
// At the end each rank stops beating and checks out. Where rank 0 hosts the store, it stays until
// every other rank has checked out or died, for a few seconds at most: a rank left beating against
// a store that is gone gets LibTorch's lost-connection warning with a stack trace at the end of a
// job that succeeded, and one still diagnosing a failure could no longer read the heartbeats. The
// bound keeps a rank 0 that failed alone from holding the job (and the launcher, which stops the
// others once it exits) for long.
class Liveness {
 public:
  struct Options {
    int rank = 0;
    int world_size = 1;
    bool hosts_store = false;  // this rank is the store's server (rank 0 without torchrun's agent)
    std::chrono::milliseconds period{250};
    std::string store_address;  // host:port, for messages
    std::string store_host;     // who hosts it ("rank 0"), for messages
  };
  Liveness(c10::intrusive_ptr<c10d::Store> heartbeat_store,
           c10::intrusive_ptr<c10d::Store> probe_store, Options options);
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
  // The counters `name`/r of `ranks`, or nullopt when the store does not answer by the deadline.
  std::optional<std::vector<int64_t>> read_counters(const char* name,
                                                    const std::vector<int>& ranks);
  void stop_beating();
  // This rank is done with the store; its host waits for the others (above).
  void check_out();

  c10::intrusive_ptr<c10d::Store> probe_store_;
  Options options_;
  std::shared_ptr<Beat> beat_;
  std::thread thread_;
  // A collective of this rank failed: the job is over, and describe_unresponsive already gave the
  // peers diagnosing the same loss their window, so the store's host leaves at once.
  std::atomic<bool> failure_seen_{false};
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
