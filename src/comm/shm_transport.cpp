#include "comm/shm_transport.h"

#include <c10/util/ParallelGuard.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

namespace shardrl::dist {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x31'6c'72'64'72'61'68'73;  // "shardrl1"
constexpr int kSlotsPerRank = 2;
constexpr size_t kLine = 64;  // counters each get a cache line: no false sharing between ranks
// A piece this size stays in the cache its reader shares with its writer, and two slots a rank
// keep a 2-rank group at 4 MiB of /dev/shm (Docker's default /dev/shm is 64 MiB).
constexpr size_t kSlotBytes = size_t{1} << 20;
// How often a wait looks up from its futex to check that the peer it waits for still exists.
constexpr auto kWaitSlice = std::chrono::milliseconds(50);
// The counters grow as the square of the group; beyond this a host is better served by NCCL.
constexpr int kMaxRanks = 64;

enum class OpKind : uint32_t { kAllGather = 1, kReduceScatter = 2, kAllToAll = 3, kMapImage = 4 };

const char* op_name(uint32_t kind) {
  switch (static_cast<OpKind>(kind)) {
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kMapImage:
      return "map_image";
  }
  return "an unknown collective";
}

// Written into a slot before its piece is published; a reader compares it with its own
// collective, so ranks that issue different collectives fail instead of mixing their bytes.
struct PieceTag {
  uint64_t op_number = 0;  // collectives this rank issued on the group before this one
  uint64_t total_bytes = 0;
  uint32_t kind = 0;
  int32_t dtype = 0;
  bool operator==(const PieceTag& o) const {
    return op_number == o.op_number && total_bytes == o.total_bytes && kind == o.kind &&
           dtype == o.dtype;
  }
};

struct SegmentHeader {
  uint64_t magic;
  uint64_t nonce;
  uint64_t ranks;
  uint64_t slot_bytes;
};

size_t round_up(size_t v, size_t to) {
  return (v + to - 1) / to * to;
}

// Line 0 is the header; then each rank's (1 + W) lines: its published count and pid, then how
// many pieces of each peer it has consumed; then the slots, each a tag line and its data.
struct Layout {
  int ranks = 0;
  size_t slots_offset = 0, total = 0;
  explicit Layout(int w) : ranks(w) {
    slots_offset = round_up(kLine * (1 + static_cast<size_t>(w) * (1 + w)), 4096);
    total = slots_offset + static_cast<size_t>(w) * kSlotsPerRank * (kLine + kSlotBytes);
  }
  size_t control(int rank) const { return kLine * (1 + static_cast<size_t>(rank) * (1 + ranks)); }
  size_t slot(int rank, int which) const {
    return slots_offset +
           (static_cast<size_t>(rank) * kSlotsPerRank + which) * (kLine + kSlotBytes);
  }
};

// Anything that differs between two processes that cannot share this segment: another boot (a
// host), another /dev/shm, another network namespace (how the tests model separate hosts on one
// machine, which must keep their TCP path) or another PID namespace (where a peer's pid means
// nothing).
std::string host_identity() {
  if (const char* off = std::getenv("SHARDRL_SHM_DISABLE"); off && std::string(off) == "1") {
    return "disabled";
  }
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat shm {};
  auto link = [](const char* path) {
    char buf[128];
    ssize_t n = readlink(path, buf, sizeof buf);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  };
  const std::string net = link("/proc/self/ns/net"), pid = link("/proc/self/ns/pid");
  if (boot.empty() || net.empty() || pid.empty() || stat("/dev/shm", &shm) != 0) {
    return fmt::format("unknown host (pid {})", getpid());  // never equal to a peer's
  }
  return fmt::format("{} /dev/shm={}:{} {} {}", boot, shm.st_dev, shm.st_ino, net, pid);
}

std::string text(const std::vector<uint8_t>& raw) {
  return std::string(raw.begin(), raw.end());
}
std::vector<uint8_t> bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

uint32_t* futex_word(std::atomic<uint32_t>* word) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  return reinterpret_cast<uint32_t*>(word);
}

