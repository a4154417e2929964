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

}  // namespace

Liveness::Liveness(c10::intrusive_ptr<c10d::Store> heartbeat_store,
                   c10::intrusive_ptr<c10d::Store> probe_store, int rank,
                   std::chrono::milliseconds period, std::string store_address)
    : probe_store_(std::move(probe_store)),
      rank_(rank),
      period_(period),
      store_address_(std::move(store_address)),
      beat_(std::make_shared<Beat>()) {
  beat_->store = std::move(heartbeat_store);
  thread_ =
      std::thread([beat = beat_, key = fmt::format("{}heartbeat/{}", kKeyPrefix, rank), period] {
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
  std::unique_lock<std::mutex> lock(beat_->mutex);
  beat_->stop = true;
  beat_->wake.notify_all();
  // A beat blocked on a store that no longer answers would hold the exit back for minutes; the
  // thread owns what it uses, so it is left to the process's end.
  if (beat_->wake.wait_for(lock, period_ * 4, [&] { return beat_->done; })) {
    lock.unlock();
    thread_.join();
  } else {
    thread_.detach();
  }
}

std::optional<std::vector<int64_t>> Liveness::read_heartbeats(const std::vector<int>& ranks) {
  auto counts = std::make_shared<std::promise<std::vector<int64_t>>>();
  auto answer = counts->get_future();
  std::thread([counts, store = probe_store_, ranks] {
    try {
      std::vector<int64_t> values;
      for (int r : ranks)
        values.push_back(store->add(fmt::format("{}heartbeat/{}", kKeyPrefix, r), 0));
      counts->set_value(std::move(values));
    } catch (...) {
      counts->set_exception(std::current_exception());
    }
  }).detach();
  // The store answers in milliseconds when it is there; a second is generous even on a busy host.
  if (answer.wait_for(std::max<std::chrono::milliseconds>(std::chrono::seconds(1), period_ * 4)) !=
      std::future_status::ready) {
    return std::nullopt;
  }
  return answer.get();  // rethrows the store's own error (connection reset or refused)
}

std::string Liveness::describe_unresponsive(const std::vector<int>& ranks) {
  auto store_lost = [&](const std::string& why) {
    return fmt::format(
        "the rendezvous store at {} (hosted by rank 0) {}, so rank 0 is down or the network to "
        "it is cut",
        store_address_, why);
  };
  std::optional<std::vector<int64_t>> before, after;
  try {
    before = read_heartbeats(ranks);
    if (before) {
      std::this_thread::sleep_for(period_ * 6);
      after = read_heartbeats(ranks);
    }
  } catch (const std::exception& e) {
    std::string why = e.what();
    return store_lost(fmt::format("fails ({})", why.substr(0, why.find('\n'))));
  }
  if (!before || !after) return store_lost("does not answer");
  std::vector<std::string> silent;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] != rank_ && (*after)[i] == (*before)[i])
      silent.push_back(std::to_string(ranks[i]));
  }
  // Rank 0 hosts the store: when it exits on this error, peers still diagnosing the same loss
  // could no longer read heartbeats and would blame rank 0. One more window lets them finish.
  if (rank_ == 0) std::this_thread::sleep_for(period_ * 6);
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
    store_options.isServer = world->rank_ == 0;
    store_options.numWorkers = world->size_;
    store_options.waitWorkers = false;
    store_options.timeout = options.timeout;
    try {
      world->store_ = c10::make_intrusive<c10d::TCPStore>(world->master_addr_, store_options);
    } catch (const std::exception& e) {
      std::string why = e.what();
      why = why.substr(0, why.find('\n'));
      if (world->rank_ == 0) {
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
      o.port = static_cast<c10d::TCPStore*>(store_.get())->getPort();
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = options_.timeout;
      auto beat_store = c10::make_intrusive<c10d::TCPStore>(master_addr_, o);
      liveness_ =
          std::make_shared<Liveness>(beat_store, store_, rank_, std::chrono::milliseconds(250),
                                     fmt::format("{}:{}", master_addr_, o.port));
    }
    impl->liveness = liveness_;
  }
  return std::make_shared<ProcessGroup>(std::move(impl));
}

}  // namespace shardrl::dist
