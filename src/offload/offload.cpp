// The offload state of one model: which unit's params, grads and optimizer state are out of
// compute memory, and the FSDP residency hooks that bring them in for use and send them back.
#include "shardrl/offload.h"

#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <unordered_set>

#include "offload/stash.h"
#include "shardrl/optim.h"

namespace shardrl::offload {
namespace {

using fsdp::ShardedUnit;
using fsdp::ShardUse;

enum Kind { kParams, kGrads, kOptimizer, kKinds };
constexpr std::array<const char*, kKinds> kKindNames = {"params", "grads", "optimizer"};

struct UnitRecord {
  std::array<std::unique_ptr<Stash>, kKinds> stash;       // set while that kind is offloaded
  std::array<std::optional<Tier>, kKinds> acquired_from;  // to send back on release
};

std::vector<Kind> kinds_for(ShardUse use) {
  switch (use) {
    case ShardUse::kParams:
      return {kParams};
    case ShardUse::kGrads:
      return {kGrads};
    case ShardUse::kStep:
      return {kParams, kGrads, kOptimizer};
  }
  return {};
}

class Residency : public fsdp::ShardResidency {
 public:
  Residency(std::vector<ShardedUnit> units, std::string dir)
      : units_(std::move(units)), dir_(std::move(dir)), records_(units_.size()) {}

  // The file tier's directory, fixed once state is in it.
  void set_dir(const std::string& dir) {
    if (dir == dir_) return;
    for (const auto& rec : records_) {
      for (const auto& stash : rec.stash) {
        if (stash && stash->tier() == Tier::kFile) {
          throw std::invalid_argument(fmt::format(
              "offload.dir: state is already offloaded under {}; onload it before moving to {}",
              dir_, dir));
        }
      }
    }
    remove_scratch_files();
    dir_ = dir;
  }

  ~Residency() override {
    records_.clear();
    remove_scratch_files();
  }

  Options options;
  torch::optim::Optimizer* optimizer = nullptr;

  const std::vector<ShardedUnit>& units() const { return units_; }

  torch::Tensor gather_input(const ShardedUnit& unit) override {
    auto& stash = record(unit).stash[kParams];
    if (!stash) return unit.flat_shard();
    torch::Tensor input = torch::empty_like(unit.flat_shard());
    stash->copy_out(unit.flat_shard(), input);
    return input;
  }

  void acquire(const ShardedUnit& unit, ShardUse use) override {
    auto& rec = record(unit);
    for (Kind kind : kinds_for(use)) {
      rec.acquired_from[kind].reset();
      if (!rec.stash[kind]) continue;
      rec.acquired_from[kind] = rec.stash[kind]->tier();
      move(unit, kind, Tier::kCompute);
    }
  }

  void release(const ShardedUnit& unit, ShardUse use) override {
    auto& rec = record(unit);
    bool moved = false;
    for (Kind kind : kinds_for(use)) {
      std::optional<Tier> home = rec.acquired_from[kind];
      rec.acquired_from[kind].reset();
      if (!home && lives_offloaded(kind)) home = options.tier;
      if (home) move(unit, kind, *home), moved = true;
    }
    // The unit's state just left compute memory, but glibc keeps freed heap (tune_allocator sets
    // its trim threshold to the maximum so that steps reuse their buffers), and units of other
    // sizes do not fit the holes: unreturned, the whole offloaded state piled up in the resident
    // set within two steps (Qwen3-1.7B's 27.5 GB met the OOM killer). Hand it back now.
    if (moved) release_free_memory();
  }

  // Moves one kind of one unit's state to `tier`; a no-op when it is all there already.
  void move(const ShardedUnit& unit, Kind kind, Tier tier) {
    auto& stash = record(unit).stash[kind];
    const auto current = tensors(unit, kind, optimizer);
    bool any_resident = false;
    for (const auto& t : current) any_resident |= t.storage().nbytes() > 0;
    if (tier == Tier::kCompute) {
      if (stash) restore(unit, kind);
      return;
    }
    if (!any_resident && (!stash || stash->tier() == tier)) return;
    // Mixed (a new grad beside evicted ones) or another tier: one group again, all in `tier`.
    if (stash) restore(unit, kind);
    auto fresh = make_stash(tier, unit.flat_shard().device(), path(unit, kind));
    fresh->evict(current);
    stash = std::move(fresh);
  }

  Bytes bytes(const ShardedUnit& unit, Kind kind, torch::optim::Optimizer* opt) {
    Bytes out;
    std::unordered_set<const c10::StorageImpl*> seen;
    for (const auto& t : tensors(unit, kind, opt)) {
      if (seen.insert(t.storage().unsafeGetStorageImpl()).second)
        out.resident += static_cast<int64_t>(t.storage().nbytes());
    }
    if (auto& stash = record(unit).stash[kind])
      out.offloaded = stash->bytes(current_in(unit, kind, opt));
    return out;
  }

