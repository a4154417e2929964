// Offload benchmark: file-tier offload and onload of a model's whole training state (fp32 param
// shards, grads, AdamW moments) against a plain sequential write and read of the same number of
// bytes to the same directory in the same run.
//
//   build/bin/bench_offload --json-out offload.json
//
// Neither side fsyncs its writes (offload files are scratch space). Reads are measured warm (the
// page cache as the writes left it) and cold (after fdatasync + posix_fadvise(DONTNEED) on every
// file of both sides). The plain read fills a freshly allocated buffer, as onload fills freshly
// allocated storages. Timing is a benchmark, never a test: it depends on the machine being quiet.
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/models/transformer.h"
#include "shardrl/offload.h"
#include "shardrl/optim.h"

using namespace shardrl;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what + ": " + std::strerror(errno));
}

// Pushes the files' pages to disk and out of the page cache, so the next read comes from disk.
void drop_cache(const fs::path& dir) {
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY);
    check(fd >= 0, "open " + entry.path().string());
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

void transfer(int fd, char* data, int64_t nbytes, bool writing, const std::string& path) {
  int64_t done = 0;
  while (done < nbytes) {
    const size_t chunk = static_cast<size_t>(std::min<int64_t>(nbytes - done, 1 << 30));
    const ssize_t n =
        writing ? ::pwrite(fd, data + done, chunk, done) : ::pread(fd, data + done, chunk, done);
    if (n < 0 && errno == EINTR) continue;
    check(n > 0, path);
    done += n;
  }
}

struct Round {
  double offload_s = 0, onload_warm_s = 0, onload_cold_s = 0;
  double write_s = 0, read_warm_s = 0, read_cold_s = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL offload benchmark"};
  int64_t d_model = 1024, layers = 4, heads = 16, vocab = 32000;
  int rounds = 2;
  std::string dir = "/tmp/shardrl-offload-bench", json_out;
  app.add_option("--d-model", d_model);
  app.add_option("--layers", layers);
  app.add_option("--vocab", vocab);
  app.add_option("--rounds", rounds);
  app.add_option("--dir", dir, "Directory on the disk to measure (offload files and baseline)");
  app.add_option("--json-out", json_out);
  CLI11_PARSE(app, argc, argv);
  try {
    auto world = dist::World::init_from_env();
    auto mesh = dist::DeviceMesh::create(*world);
    models::TransformerConfig config;
    config.d_model = d_model;
    config.n_layers = layers;
    config.n_heads = heads;
    config.vocab_size = vocab;
    config.max_seq_len = 16;
    torch::manual_seed(1234);
    models::Transformer model(config);
    models::shard_transformer(model, mesh, {});
    auto fsdp_model = model.fsdp();
    auto optimizer = optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), {});
    {
      torch::NoGradGuard no_grad;
      for (auto& p : fsdp_model.sharded_parameters())
        p.shard.mutable_grad() = torch::randn_like(p.shard);
    }
    optimizer->step();  // AdamW moments exist from here on
    const fs::path rank_dir = fs::path(dir) / ("rank" + std::to_string(world->rank()));
    fs::remove_all(dir);
    offload::Options options;
    options.dir = dir;
    offload::set_policy(fsdp_model, optimizer.get(), options);

    const auto before = offload::memory(fsdp_model, optimizer.get());
    const int64_t total =
        before.params.resident + before.grads.resident + before.optimizer.resident;
    const fs::path plain = fs::path(dir) / "plain.bin";
    std::vector<char> source(static_cast<size_t>(total), 1);  // resident, like the state
    std::vector<Round> results;
    int64_t rss_drop = 0;
    for (int r = 0; r < rounds; ++r) {
      Round round;
      malloc_trim(0);
      const int64_t rss0 = offload::process_rss_bytes();
      auto t0 = Clock::now();
      offload::offload(fsdp_model, optimizer.get());
      round.offload_s = seconds_since(t0);
      rss_drop = rss0 - offload::process_rss_bytes();
      t0 = Clock::now();
      offload::onload(fsdp_model, optimizer.get());
      round.onload_warm_s = seconds_since(t0);
      offload::offload(fsdp_model, optimizer.get());
      drop_cache(rank_dir);
      t0 = Clock::now();
      offload::onload(fsdp_model, optimizer.get());
      round.onload_cold_s = seconds_since(t0);

      t0 = Clock::now();
      int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      check(fd >= 0, plain.string());
      transfer(fd, source.data(), total, true, plain.string());
      ::close(fd);
      round.write_s = seconds_since(t0);
      for (bool cold : {false, true}) {
        if (cold) drop_cache(dir);
        t0 = Clock::now();
        fd = ::open(plain.c_str(), O_RDONLY);
        check(fd >= 0, plain.string());
        std::unique_ptr<char[]> target(new char[static_cast<size_t>(total)]);
        transfer(fd, target.get(), total, false, plain.string());
        ::close(fd);
        target.reset();
        (cold ? round.read_cold_s : round.read_warm_s) = seconds_since(t0);
      }
      fs::remove(plain);
      results.push_back(round);
    }

    json out = {{"state_bytes", total},
                {"params_bytes", before.params.resident},
                {"grads_bytes", before.grads.resident},
                {"optimizer_bytes", before.optimizer.resident},
                {"rss_drop_on_offload", rss_drop},
                {"rounds", json::array()}};
    const double gb = static_cast<double>(total) / 1e9;
    for (const auto& r : results) {
      out["rounds"].push_back({{"offload_s", r.offload_s},
                               {"plain_write_s", r.write_s},
                               {"offload_over_write", r.write_s / r.offload_s},
                               {"onload_warm_s", r.onload_warm_s},
                               {"plain_read_warm_s", r.read_warm_s},
                               {"onload_over_read_warm", r.read_warm_s / r.onload_warm_s},
                               {"onload_cold_s", r.onload_cold_s},
                               {"plain_read_cold_s", r.read_cold_s},
                               {"onload_over_read_cold", r.read_cold_s / r.onload_cold_s},
                               {"offload_gb_s", gb / r.offload_s},
                               {"onload_warm_gb_s", gb / r.onload_warm_s},
                               {"onload_cold_gb_s", gb / r.onload_cold_s}});
    }
    std::cout << out.dump(2) << std::endl;
    if (!json_out.empty()) std::ofstream(json_out) << out.dump(2) << "\n";
    fs::remove_all(dir);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