// Shared (not FUTEX_PRIVATE) futexes: the word lives in a mapping other processes share.
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, Clock::duration for_at_most) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(for_at_most).count();
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  syscall(SYS_futex, futex_word(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, futex_word(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A collective's tensor in pieces, as a segmented all-gather's output or a segmented
// reduce-scatter's input sees it: segment s (bytes [offset[s], offset[s] + length[s]) of a rank's
// shard) of rank q lives in parts[s] at q * length[s], unless that is past the part's end (the
// padding of the last ranks' rows) or the part has no tensor (a param without a grad): bytes that
// exist nowhere, read as zeros.
struct Segments {
  std::vector<torch::Tensor> parts;  // kept alive until the collective is done
  std::vector<char*> data;
  std::vector<size_t> offset, length, capacity;

  Segments(std::vector<torch::Tensor> parts_in, const std::vector<int64_t>& numels, size_t element)
      : parts(std::move(parts_in)) {
    size_t at = 0;
    for (size_t s = 0; s < parts.size(); ++s) {
      const bool held = parts[s].defined();
      data.push_back(held ? static_cast<char*>(parts[s].data_ptr()) : nullptr);
      offset.push_back(at);
      length.push_back(static_cast<size_t>(numels[s]) * element);
      capacity.push_back(held ? static_cast<size_t>(parts[s].numel()) * element : 0);
      at += length.back();
    }
  }

  // fn(segment, offset in the shard, bytes, where rank q's bytes [offset, offset + bytes) are or
  // nullptr where they exist nowhere), for rank q's bytes in [begin, end), in order.
  template <class Fn>
  void pieces(int q, size_t begin, size_t end, Fn&& fn) const {
    auto first = std::upper_bound(offset.begin(), offset.end(), begin);
    for (size_t s = first == offset.begin() ? 0 : first - offset.begin() - 1;
         s < offset.size() && offset[s] < end; ++s) {
      const size_t from = std::max(begin, offset[s]), to = std::min(end, offset[s] + length[s]);
      if (to <= from) continue;
      const size_t at = q * length[s] + (from - offset[s]);
      const size_t held = at < capacity[s] ? std::min(to - from, capacity[s] - at) : 0;
      if (held > 0) fn(s, from, held, data[s] + at);
      if (held < to - from) fn(s, from + held, to - from - held, static_cast<char*>(nullptr));
    }
  }
  // The pieces that exist: fn(where, offset in the shard, bytes).
  template <class Fn>
  void place(int q, size_t begin, size_t end, Fn&& fn) const {
    pieces(q, begin, end, [&](size_t, size_t from, size_t bytes, char* at) {
      if (at) fn(at, from, bytes);
    });
  }
};

// A Work that the transport's thread completes.
class ShmWork : public c10d::Work {
 public:
  void complete(std::exception_ptr error) { finish(std::move(error)); }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    // The transport's thread bounds each of its own waits by the group's timeout and fails what is
    // queued behind a failed collective at once, so its error arrives first; this only guards
    // against a thread that never reports.
    if (timeout != kNoTimeout) timeout = timeout * 2 + std::chrono::seconds(10);
    return c10d::Work::wait(timeout);
  }
};

// Unlinks a /dev/shm name this rank made when the scope that made it ends, however it ends. The
// name goes once every rank has mapped the file; a peer that dies before that makes the wait for
// it throw, and the file would otherwise keep its pages (host memory) until the machine reboots.
class UnlinkAtExit {
 public:
  UnlinkAtExit() = default;
  UnlinkAtExit(const UnlinkAtExit&) = delete;
  UnlinkAtExit& operator=(const UnlinkAtExit&) = delete;
  ~UnlinkAtExit() {
    if (!name_.empty()) shm_unlink(name_.c_str());
  }
  void arm(const std::string& name) { name_ = name; }

 private:
  std::string name_;
};

}  // namespace

struct ShmTransport::Impl {
  int rank = 0, size = 0;
  std::vector<int> global_ranks;
  std::chrono::milliseconds timeout{0};
  Layout layout{1};
  char* base = nullptr;
  std::vector<int> pids, pidfds;  // per group rank; pidfd -1 where pidfd_open is unavailable

  std::string segment_name;   // the shm_open name of the segment, from which images take theirs
  uint64_t images_made = 0;   // caller's thread
  uint64_t ops_issued = 0;    // caller's thread
  uint64_t pieces_done = 0;   // transport thread: pieces this rank has published
  torch::Tensor accumulator;  // scratch for sums in another dtype than their output's

  struct Task {
    c10::intrusive_ptr<ShmWork> work;
    std::function<void()> run;
  };
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Task> queue;
  bool stop = false;
  std::atomic<bool> stopping{false};  // waits in flight give up
  std::atomic<bool> destroyed{false};
  std::exception_ptr broken;  // under `mutex`: the first failure, which every later collective gets
  std::thread thread;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    destroyed = true;
    stopping = true;  // a wait still in flight gives up within one slice
    wake.notify_all();
    if (thread.joinable()) thread.join();
    for (int fd : pidfds)
      if (fd >= 0) close(fd);
    if (base) munmap(base, layout.total);
  }

  std::atomic<uint32_t>* published(int r) const {
    return reinterpret_cast<std::atomic<uint32_t>*>(base + layout.control(r));
  }
  int32_t* pid_slot(int r) const {
    return reinterpret_cast<int32_t*>(base + layout.control(r) + sizeof(uint32_t));
  }
  // How many of `writer`'s pieces `reader` has consumed.
  std::atomic<uint32_t>* consumed(int reader, int writer) const {
    return reinterpret_cast<std::atomic<uint32_t>*>(base + layout.control(reader) +
                                                    kLine * (1 + writer));
  }
  PieceTag* tag(int r, int which) const {
    return reinterpret_cast<PieceTag*>(base + layout.slot(r, which));
  }
  char* data(int r, int which) const { return base + layout.slot(r, which) + kLine; }

  bool exited(int peer) const {
    if (pidfds[peer] >= 0) {
      pollfd p{pidfds[peer], POLLIN, 0};
      return poll(&p, 1, 0) > 0;  // a pidfd becomes readable when its process exits
    }
    return kill(pids[peer], 0) != 0 && errno == ESRCH;
  }

  // Blocks until *word reaches `target` (counters wrap: compared as a signed distance).
  void await(std::atomic<uint32_t>* word, uint32_t target, int peer, const char* for_what,
             const PieceTag& op) {
    auto reached = [&](uint32_t seen) { return static_cast<int32_t>(seen - target) >= 0; };
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      const uint32_t seen = word->load(std::memory_order_acquire);
      if (reached(seen)) return;
      if (stopping) {
        throw std::runtime_error(
            fmt::format("shared-memory {}: abandoned in flight ({})", op_name(op.kind),
                        destroyed ? "the process group was destroyed" : "the group failed"));
      }
      if (exited(peer)) {
        // It may have done its part and exited since the load above.
        if (reached(word->load(std::memory_order_acquire))) return;
        throw std::runtime_error(fmt::format(
            "shared-memory {} (collective #{} of the group): rank {} (pid {}) exited while this "
            "rank waited for it to {}",
            op_name(op.kind), op.op_number, global_ranks[peer], pids[peer], for_what));
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        throw std::runtime_error(fmt::format(
            "shared-memory {} (collective #{} of the group): rank {} did not {} within {} ms",
            op_name(op.kind), op.op_number, global_ranks[peer], for_what, timeout.count()));
      }
      futex_wait(word, seen, std::min<Clock::duration>(kWaitSlice, deadline - now));
    }
  }

  // One collective in rounds. Each round this rank fills its slot with `fill`, publishes it, waits
  // for every peer's piece of the same round, hands all W slots to `drain` (this rank's own as
  // well) and releases the peers' slots for their next round.
  void run_rounds(const PieceTag& op, int64_t rounds,
                  const std::function<void(int64_t, char*)>& fill,
                  const std::function<void(int64_t, const std::vector<const char*>&)>& drain) {
    std::vector<const char*> slots(size);
    for (int64_t k = 0; k < rounds; ++k) {
      const uint64_t piece = pieces_done;  // the same on every rank: they run the same collectives
      const int which = static_cast<int>(piece % kSlotsPerRank);
      if (piece >= kSlotsPerRank) {
        // This slot last held piece `piece - kSlotsPerRank`; every peer must be done with it.
        const auto released = static_cast<uint32_t>(piece - kSlotsPerRank + 1);
        for (int p = 0; p < size; ++p)
          if (p != rank) await(consumed(p, rank), released, p, "read this rank's last piece", op);
      }
      fill(k, data(rank, which));
      *tag(rank, which) = op;
      published(rank)->store(static_cast<uint32_t>(piece + 1), std::memory_order_release);
      futex_wake(published(rank));
      for (int p = 0; p < size; ++p) {
        if (p == rank) {
          slots[p] = data(p, which);
          continue;
        }
        await(published(p), static_cast<uint32_t>(piece + 1), p, "publish its piece", op);
        const PieceTag theirs = *tag(p, which);
        if (!(theirs == op)) {
          throw std::runtime_error(fmt::format(
              "shared-memory collectives out of step: rank {} is in its collective #{} ({} of {} "
              "bytes, dtype {}) while rank {} is in its #{} ({} of {} bytes, dtype {}); every "
              "rank of a group must issue the same collectives in the same order",
              global_ranks[p], theirs.op_number, op_name(theirs.kind), theirs.total_bytes,
              c10::toString(static_cast<c10::ScalarType>(theirs.dtype)), global_ranks[rank],
              op.op_number, op_name(op.kind), op.total_bytes,
              c10::toString(static_cast<c10::ScalarType>(op.dtype))));
        }
        slots[p] = data(p, which);
      }
      drain(k, slots);
      for (int p = 0; p < size; ++p) {
        if (p == rank) continue;
        consumed(rank, p)->store(static_cast<uint32_t>(piece + 1), std::memory_order_release);
        futex_wake(consumed(rank, p));
      }
      ++pieces_done;
    }
  }

  // For reduce-scatter and all-to-all a slot is cut into one sub-slot per destination rank.
  size_t sub_slot_bytes() const { return kSlotBytes / size / kLine * kLine; }
  size_t sub_piece(size_t chunk, int64_t k) const {
    return std::min(sub_slot_bytes(), chunk - k * sub_slot_bytes());
  }
  // Round k of chunk j (of `chunk` bytes) of `src`, for every peer j, into j's sub-slot.
  void fill_sub_slots(const char* src, size_t chunk, int64_t k, char* slot) const {
    const size_t sub = sub_slot_bytes();
    for (int p = 0; p < size; ++p)
      if (p != rank) std::memcpy(slot + p * sub, src + p * chunk + k * sub, sub_piece(chunk, k));
  }

  // Every rank's `mine` (a short verdict), in rank order, through one round of the slots.
  std::vector<std::string> exchange(const PieceTag& op, const std::string& mine) {
    std::vector<std::string> all(size);
    run_rounds(
        op, 1,
        [&](int64_t, char* slot) {
          const auto n = static_cast<uint32_t>(std::min<size_t>(mine.size(), kSlotBytes - 4));
          std::memcpy(slot, &n, sizeof n);
          std::memcpy(slot + sizeof n, mine.data(), n);
        },
        [&](int64_t, const std::vector<const char*>& slots) {
          for (int p = 0; p < size; ++p) {
            uint32_t n = 0;
            std::memcpy(&n, slots[p], sizeof n);
            all[p].assign(slots[p] + sizeof n, n);
          }
        });
    return all;
  }

  c10::intrusive_ptr<c10d::Work> enqueue(std::function<void()> run) {
    auto work = c10::make_intrusive<ShmWork>();
    {
      std::lock_guard<std::mutex> lock(mutex);
      queue.push_back({work, std::move(run)});
    }
    wake.notify_one();
    return work;
  }

  void serve() {
    // A sum here runs inline on this thread rather than on the compute threads' pool.
    c10::ParallelGuard inline_sums(true);
    for (;;) {
      Task task;
      std::exception_ptr error;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
        error = broken;
      }
      if (!error) {
        try {
          task.run();
        } catch (...) {
          error = std::current_exception();
          std::lock_guard<std::mutex> lock(mutex);
          if (!broken) broken = error;
        }
      }
      task.work->complete(error);
    }
  }

  // out[0, n) = scale * the sum over ranks, in rank order, of rows[q][0, n); a null row (bytes
  // that exist nowhere) adds nothing.
  void sum_rows(const std::vector<const char*>& rows, int64_t n, c10::ScalarType dtype,
                torch::Tensor out, double scale) {
    std::vector<torch::Tensor> present;
    for (const char* row : rows) {
      if (row)
        present.push_back(
            torch::from_blob(const_cast<char*>(row), {n}, torch::TensorOptions(dtype)));
    }
    const bool widen = c10::isReducedFloatingType(dtype);
    if (widen || out.scalar_type() != dtype) {
      // Low-precision inputs are summed in fp32 and rounded once.
      const auto accumulate_in = widen ? torch::kFloat : dtype;
      if (!accumulator.defined() || accumulator.scalar_type() != accumulate_in ||
          accumulator.numel() < n)
        accumulator = torch::empty({n}, torch::TensorOptions(accumulate_in));
      torch::Tensor acc = accumulator.narrow(0, 0, n);
      acc.copy_(present[0]);
      for (size_t q = 1; q < present.size(); ++q) acc.add_(present[q]);
      if (scale != 1.0) acc.mul_(scale);
      out.copy_(acc);
      return;
    }
    if (present.size() == 1) {
      if (scale == 1.0) {
        out.copy_(present[0]);
      } else {
        at::mul_out(out, present[0], scale);
      }
      return;
    }
    at::add_out(out, present[0], present[1]);
    for (size_t q = 2; q < present.size(); ++q) out.add_(present[q]);
    // The product of the sum while its piece is still in the cache.
    if (scale != 1.0) out.mul_(scale);
  }

  // `total_bytes`: of the whole input (all-to-all, reduce-scatter) or of one rank's shard.
  PieceTag next_tag(OpKind kind, uint64_t total_bytes, c10::ScalarType dtype) {
    PieceTag t;
    t.op_number = ops_issued++;
    t.total_bytes = total_bytes;
    t.kind = static_cast<uint32_t>(kind);
    t.dtype = static_cast<int32_t>(dtype);
    return t;
  }
  PieceTag next_tag(OpKind kind, const torch::Tensor& in) {
    return next_tag(kind, static_cast<uint64_t>(in.numel()) * in.element_size(), in.scalar_type());
  }
};

