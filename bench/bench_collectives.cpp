// Gloo collectives on this LibTorch: every way of doing FSDP's all-gather and reduce-scatter, on
// the same buffers in the same run, beside ShardRL's ProcessGroup (shared memory between ranks of
// one host; with SHARDRL_SHM_DISABLE=1, the Gloo method it picks for each).
//
//   build/bin/shardrl launch -n 2 --threads 1 -- build/bin/bench_collectives --json-out c.json
//
// Rank 0 writes the medians (ms) per size, dtype and method. Every method moves the same payload;
// bf16 rows show what halving the bytes on the wire buys. Timing is a benchmark, never a test.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>

#include "compat.h"
#include "shardrl/dist.h"

#include "stats.h"

using namespace shardrl;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

using shardrl::bench::median;

// A Gloo backend of its own, beside the World's, so the raw c10d methods can be timed.
c10::intrusive_ptr<c10d::Backend> raw_gloo(int rank, int size) {
  const char* addr = std::getenv("MASTER_ADDR");
  const std::string master = addr ? addr : "127.0.0.1";
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(std::stoi(std::getenv("MASTER_PORT")));
  o.isServer = false;
  o.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>(master, o);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("bench_collectives/", store);
  return compat::make_gloo(prefixed, rank, size, std::chrono::seconds(120), master);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Gloo all-gather and reduce-scatter methods, 2+ ranks"};
  std::vector<int64_t> mib = {4, 64};
  int reps = 7;
  std::string json_out;
  app.add_option("--mib", mib, "Payload sizes in MiB of fp32 (the reduce-scatter input)");
  app.add_option("--reps", reps, "Timed repetitions per method (median reported)");
  app.add_option("--json-out", json_out);
  CLI11_PARSE(app, argc, argv);

  auto world = dist::World::init_from_env();
  auto& group = world->group();
  const int n = world->size(), rank = world->rank();
  auto gloo = raw_gloo(rank, n);
  json results = json::array();

  for (int64_t size_mib : mib) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      // The payload is the full (reduce-scatter input / all-gather output) tensor.
      const int64_t total = size_mib * (1 << 20) / 4;
      const int64_t chunk = total / n;
      auto full = torch::randn({total}).to(dtype);
      auto shard = full.narrow(0, rank * chunk, chunk).clone();
      auto out_shard = torch::empty({chunk}, full.options());
      auto out_full = torch::empty({total}, full.options());

      auto time = [&](const std::string& op, const std::string& method,
                      const std::function<void()>& run) {
        run();  // warm-up
        std::vector<double> ms;
        for (int r = 0; r < reps; ++r) {
          group.barrier();
          const auto t0 = Clock::now();
          run();
          ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
        json row = {{"op", op},
                    {"method", method},
                    {"dtype", dtype == torch::kFloat ? "fp32" : "bf16"},
                    {"payload_mib", static_cast<double>(total) * full.element_size() / (1 << 20)},
                    {"median_ms", median(ms)}};
        if (rank == 0) std::cout << row.dump() << std::endl;
        results.push_back(row);
      };

      time("reduce_scatter", "_reduce_scatter_base",
           [&] { gloo->_reduce_scatter_base(out_shard, full, {})->wait(); });
      time("reduce_scatter", "alltoall_base+local_sum", [&] {
        auto received = torch::empty_like(full);
        std::vector<int64_t> equal;
        gloo->alltoall_base(received, full, equal, equal, {})->wait();
        out_shard.copy_(received.view({n, chunk}).to(torch::kFloat).sum(0));
      });
      time("reduce_scatter", "allreduce+slice", [&] {
        std::vector<at::Tensor> t{full.clone()};
        gloo->allreduce(t, {})->wait();
        out_shard.copy_(t[0].narrow(0, rank * chunk, chunk));
      });
      time("reduce_scatter", "shardrl (" + group.bulk_transport() + ")",
           [&] { group.reduce_scatter(full, out_shard); });

      time("all_gather", "_allgather_base",
           [&] { gloo->_allgather_base(out_full, shard, {})->wait(); });
      time("all_gather", "list_allgather", [&] {
        std::vector<std::vector<at::Tensor>> outs(1);
        for (int r = 0; r < n; ++r) outs[0].push_back(out_full.narrow(0, r * chunk, chunk));
        std::vector<at::Tensor> in{shard};
        gloo->allgather(outs, in, {})->wait();
      });
      time("all_gather", "broadcasts_into_views", [&] {
        out_full.narrow(0, rank * chunk, chunk).copy_(shard);
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        std::vector<std::vector<at::Tensor>> views(n);
        for (int r = 0; r < n; ++r) {
          views[r] = {out_full.narrow(0, r * chunk, chunk)};
          c10d::BroadcastOptions o;
          o.rootRank = r;
          works.push_back(gloo->broadcast(views[r], o));
        }
        for (auto& w : works) w->wait();
      });
      time("all_gather", "shardrl (" + group.bulk_transport() + ")",
           [&] { group.all_gather(shard, out_full); });
    }
  }
  if (rank == 0 && !json_out.empty()) {
    std::ofstream(json_out) << json{{"world_size", n}, {"results", results}}.dump(2) << "\n";
  }
  group.barrier();
  return 0;
}
