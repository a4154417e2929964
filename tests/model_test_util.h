// Shared by the model tests: starting a model worker on N ranks and reading back what it wrote.
#pragma once

#include <torch/torch.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "test_util.h"
#include "workers/param_files.h"

namespace shardrl::testing {

// `shardrl launch -n N -- <worker> args...`, one compute thread per rank.
inline ProcessResult launch_worker(const std::string& worker, int nproc,
                                   const std::vector<std::string>& args, double timeout_s = 300) {
  std::vector<std::string> argv = {bin("shardrl"), "launch",   "-n",      std::to_string(nproc),
                                   "--threads",    "1",        "--grace", "20",
                                   "--",           bin(worker)};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, timeout_s);
}

inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-12)).item<double>();
}

// Debian's python3-torch: the independent reference the model tests compare against.
inline ProcessResult run_python_reference(const std::string& script,
                                          const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/usr/bin/python3",
                                   std::string(SHARDRL_SOURCE_DIR) + "/tests/python/" + script};
  argv.insert(argv.end(), args.begin(), args.end());
  // No __pycache__ in the source tree.
  return run_process(argv, {{"OMP_NUM_THREADS", "1"}, {"PYTHONDONTWRITEBYTECODE", "1"}}, 300);
}

}  // namespace shardrl::testing
