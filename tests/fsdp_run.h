// Training the shared scenario on real ranks (dist_worker) and reading back what it wrote.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "test_util.h"
#include "workers/param_files.h"
#include "workers/scenario.h"

namespace shardrl::testing {

struct Run {
  std::vector<double> losses, grad_norms, bytes;
  std::vector<bool> skipped;
  std::map<std::string, torch::Tensor> params;
  std::vector<nlohmann::json> memory;
  // Per rank, with --trace: per step, the FSDP schedule's events (fsdp/trace.h) in order.
  std::vector<nlohmann::json> traces;
};

inline std::vector<std::string> scenario_args(const Scenario& s) {
  std::vector<std::string> args = {
      "--steps",    std::to_string(s.steps),    "--batch", std::to_string(s.batch),
      "--seq",      std::to_string(s.seq),      "--micro", std::to_string(s.micro),
      "--layers",   std::to_string(s.layers),   "--lr",    std::to_string(s.lr),
      "--max-norm", std::to_string(s.max_norm), "--seed",  std::to_string(s.seed)};
  if (s.unused_params) args.push_back("--unused-params");
  if (!s.freeze.empty()) args.insert(args.end(), {"--freeze", s.freeze});
  if (s.nan_step >= 0) args.insert(args.end(), {"--nan-step", std::to_string(s.nan_step)});
  return args;
}

// `env`: for the ranks, e.g. SHARDRL_SHM_DISABLE=1 (Gloo, the transport between hosts).
inline Run train_sharded(int nproc, const Scenario& s, const std::vector<std::string>& extra = {},
                         const std::map<std::string, std::string>& env = {}) {
  const std::string dir = make_temp_dir("fsdp");
  std::vector<std::string> args = {"train", "--out", dir};
  auto scenario = scenario_args(s);
  args.insert(args.end(), scenario.begin(), scenario.end());
  args.insert(args.end(), extra.begin(), extra.end());
  auto result = launch_workers(nproc, args, 300, "dist_worker", env);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  Run run;
  if (result.exit_code != 0) return run;
  auto summary = nlohmann::json::parse(std::ifstream(dir + "/losses.json"));
  // JSON has no NaN: the worker's NaN losses and norms arrive as null.
  auto numbers = [](const nlohmann::json& values) {
    std::vector<double> out;
    for (const auto& v : values) out.push_back(v.is_null() ? std::nan("") : v.get<double>());
    return out;
  };
  run.losses = numbers(summary["loss"]);
  run.grad_norms = numbers(summary["grad_norm"]);
  run.bytes = summary["bytes_sent"].get<std::vector<double>>();
  run.skipped = summary["skipped"].get<std::vector<bool>>();
  run.params = read_params(dir);
  for (int r = 0; r < nproc; ++r) {
    run.memory.push_back(
        nlohmann::json::parse(std::ifstream(dir + "/memory_" + std::to_string(r) + ".json")));
    std::ifstream trace(dir + "/trace_" + std::to_string(r) + ".json");
    if (trace) run.traces.push_back(nlohmann::json::parse(trace));
  }
  return run;
}

}  // namespace shardrl::testing
