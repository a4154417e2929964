// Local multi-process launcher: `shardrl launch -n N -- cmd...`, the torchrun of ShardRL.
#pragma once

#include <string>
#include <vector>

namespace shardrl::dist {

struct LaunchOptions {
  int nproc = 1;        // local ranks to start
  int master_port = 0;  // 0: pick a free port on master_addr
  std::string master_addr = "127.0.0.1";
  int threads_per_rank = 0;          // 0: max(1, cores / nproc), unless OMP_NUM_THREADS is set
  double grace_seconds = 5.0;        // after a rank fails, time the others get to report an error
  std::vector<std::string> command;  // argv of every rank
  int stdout_fd = 1;                 // where prefixed rank output goes (tests redirect it)
  int stderr_fd = 2;
};

// Starts `nproc` copies of `command` with the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and per-rank thread limits, prefixes their output
// with "[rank K] ", and stops the others when one fails. Returns 0 when every rank exited 0,
// else the failing rank's exit code (128 + signal for a signal), never 0.
int launch(const LaunchOptions& options);

}  // namespace shardrl::dist
