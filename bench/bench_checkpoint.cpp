// Checkpoint benchmark: sharded save and load throughput against a plain sequential write and read
// of the same bytes on the same disk in the same run, and per-rank memory during the consolidated
// export, the streaming weight sync and the initialisation from the exported model (load_hf, every
// rank reading, against load_hf_from_rank0; then a fresh model built as usual against one built
// under fsdp::EmptyInit) against one full tensor and the rank's shards. Run one process per rank:
//
//   shardrl launch -n 2 --threads 1 -- build/bin/bench_checkpoint --json-out ckpt.json
//
// Reads right after a write come from the page cache; every read is therefore measured twice, warm
// (as written) and cold (after posix_fadvise(DONTNEED) on every file), for the checkpoint and for
// the baseline alike. The baseline reads into one reused 16 MiB buffer; a second plain read into
// freshly mapped memory shows what faulting in new memory, which a load cannot avoid, costs.
// Timing is a benchmark, never a test: it depends on the machine being quiet.
#include <fcntl.h>
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "rss.h"
#include "shardrl/checkpoint.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/models/transformer.h"
#include "shardrl/optim.h"

using namespace shardrl;
using namespace shardrl::bench;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Args {
  int64_t d_model = 1024, layers = 7, heads = 16, vocab = 32000, seq = 128;
  int threads = 0, sample_ms = 2;
  int64_t chunk_mib = 16;
  std::string dir = "/tmp/shardrl-ckpt-bench", json_out;
  bool keep = false;
};

constexpr uint64_t kModelSeed = 1234;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Samples VmRSS every few milliseconds on a thread while alive; reports the peak.
class RssSampler {
 public:
  explicit RssSampler(int period_ms) : peak_(rss_bytes()) {
    thread_ = std::thread([this, period_ms] {
      while (!stop_.load()) {
        note(rss_bytes());
        std::this_thread::sleep_for(std::chrono::milliseconds(period_ms));
      }
    });
  }
  ~RssSampler() { stop(); }
  void note(int64_t rss) {
    int64_t seen = peak_.load();
    while (rss > seen && !peak_.compare_exchange_weak(seen, rss)) {
    }
  }
  int64_t stop() {
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
    }
    note(rss_bytes());
    return peak_.load();
  }

 private:
  std::atomic<int64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

void drop_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  ::fdatasync(fd);  // clean pages only can be dropped
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void drop_page_cache_tree(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) drop_page_cache(e.path().string());
  }
}

// The baseline: `bytes` written sequentially with write() from one reused buffer, then fsync.
void plain_write(const std::string& path, int64_t bytes, std::vector<char>& buffer) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path);
  int64_t left = bytes;
  while (left > 0) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(left, buffer.size()));
    const ssize_t done = ::write(fd, buffer.data(), n);
    if (done <= 0) throw std::runtime_error("write failed on " + path);
    left -= done;
  }
  if (::fsync(fd) != 0) throw std::runtime_error("fsync failed on " + path);
  ::close(fd);
}

// The baseline: the whole file read sequentially with read() into one reused buffer.
int64_t plain_read(const std::string& path, std::vector<char>& buffer) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  int64_t total = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) throw std::runtime_error("read failed on " + path);
    if (n == 0) break;
    total += n;
  }
  ::close(fd);
  return total;
}

// The same read into freshly mapped memory, as a load fills fresh tensors: every page is faulted
// in during the read. Returns the mapping so that unmapping it stays outside the timing.
std::pair<char*, int64_t> plain_read_fresh(const std::string& path, int64_t bytes) {
  void* mapped = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw std::runtime_error("cannot map a read buffer");
  char* data = static_cast<char*>(mapped);
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  int64_t total = 0;
  while (total < bytes) {
    const ssize_t n =
        ::read(fd, data + total, static_cast<size_t>(std::min<int64_t>(bytes - total, 1 << 30)));
    if (n < 0) throw std::runtime_error("read failed on " + path);
    if (n == 0) break;
    total += n;
  }
  ::close(fd);
  return {data, total};
}