ShmTransport::ShmTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShmTransport::~ShmTransport() = default;

std::unique_ptr<ShmTransport> ShmTransport::connect(c10d::Store& store, int rank,
                                                    std::vector<int> global_ranks,
                                                    std::chrono::milliseconds timeout,
                                                    std::string* why_not) {
  const int size = static_cast<int>(global_ranks.size());
  auto key = [](const std::string& what, int r) { return fmt::format("shm/{}/{}", what, r); };
  // Every rank runs every step below and reads what every other rank wrote, so all of them reach
  // the same verdict.
  const std::string identity = host_identity();
  store.set(key("host", rank), bytes(identity));
  std::vector<std::string> identities;
  for (int p = 0; p < size; ++p)
    identities.push_back(p == rank ? identity : text(store.get(key("host", p))));
  for (int p = 0; p < size; ++p) {
    if (identities[p] == "disabled") {
      *why_not = fmt::format("SHARDRL_SHM_DISABLE=1 on rank {}", global_ranks[p]);
      return nullptr;
    }
  }
  for (int p = 1; p < size; ++p) {
    if (identities[p] != identities[0]) {
      *why_not = fmt::format(
          "ranks {} and {} are not on one host: boot id, /dev/shm, network or PID namespace differ",
          global_ranks[0], global_ranks[p]);
      return nullptr;
    }
  }
  if (size > kMaxRanks) {
    *why_not = fmt::format("{} ranks on one host; the shared-memory transport takes {} at most",
                           size, kMaxRanks);
    return nullptr;
  }

  auto impl = std::make_unique<Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->global_ranks = std::move(global_ranks);
  impl->timeout = timeout;
  impl->layout = Layout(size);
  const size_t total = impl->layout.total;

  // Rank 0 makes the segment; the others attach to it by name and check its nonce. Once every
  // rank has attached (or given up), rank 0 unlinks the name: a crash can then no longer leak it.
  UnlinkAtExit unlink_made;
  std::string name, failure;
  uint64_t nonce = 0;
  auto map = [&](int fd) {
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      failure = fmt::format("mmap of {} bytes: {}", total, std::strerror(errno));
      return;
    }
    impl->base = static_cast<char*>(p);
  };
  if (rank == 0) {
    nonce = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
    name = fmt::format("/shardrl-{}-{:016x}", getpid(), nonce);
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      failure = fmt::format("shm_open({}): {}", name, std::strerror(errno));
    } else {
      unlink_made.arm(name);
      // tmpfs hands out pages when they are first touched: reserve them now, so that a full
      // /dev/shm fails here, with a fallback, rather than as a SIGBUS in the middle of a step.
      int err = ftruncate(fd, static_cast<off_t>(total)) != 0
                    ? errno
                    : posix_fallocate(fd, 0, static_cast<off_t>(total));
      if (err != 0) {
        failure = fmt::format("reserving {} bytes in /dev/shm for {}: {}", total, name,
                              std::strerror(err));
      } else {
        map(fd);
      }
      close(fd);
    }
    if (impl->base) {
      auto* header = reinterpret_cast<SegmentHeader*>(impl->base);
      *header = {kMagic, nonce, static_cast<uint64_t>(size), kSlotBytes};
      *impl->pid_slot(0) = getpid();
    }
    store.set("shm/segment", bytes(failure.empty() ? fmt::format("{} {}", name, nonce) : "!"));
  } else {
    const std::string segment = text(store.get("shm/segment"));
    if (segment == "!") {
      failure = fmt::format("rank {} could not make the segment", impl->global_ranks[0]);
    } else {
      name = segment.substr(0, segment.find(' '));
      nonce = std::stoull(segment.substr(segment.find(' ') + 1));
      int fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st {};
      if (fd < 0) {
        failure = fmt::format("shm_open({}): {}", name, std::strerror(errno));
      } else if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != total) {
        failure = fmt::format("{} is not the size this group needs", name);
      } else {
        map(fd);
      }
      if (fd >= 0) close(fd);
      if (impl->base) {
        const auto* header = reinterpret_cast<const SegmentHeader*>(impl->base);
        if (header->magic != kMagic || header->nonce != nonce ||
            header->ranks != static_cast<uint64_t>(size) || header->slot_bytes != kSlotBytes) {
          failure = fmt::format("{} is not this group's segment", name);
        } else {
          *impl->pid_slot(rank) = getpid();
        }
      }
    }
  }
  store.set(key("attached", rank), bytes(failure.empty() ? "ok" : failure));
  std::string first_failure;
  for (int p = 0; p < size; ++p) {
    const std::string theirs =
        p == rank ? (failure.empty() ? "ok" : failure) : text(store.get(key("attached", p)));
    if (theirs != "ok" && first_failure.empty())
      first_failure = fmt::format("rank {}: {}", impl->global_ranks[p], theirs);
  }
  impl->segment_name = name;
  if (!first_failure.empty()) {
    *why_not = "no shared-memory segment (" + first_failure + ")";
    return nullptr;  // Impl's destructor unmaps
  }

  for (int p = 0; p < size; ++p) {
    const int pid = p == rank ? getpid() : *impl->pid_slot(p);
    impl->pids.push_back(pid);
    int fd = -1;
#ifdef SYS_pidfd_open
    if (p != rank) fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#endif
    impl->pidfds.push_back(fd);
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->serve(); });
  return std::unique_ptr<ShmTransport>(new ShmTransport(std::move(impl)));
}

