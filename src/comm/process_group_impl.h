// Internals shared by the process group and the world that builds it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "compat.h"
#include "shardrl/dist.h"

namespace shardrl::dist {

// Every rank bumps a counter in the store from a background thread. When a collective fails, the
// counters that stopped moving name the dead ranks; a store that stops answering means rank 0,
// which hosts it, is gone. A rank that is merely slow keeps beating and is not blamed.
class Liveness {
 public:
  Liveness(c10::intrusive_ptr<c10d::Store> heartbeat_store,
           c10::intrusive_ptr<c10d::Store> probe_store, int rank, std::chrono::milliseconds period);
  ~Liveness();
  std::string describe_unresponsive(const std::vector<int>& ranks);

 private:
  void beat_loop();
  c10::intrusive_ptr<c10d::Store> heartbeat_store_, probe_store_;
  int rank_;
  std::chrono::milliseconds period_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
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
  std::shared_ptr<Liveness> liveness;
};

}  // namespace shardrl::dist