models::TransformerConfig model_config(const Args& a) {
  models::TransformerConfig c;
  c.d_model = a.d_model;
  c.n_layers = a.layers;
  c.n_heads = a.heads;
  c.vocab_size = a.vocab;
  c.max_seq_len = a.seq;
  return c;
}

double gb(double bytes) {
  return bytes / 1e9;
}

int run(const Args& a) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  if (a.threads > 0) at::set_num_threads(a.threads);
  const int N = world->size(), rank = world->rank();
  auto& group = world->group();
  torch::NoGradGuard no_grad;

  const auto config = model_config(a);
  torch::manual_seed(kModelSeed);
  models::Transformer model(config);
  models::shard_transformer(model, mesh, fsdp::Options{});
  // Construction allocates the whole model on every rank before sharding frees it: this is the
  // peak that construction sets, whatever the load does later.
  const int64_t hwm_after_shard = proc_status_bytes("VmHWM");
  auto fsdp_model = model.fsdp();
  const int64_t shard_bytes = fsdp_model.memory().sharded_param_bytes;
  const auto shards = fsdp_model.sharded_parameters();
  auto optimizer = optim::make_adamw(optim::from_sharded(shards), optim::AdamWConfig{});

  // One AdamW step on random gradients so that both moments exist (padding rows stay zero).
  int64_t largest_numel = 0;
  std::string largest_name;
  for (const auto& p : shards) {
    auto grad = torch::randn_like(p.shard).mul_(1e-3);
    if (p.shard.dim() > 0 && p.valid_rows < p.shard.size(0)) {
      grad.narrow(0, p.valid_rows, p.shard.size(0) - p.valid_rows).zero_();
    }
    p.shard.mutable_grad() = grad;
    const int64_t numel = c10::multiply_integers(p.global_shape);
    if (numel > largest_numel) {
      largest_numel = numel;
      largest_name = p.name;
    }
  }
  optimizer->step();
  fsdp_model.zero_grad();
  const int64_t state_bytes = config.parameter_count() * 12;  // fp32 params + two fp32 moments

  if (rank == 0) {
    fs::remove_all(a.dir);
    fs::create_directories(a.dir);
  }
  group.barrier();
  std::vector<char> buffer(static_cast<size_t>(a.chunk_mib) << 20, '\x5a');

  // ---- save --------------------------------------------------------------------------------
  const int64_t step = 1;
  group.barrier();
  auto t0 = Clock::now();
  const std::string ckpt = checkpoint::save(a.dir, step, fsdp_model, *optimizer, nullptr,
                                            {{"config", config.to_json()}});
  group.barrier();
  const double save_s = seconds_since(t0);
  const int64_t ckpt_bytes = checkpoint::directory_bytes(ckpt);

  // This rank's share of the checkpoint's bytes: its own files; rank 0 also the index.
  int64_t others = 0, mine = 0;
  for (int r = 0; r < N; ++r) {
    int64_t bytes = 0;
    for (const char* kind : {"model", "optim"}) {
      bytes += static_cast<int64_t>(fs::file_size(
          fs::path(ckpt) / (std::string(kind) + "_rank" + std::to_string(r) + ".safetensors")));
    }
    if (r == rank) mine = bytes;
    if (r != 0) others += bytes;
  }
  if (rank == 0) mine = ckpt_bytes - others;

  // ---- baseline write ----------------------------------------------------------------------
  const std::string base_file =
      (fs::path(a.dir) / ("baseline_rank" + std::to_string(rank) + ".bin")).string();
  group.barrier();
  t0 = Clock::now();
  plain_write(base_file, mine, buffer);
  group.barrier();
  const double base_write_s = seconds_since(t0);

  // ---- reads: warm (page cache as left by the writes), then cold --------------------------
  double base_read_s[2] = {0, 0}, fresh_read_s[2] = {0, 0}, load_s[2] = {0, 0};
  int64_t loaded_step = -1;
  for (int cold = 0; cold < 2; ++cold) {
    if (cold) {
      drop_page_cache(base_file);
      if (rank == 0) drop_page_cache_tree(ckpt);
    }
    group.barrier();
    t0 = Clock::now();
    const int64_t got = plain_read(base_file, buffer);
    group.barrier();
    base_read_s[cold] = seconds_since(t0);
    if (got != mine) throw std::runtime_error("baseline read short");
    if (cold) drop_page_cache(base_file);
    group.barrier();
    t0 = Clock::now();
    const auto [fresh, fresh_got] = plain_read_fresh(base_file, mine);
    group.barrier();
    fresh_read_s[cold] = seconds_since(t0);
    ::munmap(fresh, static_cast<size_t>(mine));
    if (fresh_got != mine) throw std::runtime_error("baseline read short");
    if (cold) drop_page_cache(base_file);  // keep the cache state the same for the load
    group.barrier();
    t0 = Clock::now();
    loaded_step = checkpoint::load(ckpt, fsdp_model, optimizer.get(), nullptr).step;
    group.barrier();
    load_s[cold] = seconds_since(t0);
  }

  // ---- export on rank 0 --------------------------------------------------------------------
  double export_s = 0;
  int64_t export_rss_before = 0, export_rss_peak = 0, export_bytes = 0;
  group.barrier();
  if (rank == 0) {
    const std::string out = (fs::path(a.dir) / "export").string();
    export_rss_before = trimmed_rss();
    RssSampler sampler(a.sample_ms);
    t0 = Clock::now();
    checkpoint::export_hf(ckpt, out, checkpoint::ExportOptions{});
    export_s = seconds_since(t0);
    export_rss_peak = sampler.stop();
    export_bytes = checkpoint::directory_bytes(out);
  }
  group.barrier();

  // ---- initialisation from the exported (bf16) model, all ranks ------------------------------
  const std::string hf_dir = (fs::path(a.dir) / "export").string();
  auto measure_init = [&](bool from_rank0) {
    const int64_t before = trimmed_rss();
    RssSampler sampler(a.sample_ms);
    group.barrier();
    const auto start = Clock::now();
    if (from_rank0) {
      checkpoint::load_hf_from_rank0(hf_dir, fsdp_model);
    } else {
      checkpoint::load_hf(hf_dir, fsdp_model);
    }
    group.barrier();
    const double seconds = seconds_since(start);
    return std::pair<double, int64_t>(seconds, sampler.stop() - before);
  };
  const auto [init_all_s, init_all_inc] = measure_init(false);
  const auto [init_r0_s, init_r0_inc] = measure_init(true);

  // ---- streaming weight sync, all ranks ----------------------------------------------------
  const int64_t sync_rss_before = trimmed_rss();
  int64_t sync_tensors = 0, sync_bytes = 0;
  double sync_s = 0;
  int64_t sync_rss_peak = 0;
  {
    RssSampler sampler(a.sample_ms);
    group.barrier();
    t0 = Clock::now();
    checkpoint::for_each_full_parameter(fsdp_model, torch::kBFloat16, "",
                                        [&](const std::string&, const torch::Tensor& t) {
                                          sampler.note(rss_bytes());
                                          ++sync_tensors;
                                          sync_bytes += t.numel() * t.element_size();
                                        });
    group.barrier();
    sync_s = seconds_since(t0);
    sync_rss_peak = sampler.stop();
  }

  // ---- a fresh model initialised from the export: built as usual, then under EmptyInit -------
  // Peak RSS over the phase (VmHWM reset through /proc/self/clear_refs), above the RSS before it.
  auto init_fresh = [&](bool empty) {
    group.barrier();
    const int64_t before = trimmed_rss();
    reset_peak_rss();
    const auto start = Clock::now();
    {
      models::Transformer fresh{nullptr};
      if (empty) {
        fsdp::EmptyInit no_allocation;
        fresh = models::Transformer(config);
      } else {
        fresh = models::Transformer(config);
      }
      models::shard_transformer(fresh, mesh, fsdp::Options{});
      auto fresh_fsdp = fresh.fsdp();
      checkpoint::load_hf_from_rank0(hf_dir, fresh_fsdp);
      group.barrier();
    }
    const double seconds = seconds_since(start);
    return std::pair<double, int64_t>(seconds, proc_status_bytes("VmHWM") - before);
  };
  const auto [fresh_eager_s, fresh_eager_inc] = init_fresh(false);
  const auto [fresh_empty_s, fresh_empty_inc] = init_fresh(true);

  // Per-rank figures to rank 0: [rank][field].
  constexpr int kFields = 14;
  auto per_rank = torch::zeros({N, kFields}, torch::kDouble);
  per_rank[rank][0] = static_cast<double>(mine);
  per_rank[rank][1] = static_cast<double>(sync_rss_before);
  per_rank[rank][2] = static_cast<double>(sync_rss_peak);
  per_rank[rank][3] = static_cast<double>(proc_status_bytes("VmHWM"));
  per_rank[rank][4] = static_cast<double>(shard_bytes);
  per_rank[rank][5] = static_cast<double>(hwm_after_shard);
  per_rank[rank][6] = init_all_s;
  per_rank[rank][7] = static_cast<double>(init_all_inc);
  per_rank[rank][8] = init_r0_s;
  per_rank[rank][9] = static_cast<double>(init_r0_inc);
  per_rank[rank][10] = fresh_eager_s;
  per_rank[rank][11] = static_cast<double>(fresh_eager_inc);
  per_rank[rank][12] = fresh_empty_s;
  per_rank[rank][13] = static_cast<double>(fresh_empty_inc);
  group.all_reduce(per_rank);

  if (!a.keep) {
    group.barrier();
    if (rank == 0) fs::remove_all(a.dir);
  }
  if (rank != 0) {
    group.barrier();
    return 0;
  }

  const double full_fp32 = 4.0 * largest_numel, full_bf16 = 2.0 * largest_numel;
  const double B = static_cast<double>(ckpt_bytes);
  const double save_gbps = gb(B) / save_s, base_write_gbps = gb(B) / base_write_s;
  json reads = json::object();
  for (int cold = 0; cold < 2; ++cold) {
    const double l = gb(B) / load_s[cold], b = gb(B) / base_read_s[cold];
    reads[cold ? "cold" : "warm"] = {
        {"load_s", load_s[cold]},
        {"load_gbps", l},
        {"baseline_read_s", base_read_s[cold]},
        {"baseline_read_gbps", b},
        {"ratio_load_to_baseline", l / b},
        {"fresh_memory_read_s", fresh_read_s[cold]},
        {"ratio_load_to_fresh_memory_read", fresh_read_s[cold] / load_s[cold]}};
  }
  json ranks = json::array();
  double sync_worst = 0;
  for (int r = 0; r < N; ++r) {
    const double inc = per_rank[r][2].item<double>() - per_rank[r][1].item<double>();
    sync_worst = std::max(sync_worst, inc);
    ranks.push_back(
        {{"rank", r},
         {"checkpoint_bytes", per_rank[r][0].item<double>()},
         {"sync_rss_before", per_rank[r][1].item<double>()},
         {"sync_rss_peak", per_rank[r][2].item<double>()},
         {"sync_rss_increase", inc},
         {"sync_rss_increase_over_full_fp32", inc / full_fp32},
         {"sync_rss_increase_over_full_bf16", inc / full_bf16},
         {"vm_hwm_end", per_rank[r][3].item<double>()},
         {"sharded_param_bytes", per_rank[r][4].item<double>()},
         {"vm_hwm_after_construction_and_sharding", per_rank[r][5].item<double>()},
         {"init_load_hf_s", per_rank[r][6].item<double>()},
         {"init_load_hf_rss_increase", per_rank[r][7].item<double>()},
         {"init_load_hf_from_rank0_s", per_rank[r][8].item<double>()},
         {"init_load_hf_from_rank0_rss_increase", per_rank[r][9].item<double>()},
         {"init_from_rank0_rss_increase_over_shard",
          per_rank[r][9].item<double>() / per_rank[r][4].item<double>()},
         {"init_from_rank0_rss_increase_over_full_fp32", per_rank[r][9].item<double>() / full_fp32},
         {"fresh_init_eager_s", per_rank[r][10].item<double>()},
         {"fresh_init_eager_peak_increase", per_rank[r][11].item<double>()},
         {"fresh_init_eager_peak_over_shard",
          per_rank[r][11].item<double>() / per_rank[r][4].item<double>()},
         {"fresh_init_empty_s", per_rank[r][12].item<double>()},
         {"fresh_init_empty_peak_increase", per_rank[r][13].item<double>()},
         {"fresh_init_empty_peak_over_shard",
          per_rank[r][13].item<double>() / per_rank[r][4].item<double>()},
         {"fresh_init_empty_over_eager_peak",
          per_rank[r][13].item<double>() / per_rank[r][11].item<double>()}});
  }
  const double export_inc = static_cast<double>(export_rss_peak - export_rss_before);
  json j = {{"benchmark", "bench_checkpoint"},
            {"world_size", N},
            {"threads", at::get_num_threads()},
            {"dir", a.dir},
            {"model", config.to_json()},
            {"param_count", config.parameter_count()},
            {"training_state_bytes", state_bytes},
            {"checkpoint_bytes", ckpt_bytes},
            {"loaded_step", loaded_step},
            {"save",
             {{"save_s", save_s},
              {"save_gbps", save_gbps},
              {"baseline_write_s", base_write_s},
              {"baseline_write_gbps", base_write_gbps},
              {"ratio_save_to_baseline", save_gbps / base_write_gbps}}},
            {"load", reads},
            {"largest_full_tensor",
             {{"name", largest_name},
              {"numel", largest_numel},
              {"fp32_bytes", full_fp32},
              {"bf16_bytes", full_bf16}}},
            {"export",
             {{"rank", 0},
              {"dtype", "bf16"},
              {"seconds", export_s},
              {"bytes_written", export_bytes},
              {"rss_before", export_rss_before},
              {"rss_peak", export_rss_peak},
              {"rss_increase", export_inc},
              {"rss_increase_over_full_fp32", export_inc / full_fp32},
              {"rss_increase_over_full_bf16", export_inc / full_bf16}}},
            {"sync",
             {{"dtype", "bf16"},
              {"seconds", sync_s},
              {"tensors", sync_tensors},
              {"bytes", sync_bytes},
              {"worst_rss_increase", sync_worst},
              {"worst_rss_increase_over_full_fp32", sync_worst / full_fp32},
              {"worst_rss_increase_over_full_bf16", sync_worst / full_bf16},
              {"ranks", ranks}}},
            {"notes",
             "RSS sampled every " + std::to_string(a.sample_ms) +
                 " ms (and in each sync callback) after malloc_trim; warm reads come from the page "
                 "cache, cold reads follow posix_fadvise(DONTNEED) (the host may still cache the "
                 "virtual disk)"}};
  if (!a.json_out.empty()) {
    std::ofstream out(a.json_out);
    if (!out) throw std::runtime_error("cannot write " + a.json_out);
    out << j.dump(2) << "\n";
  }
  std::printf(
      "ckpt N=%d state %.3f GB on disk %.3f GB  save %.3f GB/s (plain write %.3f, x%.3f)  load "
      "warm %.3f GB/s (plain read %.3f, x%.3f; into fresh memory x%.3f)  cold %.3f GB/s (plain "
      "read %.3f, x%.3f; into fresh memory x%.3f)  export "
      "peak +%.1f MB (x%.2f of largest fp32 tensor %.1f MB)  sync peak +%.1f MB (x%.2f fp32, "
      "x%.2f bf16)\n",
      N, gb(static_cast<double>(state_bytes)), gb(B), save_gbps, base_write_gbps,
      save_gbps / base_write_gbps, reads["warm"]["load_gbps"].get<double>(),
      reads["warm"]["baseline_read_gbps"].get<double>(),
      reads["warm"]["ratio_load_to_baseline"].get<double>(),
      reads["warm"]["ratio_load_to_fresh_memory_read"].get<double>(),
      reads["cold"]["load_gbps"].get<double>(), reads["cold"]["baseline_read_gbps"].get<double>(),
      reads["cold"]["ratio_load_to_baseline"].get<double>(),
      reads["cold"]["ratio_load_to_fresh_memory_read"].get<double>(), export_inc / 1e6,
      export_inc / full_fp32, full_fp32 / 1e6, sync_worst / 1e6, sync_worst / full_fp32,
      sync_worst / full_bf16);
  for (const auto& r : ranks) {
    std::printf(
        "rank %d: shards %.1f MB, VmHWM after construction+sharding %.1f MB; init load_hf %.2f s "
        "+%.1f MB, load_hf_from_rank0 %.2f s +%.1f MB (x%.2f of its shards)\n",
        r["rank"].get<int>(), r["sharded_param_bytes"].get<double>() / 1e6,
        r["vm_hwm_after_construction_and_sharding"].get<double>() / 1e6,
        r["init_load_hf_s"].get<double>(), r["init_load_hf_rss_increase"].get<double>() / 1e6,
        r["init_load_hf_from_rank0_s"].get<double>(),
        r["init_load_hf_from_rank0_rss_increase"].get<double>() / 1e6,
        r["init_from_rank0_rss_increase_over_shard"].get<double>());
    std::printf(
        "rank %d: fresh model from the export via load_hf_from_rank0: built as usual %.2f s, peak "
        "+%.1f MB (x%.2f of its shards); built under EmptyInit %.2f s, peak +%.1f MB (x%.2f of "
        "its shards, x%.2f of the usual build's)\n",
        r["rank"].get<int>(), r["fresh_init_eager_s"].get<double>(),
        r["fresh_init_eager_peak_increase"].get<double>() / 1e6,
        r["fresh_init_eager_peak_over_shard"].get<double>(), r["fresh_init_empty_s"].get<double>(),
        r["fresh_init_empty_peak_increase"].get<double>() / 1e6,
        r["fresh_init_empty_peak_over_shard"].get<double>(),
        r["fresh_init_empty_over_eager_peak"].get<double>());
  }
  // Rank 0 hosts the store: the others must not find it gone while they finish.
  group.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL checkpoint benchmark: save/load vs plain I/O, export and sync memory"};
  Args a;
  app.add_option("--d-model", a.d_model)->check(CLI::PositiveNumber);
  app.add_option("--layers", a.layers)->check(CLI::PositiveNumber);
  app.add_option("--heads", a.heads)->check(CLI::PositiveNumber);
  app.add_option("--vocab", a.vocab)->check(CLI::PositiveNumber);
  app.add_option("--seq", a.seq, "max_seq_len (position table rows)")->check(CLI::PositiveNumber);
  app.add_option("--threads", a.threads, "Compute threads (0: keep OMP_NUM_THREADS)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dir", a.dir, "Scratch directory for the checkpoint (removed at the end)");
  app.add_option("--chunk-mib", a.chunk_mib, "Baseline write/read size per call")
      ->check(CLI::PositiveNumber);
  app.add_option("--sample-ms", a.sample_ms, "RSS sampling period")->check(CLI::PositiveNumber);
  app.add_flag("--keep", a.keep, "Keep --dir at the end");
  app.add_option("--json-out", a.json_out, "Write the result here (rank 0 writes)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::cerr << "bench_checkpoint: " << e.what() << std::endl;
    return 1;
  }
}