// The plain all-gather is the segmented one with a single segment: rank q's shard at q * n.
c10::intrusive_ptr<c10d::Work> ShmTransport::all_gather(torch::Tensor in, torch::Tensor out) {
  const int64_t n = in.numel();
  return all_gather_segments(std::move(in), {std::move(out)}, {n});
}

// The plain reduce-scatter is the segmented one with a single segment and no scaling.
c10::intrusive_ptr<c10d::Work> ShmTransport::reduce_scatter(torch::Tensor in, torch::Tensor out) {
  const int64_t n = out.numel();
  const auto dtype = in.scalar_type();
  return reduce_scatter_segments({std::move(in)}, {n}, dtype, {std::move(out)}, 1.0);
}

// Reduce-scatter and all-to-all: chunk j of every rank's input goes to rank j, a sub-slot a round.
c10::intrusive_ptr<c10d::Work> ShmTransport::reduce_scatter_segments(
    std::vector<torch::Tensor> inputs, std::vector<int64_t> segment_numels, c10::ScalarType dtype,
    std::vector<torch::Tensor> outputs, double scale) {
  Impl& s = *impl_;
  const size_t element = c10::elementSize(dtype);
  auto in = std::make_shared<Segments>(std::move(inputs), segment_numels, element);
  auto out = std::make_shared<std::vector<torch::Tensor>>(std::move(outputs));
  const size_t chunk = in->offset.empty() ? 0 : in->offset.back() + in->length.back();
  const PieceTag op = s.next_tag(OpKind::kReduceScatter, s.size * chunk, dtype);
  return s.enqueue([&s, op, in, out, dtype, element, scale, chunk] {
    const size_t sub = s.sub_slot_bytes();
    std::vector<const char*> rows(s.size);
    s.run_rounds(
        op, static_cast<int64_t>((chunk + sub - 1) / sub),
        [&](int64_t k, char* slot) {
          // Peer p's rows of this round into p's sub-slot; bytes that exist nowhere as zeros.
          const size_t begin = k * sub, end = begin + s.sub_piece(chunk, k);
          for (int p = 0; p < s.size; ++p) {
            if (p == s.rank) continue;
            char* sub_slot = slot + p * sub;
            in->pieces(p, begin, end, [&](size_t, size_t from, size_t bytes, const char* src) {
              if (src) {
                std::memcpy(sub_slot + (from - begin), src, bytes);
              } else {
                std::memset(sub_slot + (from - begin), 0, bytes);
              }
            });
          }
        },
        [&](int64_t k, const std::vector<const char*>& slots) {
          // This rank's own rows are read where they are; each segment's sum goes to its output.
          const size_t begin = k * sub, end = begin + s.sub_piece(chunk, k);
          in->pieces(s.rank, begin, end,
                     [&](size_t seg, size_t from, size_t bytes, const char* mine) {
                       for (int q = 0; q < s.size; ++q)
                         rows[q] = q == s.rank ? mine : slots[q] + s.rank * sub + (from - begin);
                       const auto n = static_cast<int64_t>(bytes / element);
                       const auto at = static_cast<int64_t>((from - in->offset[seg]) / element);
                       s.sum_rows(rows, n, dtype, (*out)[seg].narrow(0, at, n), scale);
                     });
        });
  });
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_to_all(torch::Tensor in, torch::Tensor out) {
  Impl& s = *impl_;
  const PieceTag op = s.next_tag(OpKind::kAllToAll, in);
  return s.enqueue([&s, op, in, out] {
    const size_t chunk = op.total_bytes / s.size, sub = s.sub_slot_bytes();
    const char* src = static_cast<const char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    std::memcpy(dst + s.rank * chunk, src + s.rank * chunk, chunk);
    s.run_rounds(
        op, static_cast<int64_t>((chunk + sub - 1) / sub),
        [&](int64_t k, char* slot) { s.fill_sub_slots(src, chunk, k, slot); },
        [&](int64_t k, const std::vector<const char*>& slots) {
          for (int q = 0; q < s.size; ++q)
            if (q != s.rank)
              std::memcpy(dst + q * chunk + k * sub, slots[q] + s.rank * sub,
                          s.sub_piece(chunk, k));
        });
  });
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_gather_segments(
    torch::Tensor in, std::vector<torch::Tensor> parts, std::vector<int64_t> segment_numels) {
  Impl& s = *impl_;
  const PieceTag op = s.next_tag(OpKind::kAllGather, in);
  auto segments = std::make_shared<Segments>(std::move(parts), segment_numels, in.element_size());
  const size_t n = op.total_bytes;
  // This rank's own segments are placed now: the caller may reuse `in` once this returns.
  const char* src = static_cast<const char*>(in.data_ptr());
  segments->place(s.rank, 0, n, [&](char* dst, size_t from, size_t bytes) {
    if (dst != src + from) std::memcpy(dst, src + from, bytes);  // FSDP gathers from in place
  });
  return s.enqueue([&s, op, segments, n] {
    // A struct, not a pair to unpack: clang before 16 cannot capture a structured binding.
    struct Span {
      size_t begin, end;
    };
    auto range = [n](int64_t k) {
      const size_t begin = k * kSlotBytes;
      return Span{begin, std::min(n, begin + kSlotBytes)};
    };
    s.run_rounds(
        op, static_cast<int64_t>((n + kSlotBytes - 1) / kSlotBytes),
        [&](int64_t k, char* slot) {
          // Read back from where this rank's shard was placed; its padding, which no reader
          // places either, stays unwritten.
          const Span span = range(k);
          segments->place(s.rank, span.begin, span.end,
                          [&](char* placed, size_t from, size_t bytes) {
                            std::memcpy(slot + (from - span.begin), placed, bytes);
                          });
        },
        [&](int64_t k, const std::vector<const char*>& slots) {
          const Span span = range(k);
          for (int p = 0; p < s.size; ++p) {
            if (p == s.rank) continue;
            segments->place(p, span.begin, span.end, [&](char* dst, size_t from, size_t bytes) {
              std::memcpy(dst, slots[p] + (from - span.begin), bytes);
            });
          }
        });
  });
}

HostImage::~HostImage() {
  if (base_) munmap(base_, mapped_);
}

std::atomic<uint32_t>* HostImage::released(int rank) const {
  return reinterpret_cast<std::atomic<uint32_t>*>(base_ + kLine * static_cast<size_t>(rank));
}

void HostImage::release(uint64_t generation) {
  released(rank_)->store(static_cast<uint32_t>(generation), std::memory_order_release);
  futex_wake(released(rank_));
}

std::shared_ptr<HostImage> ShmTransport::map_image(size_t bytes, std::string* why_not) {
  Impl& s = *impl_;
  auto image = std::shared_ptr<HostImage>(new HostImage());
  image->rank_ = s.rank;
  const size_t header = round_up(kLine * static_cast<size_t>(s.size), 4096);
  image->mapped_ = header + round_up(std::max<size_t>(bytes, 1), 4096);
  const std::string name = fmt::format("{}-image{}", s.segment_name, s.images_made++);
  const PieceTag op = s.next_tag(OpKind::kMapImage, image->mapped_, c10::ScalarType::Byte);
  auto verdict = std::make_shared<std::string>();
  auto work = s.enqueue([&s, op, name, image, verdict] {
    HostImage& im = *image;
    auto map = [&](int fd) -> std::string {
      void* p = mmap(nullptr, im.mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED)
        return fmt::format("mmap of {} bytes: {}", im.mapped_, std::strerror(errno));
      im.base_ = static_cast<char*>(p);
      return "";
    };
    // Rank 0 makes the file and reserves its pages (a full /dev/shm fails here, not as a SIGBUS
    // later); then the others map it; then rank 0 unlinks it, so a crash cannot leak it.
    UnlinkAtExit unlink_made;
    std::string mine;
    if (s.rank == 0) {
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        mine = fmt::format("shm_open({}): {}", name, std::strerror(errno));
      } else {
        unlink_made.arm(name);
        const int err = ftruncate(fd, static_cast<off_t>(im.mapped_)) != 0
                            ? errno
                            : posix_fallocate(fd, 0, static_cast<off_t>(im.mapped_));
        mine = err != 0 ? fmt::format("reserving {} bytes of /dev/shm: {}", im.mapped_,
                                      std::strerror(err))
                        : map(fd);
        close(fd);
      }
    }
    std::string first_failure;
    const auto made = s.exchange(op, mine);
    if (!made[0].empty()) {
      first_failure = fmt::format("rank {}: {}", s.global_ranks[0], made[0]);
    } else {
      if (s.rank != 0) {
        const int fd = shm_open(name.c_str(), O_RDWR, 0);
        struct stat st {};
        if (fd < 0) {
          mine = fmt::format("shm_open({}): {}", name, std::strerror(errno));
        } else if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != im.mapped_) {
          mine = fmt::format("{} is not the size this image needs", name);
        } else {
          mine = map(fd);
        }
        if (fd >= 0) close(fd);
      }
      const auto mapped = s.exchange(op, mine);
      for (int p = 0; p < s.size && first_failure.empty(); ++p)
        if (!mapped[p].empty())
          first_failure = fmt::format("rank {}: {}", s.global_ranks[p], mapped[p]);
    }
    if (!first_failure.empty() && im.base_) {
      munmap(im.base_, im.mapped_);
      im.base_ = nullptr;
    }
    *verdict = first_failure;
  });
  work->wait(s.timeout);
  if (!verdict->empty()) {
    *why_not = "no host-shared image (" + *verdict + ")";
    return nullptr;
  }
  image->data_ = image->base_ + header;
  return image;
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_gather_in_image(
    HostImage& image, uint64_t generation, const torch::Tensor& in,
    std::vector<torch::Tensor> parts, std::vector<int64_t> segment_numels) {
  Impl& s = *impl_;
  const PieceTag op = s.next_tag(OpKind::kAllGather, in);
  // This rank's own reads of the last gather are over (its caller resharded), and its peers'
  // must be before their rows of it are overwritten. They released it when they resharded,
  // which each does before its own next gather, so this wait ends without this rank's help.
  image.release(generation - 1);
  for (int p = 0; p < s.size; ++p) {
    if (p != s.rank)
      s.await(image.released(p), static_cast<uint32_t>(generation - 1), p,
              "release the rows of the last all-gather into the host-shared image", op);
  }
  const Segments segments(std::move(parts), segment_numels, in.element_size());
  const char* src = static_cast<const char*>(in.data_ptr());
  segments.place(s.rank, 0, op.total_bytes, [&](char* dst, size_t from, size_t bytes) {
    std::memcpy(dst, src + from, bytes);
  });
  // A round with nothing in it: every rank has written its rows once every rank has published.
  return s.enqueue([&s, op] {
    s.run_rounds(
        op, 1, [](int64_t, char*) {}, [](int64_t, const std::vector<const char*>&) {});
  });
}

void ShmTransport::abort(const std::string& why) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.broken) s.broken = std::make_exception_ptr(std::runtime_error(why));
  }
  s.stopping = true;
}

}  // namespace shardrl::dist
