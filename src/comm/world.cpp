#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <malloc.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <optional>

#include "comm/process_group_impl.h"

namespace shardrl::dist {
namespace {

constexpr const char* kKeyPrefix = "shardrl/";
// The longest the store's host waits at the end for the other ranks to check out (Liveness).
constexpr std::chrono::seconds kCheckOutGrace{5};

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, int fallback, int min_value) {
  auto v = env(name);
  if (!v) return fallback;
  try {
    size_t used = 0;
    int value = std::stoi(*v, &used);
    if (used != v->size() || value < min_value) throw std::invalid_argument("range");
    return value;
  } catch (const std::exception&) {
    throw std::invalid_argument(
        fmt::format("environment variable {}='{}' is not an integer >= {}", name, *v, min_value));
  }
}

// Every step allocates and frees the same large buffers (all-gather outputs, unsharded params,
// reduce-scatter inputs, activations). glibc mmaps blocks over its threshold and unmaps them on
// free, so each step page-faults and zeroes them afresh: measured ~20% of a CPU training step
// here. Keeping large blocks in the heap makes the next step reuse them. SHARDRL_MALLOC_TUNING=0
// leaves glibc alone (or set GLIBC_TUNABLES yourself).
void tune_allocator() {
  if (auto v = env("SHARDRL_MALLOC_TUNING"); v && *v == "0") return;
  if (env("GLIBC_TUNABLES")) return;
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

// A write to a socket whose peer has died raises SIGPIPE, and Gloo's pairs and the TCPStore
// write without MSG_NOSIGNAL. Left at its default the signal kills this rank silently, so a
// surviving rank dies too instead of reporting which peer is gone. PyTorch never meets this
// because the Python interpreter ignores SIGPIPE at start-up; a C++ process must do it itself.
// A handler the application installed is kept.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if (current.sa_handler != SIG_DFL) return;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGPIPE, &ignore, nullptr);
}

// Runs a store request on a thread of its own: nullopt when it has not answered by `deadline`
// (the thread is abandoned; it owns what it uses). Rethrows the store's own error.
template <typename Request>
auto within(std::chrono::milliseconds deadline, Request request)
    -> std::optional<decltype(request())> {
  using Answer = decltype(request());
  auto result = std::make_shared<std::promise<Answer>>();
  auto answer = result->get_future();
  std::thread([result, request = std::move(request)] {
    try {
      result->set_value(request());
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  if (answer.wait_for(deadline) != std::future_status::ready) return std::nullopt;
  return answer.get();
}

// The store answers in milliseconds when it is there; a second is generous even on a busy host.
std::chrono::milliseconds probe_deadline(std::chrono::milliseconds period) {
  return std::max<std::chrono::milliseconds>(std::chrono::seconds(1), period * 4);
}

// Under torchrun, the elastic agent hosts the store on MASTER_PORT and outlives the workers, which
// all connect as clients (torch.distributed's env:// rendezvous does the same).
bool torchrun_agent_hosts_store() {
  const char* v = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return v && std::string(v) == "True";
}

// Whether `rank` is the store's server: rank 0, unless torchrun's agent is.
bool hosts_store(int rank) {
  return rank == 0 && !torchrun_agent_hosts_store();
}

// The agent's store outlives a failed attempt, and a restarted one must not read its keys (Gloo's
// peer addresses, the shared-memory segment's name): measured, attempt 1 then hangs or aborts.
// Each attempt gets keys of its own, as torch.distributed's workers once did.
c10::intrusive_ptr<c10d::Store> for_this_attempt(c10::intrusive_ptr<c10d::Store> store) {
  if (!torchrun_agent_hosts_store()) return store;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return c10::make_intrusive<c10d::PrefixStore>(
      fmt::format("/worker/attempt_{}", attempt && *attempt ? attempt : "0"), std::move(store));
}

c10d::TCPStore& tcp_store_of(const c10::intrusive_ptr<c10d::Store>& store) {
  auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get());
  return dynamic_cast<c10d::TCPStore&>(prefixed ? *prefixed->getUnderlyingNonPrefixStore()
                                                : *store);
}

}  // namespace

Liveness::Liveness(c10::intrusive_ptr<c10d::Store> heartbeat_store,
                   c10::intrusive_ptr<c10d::Store> probe_store, Options options)
    : probe_store_(std::move(probe_store)),
      options_(std::move(options)),
      beat_(std::make_shared<Beat>()) {
  beat_->store = std::move(heartbeat_store);
  thread_ =
      std::thread([beat = beat_, key = fmt::format("{}heartbeat/{}", kKeyPrefix, options_.rank),
                   period = options_.period] {
        std::unique_lock<std::mutex> lock(beat->mutex);
        while (!beat->stop) {
          lock.unlock();
          try {
            beat->store->add(key, 1);
          } catch (const std::exception&) {
            break;  // the store is gone; failures will be diagnosed by whoever notices it
          }
          lock.lock();
          beat->wake.wait_for(lock, period, [&] { return beat->stop; });
        }
        if (!lock.owns_lock()) lock.lock();
        beat->done = true;
        beat->wake.notify_all();
      });
}

Liveness::~Liveness() {
  stop_beating();
  check_out();
}

void Liveness::stop_beating() {
  std::unique_lock<std::mutex> lock(beat_->mutex);
  beat_->stop = true;
  beat_->wake.notify_all();
  // A beat blocked on a store that no longer answers would hold the exit back for minutes; the
  // thread owns what it uses, so it is left to the process's end.
  if (beat_->wake.wait_for(lock, options_.period * 4, [&] { return beat_->done; })) {
    lock.unlock();
    thread_.join();
  } else {
    thread_.detach();
  }
}

std::optional<std::vector<int64_t>> Liveness::read_counters(const char* name,
                                                            const std::vector<int>& ranks) {
  std::vector<std::string> keys;
  for (int r : ranks) keys.push_back(fmt::format("{}{}/{}", kKeyPrefix, name, r));
  return within(probe_deadline(options_.period), [store = probe_store_, keys] {
    std::vector<int64_t> values;
    for (const auto& key : keys) values.push_back(store->add(key, 0));
    return values;
  });
}

void Liveness::check_out() {
  if (options_.world_size < 2) return;
  try {
    const auto key = fmt::format("{}checked_out/{}", kKeyPrefix, options_.rank);
    if (!within(probe_deadline(options_.period),
                [store = probe_store_, key] { return store->add(key, 1); }))
      return;  // the store does not answer: nobody is left to wait for this rank
    if (!options_.hosts_store || failure_seen_) return;
    std::vector<int> others;
    for (int r = 0; r < options_.world_size; ++r)
      if (r != options_.rank) others.push_back(r);
    const auto deadline = std::chrono::steady_clock::now() + kCheckOutGrace;
    std::optional<std::vector<int64_t>> beats;
    auto beats_read_at = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() < deadline) {
      const auto out = read_counters("checked_out", others);
      if (!out) return;
      if (std::all_of(out->begin(), out->end(), [](int64_t n) { return n > 0; })) return;
      // A rank that still beats is still at work and will check out; when no rank that has not
      // checked out has beaten for six periods, they died (or froze, or are cut off) and never
      // will.
      const auto now = std::chrono::steady_clock::now();
      if (!beats || now - beats_read_at >= options_.period * 6) {
        const auto latest = read_counters("heartbeat", others);
        if (!latest) return;
        bool still_beating = !beats;
        for (size_t i = 0; beats && i < others.size(); ++i)
          still_beating |= (*out)[i] == 0 && (*latest)[i] != (*beats)[i];
        if (!still_beating) return;
        beats = latest;
        beats_read_at = now;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  } catch (const std::exception&) {
    // The store failed under this rank: there is nothing left to wait for.
  }
}

std::string Liveness::describe_unresponsive(const std::vector<int>& ranks) {
  failure_seen_ = true;
  auto store_lost = [&](const std::string& why) {
    return fmt::format(
        "the rendezvous store at {} (hosted by {}) {}, so {} is down or the network to it is cut",
        options_.store_address, options_.store_host, why, options_.store_host);
  };
  std::optional<std::vector<int64_t>> before, after;
  try {
    before = read_counters("heartbeat", ranks);
    if (before) {
      std::this_thread::sleep_for(options_.period * 6);
      after = read_counters("heartbeat", ranks);
    }
  } catch (const std::exception& e) {
    std::string why = e.what();
    return store_lost(fmt::format("fails ({})", why.substr(0, why.find('\n'))));
  }
  if (!before || !after) return store_lost("does not answer");
  std::vector<std::string> silent;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] != options_.rank && (*after)[i] == (*before)[i])
      silent.push_back(std::to_string(ranks[i]));
  }
  // When the store's host exits on this error without its destructors (an uncaught exception),
  // peers still diagnosing the same loss could no longer read heartbeats and would blame it. One
  // more window lets them finish.
  if (options_.hosts_store) std::this_thread::sleep_for(options_.period * 6);
  if (silent.empty()) {
    return "every rank of the group is alive, so the collective itself failed or timed out "
           "(ranks calling different collectives, or one rank far slower than the timeout)";
  }
  return fmt::format("rank {} stopped responding (exited, was killed, is frozen or is cut off)",
                     fmt::join(silent, ", "));
}