 private:
  bool lives_offloaded(Kind kind) const {
    return kind == kOptimizer ? options.optimizer_offload : options.param_offload;
  }

  UnitRecord& record(const ShardedUnit& unit) {
    for (size_t i = 0; i < units_.size(); ++i) {
      if (units_[i] == unit) return records_[i];
    }
    throw std::logic_error("offload: a unit outside the model it was set up for");
  }

  size_t index_of(const ShardedUnit& unit) const {
    return static_cast<size_t>(std::find(units_.begin(), units_.end(), unit) - units_.begin());
  }

  // The file stashes' files stay after an onload, to be overwritten by the next offload. Named
  // by process and model, so that models sharing a directory (an actor and its reference, or two
  // jobs given the same offload_dir) never write into each other's files.
  std::string path(const ShardedUnit& unit, Kind kind) {
    std::filesystem::create_directories(dir_);
    auto file = fmt::format("{}/p{}_model{}_unit{}_{}.bin", dir_, ::getpid(), model_id_,
                            index_of(unit), kKindNames[kind]);
    scratch_files_.insert(file);
    return file;
  }

  void remove_scratch_files() {
    std::error_code ignored;
    for (const auto& file : scratch_files_) std::filesystem::remove(file, ignored);
    scratch_files_.clear();
    std::filesystem::remove(dir_, ignored);  // only when empty: the dir may be the user's
  }

  // The tensors holding this kind of state now. Grads and optimizer state can be replaced while
  // offloaded (zero_grad, a checkpoint load): evicted tensors no longer among these are dropped.
  static std::vector<torch::Tensor> tensors(const ShardedUnit& unit, Kind kind,
                                            torch::optim::Optimizer* opt) {
    std::vector<torch::Tensor> out;
    if (kind == kParams) {
      if (unit.flat_shard().defined()) out.push_back(unit.flat_shard());
    } else if (kind == kGrads) {
      for (const auto& shard : unit.shards()) {
        if (shard.grad().defined()) out.push_back(shard.grad());
      }
    } else if (opt) {
      // Every sub-optimizer, whatever the top-level state shows (verl's grouped-optimizer bug).
      for (auto* leaf : optim::leaf_optimizers(*opt)) {
        for (const auto& shard : unit.shards()) {
          if (auto* state = optim::find_state(*leaf, shard)) {
            for (auto& t : optim::state_tensors(*state)) out.push_back(std::move(t));
          }
        }
      }
    }
    return out;
  }

  static std::function<bool(const torch::Tensor&)> current_in(const ShardedUnit& unit, Kind kind,
                                                              torch::optim::Optimizer* opt) {
    auto storages = std::make_shared<std::unordered_set<const c10::StorageImpl*>>();
    for (const auto& t : tensors(unit, kind, opt)) {
      storages->insert(t.storage().unsafeGetStorageImpl());
    }
    return [storages](const torch::Tensor& t) {
      return storages->count(t.storage().unsafeGetStorageImpl()) > 0;
    };
  }

  void restore(const ShardedUnit& unit, Kind kind) {
    auto& stash = record(unit).stash[kind];
    stash->restore(current_in(unit, kind, optimizer));
    stash.reset();
  }

  std::vector<ShardedUnit> units_;
  std::string dir_;
  std::vector<UnitRecord> records_;
  std::set<std::string> scratch_files_;
  const int64_t model_id_ = next_model_id();

  static int64_t next_model_id() {
    static std::atomic<int64_t> count{0};
    return count++;
  }
};

// A rank killed by a signal (a pre-empted job, the OOM killer) leaves its scratch directory, as
// large as its offloaded state, behind: the next job on the host removes those of processes that
// no longer exist. One whose pid is alive is kept, whoever has that pid now.
void remove_stale_scratch(const std::filesystem::path& base) {
  static const std::regex scratch(R"(shardrl-offload-(\d+)-rank\d+)");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(base, ec)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, scratch)) continue;
    const pid_t pid = static_cast<pid_t>(std::stoll(match[1].str()));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code removed;
    const auto bytes = std::filesystem::remove_all(entry.path(), removed);
    if (!removed) spdlog::info("removed {}, left by a rank that is gone ({} files)", name, bytes);
  }
}

// Ranks of one job on one host write apart; so do jobs (the pid) unless the user picks the dir.
std::string rank_dir(const std::string& dir, int rank) {
  if (!dir.empty()) return fmt::format("{}/rank{}", dir, rank);
  std::error_code ec;
  auto base = std::filesystem::temp_directory_path(ec);
  if (ec) base = "/tmp";
  remove_stale_scratch(base);
  return (base / fmt::format("shardrl-offload-{}-rank{}", ::getpid(), rank)).string();
}

// The model's offload state, created on first use; units share one.
Residency& residency_of(const fsdp::FSDPModule& model) {
  TORCH_CHECK(model.is_root(),
              "offload: pass the root module (the one fully_shard() was applied to last)");
  if (auto* existing = dynamic_cast<Residency*>(model.residency())) return *existing;
  const int rank = model.mesh().rank();
  auto created = std::make_shared<Residency>(model.units(), rank_dir("", rank));
  model.set_residency(created);
  return *created;
}