std::shared_ptr<World> World::init_from_env(const InitOptions& options) {
  tune_allocator();
  ignore_sigpipe_unless_handled();
  std::shared_ptr<World> world(new World());
  world->options_ = options;
  const bool launched = env("RANK") || env("WORLD_SIZE");
  if (launched && !env("WORLD_SIZE")) {
    throw std::invalid_argument(
        "RANK is set but WORLD_SIZE is not (start ranks with `shardrl launch` or torchrun)");
  }
  if (launched && !env("RANK")) {
    throw std::invalid_argument(
        "WORLD_SIZE is set but RANK is not (start ranks with `shardrl launch` or torchrun)");
  }
  world->size_ = env_int("WORLD_SIZE", 1, 1);
  world->rank_ = env_int("RANK", 0, 0);
  world->local_rank_ = env_int("LOCAL_RANK", world->rank_, 0);
  if (world->rank_ >= world->size_) {
    throw std::invalid_argument(
        fmt::format("RANK={} is out of range for WORLD_SIZE={}", world->rank_, world->size_));
  }
  world->master_addr_ = env("MASTER_ADDR").value_or("127.0.0.1");

  if (options.backend == "nccl" || (options.backend == "auto" && torch::cuda::is_available())) {
#ifdef USE_C10D_NCCL
    world->use_nccl_ = true;
    world->device_ = torch::Device(torch::kCUDA, world->local_rank_ % torch::cuda::device_count());
    // Each rank computes on its own GPU: allocations, kernels and NCCL's communicator follow the
    // current device, which would otherwise be GPU 0 for every rank of the host.
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(world->device_);
#else
    if (options.backend == "nccl") {
      throw std::invalid_argument("backend='nccl' but this build of LibTorch has no NCCL");
    }
#endif
  } else if (options.backend != "gloo" && options.backend != "auto") {
    throw std::invalid_argument(
        fmt::format("backend='{}' is unknown (expected gloo, nccl or auto)", options.backend));
  }

  if (world->size_ == 1) {
    world->store_ = c10::make_intrusive<c10d::HashStore>();
  } else {
    if (!env("MASTER_PORT")) {
      throw std::invalid_argument("WORLD_SIZE > 1 but MASTER_PORT is not set");
    }
    const int port = env_int("MASTER_PORT", 0, 1);
    if (port > 65535)
      throw std::invalid_argument(fmt::format("MASTER_PORT={} is not a port", port));
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(port);
    // Under torchrun the agent's store is already there: binding its port again would fail (and
    // LibTorch would log that as an error before carrying on as a client).
    store_options.isServer = hosts_store(world->rank_);
    store_options.numWorkers = world->size_;
    store_options.waitWorkers = false;
    store_options.timeout = options.timeout;
    try {
      world->store_ =
          for_this_attempt(c10::make_intrusive<c10d::TCPStore>(world->master_addr_, store_options));
    } catch (const std::exception& e) {
      std::string why = e.what();
      why = why.substr(0, why.find('\n'));
      if (store_options.isServer) {
        throw std::runtime_error(fmt::format(
            "rank 0 cannot host the rendezvous store on {}:{} (is the port in use? pick another "
            "MASTER_PORT / --master-port): {}",
            world->master_addr_, port, why));
      }
      throw std::runtime_error(fmt::format("rank {} cannot reach the rendezvous store at {}:{}: {}",
                                           world->rank_, world->master_addr_, port, why));
    }
    // A rank started with another WORLD_SIZE would otherwise wait forever for peers that never
    // come.
    auto& store = *world->store_;
    auto encode = [](int v) {
      std::string s = std::to_string(v);
      return std::vector<uint8_t>(s.begin(), s.end());
    };
    store.set(fmt::format("{}world_size/{}", kKeyPrefix, world->rank_), encode(world->size_));
    std::vector<int> check = world->rank_ == 0 ? std::vector<int>{} : std::vector<int>{0};
    if (world->rank_ == 0) {
      for (int r = 1; r < world->size_; ++r) check.push_back(r);
    }
    for (int r : check) {
      auto raw = store.get(fmt::format("{}world_size/{}", kKeyPrefix, r));
      int theirs = std::stoi(std::string(raw.begin(), raw.end()));
      if (theirs == world->size_) continue;
      if (world->rank_ == 0) {
        // Rank 0 hosts the store: let the other side read it and report too before leaving.
        try {
          store.wait({fmt::format("{}world_size_read/{}", kKeyPrefix, r)}, std::chrono::seconds(5));
        } catch (const std::exception&) {
        }
      } else {
        store.set(fmt::format("{}world_size_read/{}", kKeyPrefix, world->rank_), encode(1));
      }
      throw std::runtime_error(fmt::format(
          "world size mismatch: rank {} has WORLD_SIZE={} but rank {} has WORLD_SIZE={}",
          world->rank_, world->size_, r, theirs));
    }
  }

  std::vector<int> all(world->size_);
  for (int r = 0; r < world->size_; ++r) all[r] = r;
  world->global_ = world->new_group(all, "global");
  return world;
}

std::shared_ptr<ProcessGroup> World::new_group(const std::vector<int>& ranks,
                                               const std::string& tag) {
  // The tag names the group's rendezvous keys. A tag used again (the "shard0" of a second
  // DeviceMesh: an actor and its reference) gets keys of its own; sharing the first group's would
  // pair Gloo with that group's addresses ("connection refused"). Counted on every rank, members
  // or not, so the names agree everywhere.
  const int use = tag_uses_[tag]++;
  const std::string name = use == 0 ? tag : fmt::format("{}#{}", tag, use);
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->name = name;
  impl->rank = static_cast<int>(it - ranks.begin());
  impl->global_ranks = ranks;
  impl->world_rank = rank_;
  impl->timeout = options_.timeout;
  impl->is_nccl = use_nccl_;
  impl->device = device_;
  if (ranks.size() > 1) {
    auto prefixed =
        c10::make_intrusive<c10d::PrefixStore>(fmt::format("{}pg/{}", kKeyPrefix, name), store_);
#ifdef USE_C10D_NCCL
    if (use_nccl_) {
      impl->backend = compat::make_nccl(prefixed, impl->rank, static_cast<int>(ranks.size()),
                                        options_.timeout, device_);
    }
#endif
    if (!impl->backend) {
      impl->backend = compat::make_gloo(prefixed, impl->rank, static_cast<int>(ranks.size()),
                                        options_.timeout, master_addr_);
      // Gloo stays for the small collectives and carries the bulk ones where the ranks are on
      // more than one host.
      impl->shm = ShmTransport::connect(*prefixed, impl->rank, ranks, options_.timeout,
                                        &impl->no_shm_because);
    }
    if (!liveness_) {
      // The heartbeat gets its own store connection so it never queues behind a blocked get().
      c10d::TCPStoreOptions o;
      o.port = tcp_store_of(store_).getPort();
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = options_.timeout;
      auto beat_store = for_this_attempt(c10::make_intrusive<c10d::TCPStore>(master_addr_, o));
      Liveness::Options liveness;
      liveness.rank = rank_;
      liveness.world_size = size_;
      liveness.hosts_store = hosts_store(rank_);
      liveness.store_address = fmt::format("{}:{}", master_addr_, o.port);
      liveness.store_host = torchrun_agent_hosts_store() ? "torchrun's agent" : "rank 0";
      liveness_ = std::make_shared<Liveness>(beat_store, store_, std::move(liveness));
    }
    impl->liveness = liveness_;
  }
  return std::make_shared<ProcessGroup>(std::move(impl));
}

}  // namespace shardrl::dist