void check_selection(const Selection& what) {
  if (what.grad && !what.model) {
    throw std::invalid_argument("offload: grad=true requires model=true (as in verl)");
  }
}

const char* verb(Tier tier) {
  return tier == Tier::kCompute ? "onload" : "offload";
}

}  // namespace

Tier parse_tier(const std::string& name, const std::string& field) {
  if (name == "compute" || name == "device" || name == "cuda") return Tier::kCompute;
  if (name == "host" || name == "cpu" || name == "pinned") return Tier::kHost;
  if (name == "file" || name == "nvme" || name == "disk") return Tier::kFile;
  throw std::invalid_argument(
      fmt::format("{}: unknown offload tier '{}' (expected compute, host or file)", field, name));
}

std::string tier_name(Tier tier) {
  switch (tier) {
    case Tier::kCompute:
      return "compute";
    case Tier::kHost:
      return "host";
    case Tier::kFile:
      return "file";
  }
  return "?";
}

void set_policy(fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer,
                const Options& options) {
  if (options.tier == Tier::kCompute && (options.param_offload || options.optimizer_offload)) {
    throw std::invalid_argument(
        "offload.tier: param_offload/optimizer_offload need a tier below "
        "compute memory (host or file)");
  }
  if (options.optimizer_offload && !optimizer) {
    throw std::invalid_argument("offload.optimizer_offload: no optimizer was given");
  }
  Residency& residency = residency_of(model);
  residency.set_dir(rank_dir(options.dir, model.mesh().rank()));
  residency.options = options;
  residency.optimizer = optimizer;
  to(options.tier == Tier::kCompute ? Tier::kFile : options.tier, model, optimizer,
     {options.param_offload, options.param_offload, options.optimizer_offload});
}

void to(Tier tier, fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer, Selection what) {
  check_selection(what);
  Residency& residency = residency_of(model);
  if (optimizer) residency.optimizer = optimizer;
  torch::NoGradGuard no_grad;
  for (const ShardedUnit& unit : residency.units()) {
    if (what.model) residency.move(unit, kParams, tier);
    if (what.grad) residency.move(unit, kGrads, tier);
    if (what.optimizer && optimizer) residency.move(unit, kOptimizer, tier);
  }
  if (tier != Tier::kCompute) release_free_memory();
  if (spdlog::should_log(spdlog::level::debug)) {
    log_memory(fmt::format("after {} to {}", verb(tier), tier_name(tier)), model, optimizer);
  }
}

void offload(fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer, Selection what) {
  to(residency_of(model).options.tier, model, optimizer, what);
}

void onload(fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer, Selection what) {
  to(Tier::kCompute, model, optimizer, what);
}

MemoryReport memory(const fsdp::FSDPModule& model, const torch::optim::Optimizer* optimizer) {
  MemoryReport report;
  Residency& residency = residency_of(model);
  // Reading the state changes nothing; the optimizer API has no const lookup.
  auto* opt = optimizer ? const_cast<torch::optim::Optimizer*>(optimizer) : residency.optimizer;
  auto add = [](Bytes& total, const Bytes& more) {
    total.resident += more.resident;
    total.offloaded += more.offloaded;
  };
  for (const ShardedUnit& unit : residency.units()) {
    add(report.params, residency.bytes(unit, kParams, opt));
    add(report.grads, residency.bytes(unit, kGrads, opt));
    add(report.optimizer, residency.bytes(unit, kOptimizer, opt));
  }
  const auto stats = model.memory();
  report.unsharded = stats.unsharded_param_bytes + stats.unsharded_grad_bytes;
  report.process_rss = process_rss_bytes();
  return report;
}

void log_memory(const std::string& phase, const fsdp::FSDPModule& model,
                const torch::optim::Optimizer* optimizer) {
  const auto m = memory(model, optimizer);
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  spdlog::info(
      "memory {}: rank {} params {:.1f} MiB resident / {:.1f} offloaded, grads {:.1f} / {:.1f}, "
      "optimizer {:.1f} / {:.1f}, unsharded {:.1f}, process rss {:.1f} MiB",
      phase, model.mesh().shard_group().rank(), mib(m.params.resident), mib(m.params.offloaded),
      mib(m.grads.resident), mib(m.grads.offloaded), mib(m.optimizer.resident),
      mib(m.optimizer.offloaded), mib(m.unsharded), mib(m.process_rss));
}

namespace {
// A field of /proc/self/status in bytes (its values are kB), 0 where there is none.
int64_t status_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const size_t length = std::char_traits<char>::length(field);
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(length)) * 1024;
  }
  return 0;
}
}  // namespace

int64_t process_rss_bytes() {
  return status_bytes("VmRSS:");
}

int64_t process_peak_rss_bytes() {
  return status_bytes("VmHWM:");
}

}  // namespace shardrl::offload
