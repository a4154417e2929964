#include "offload/stash.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <torch/cuda.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <unordered_set>

#include "compat.h"

namespace shardrl::offload {
namespace {

std::runtime_error io_error(const std::string& what, const std::string& path) {
  return std::runtime_error(fmt::format("offload: {} {}: {}", what, path, std::strerror(errno)));
}

// One file per group, written front to back and read back in one stream: sequential I/O through
// the page cache, no fsync. The file is scratch space that outlives the restore: the next
// offload of the same group overwrites it in place, and whoever owns the directory removes it
// (offload's Residency). Deleting or truncating it on every onload freed its blocks through the
// filesystem journal, 10-25 ms per file on ext4, a quarter of a cold onload.
class FileStash : public Stash {
 public:
  FileStash(Tier tier, std::string path) : Stash(tier), path_(std::move(path)) {}

 protected:
  void write(const std::vector<Entry>& entries, const std::vector<torch::Tensor>& bytes) override {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) throw io_error("cannot create", path_);
    try {
      int64_t size = 0;
      for (size_t i = 0; i < entries.size(); ++i) {
        torch::Tensor host = bytes[i].is_cpu() ? bytes[i] : bytes[i].cpu();
        transfer(fd, host.data_ptr<uint8_t>(), entries[i].nbytes, entries[i].offset, true);
        size = std::max(size, entries[i].offset + entries[i].nbytes);
      }
      struct stat st {};
      if (::fstat(fd, &st) != 0) throw io_error("cannot stat", path_);
      if (st.st_size != size && ::ftruncate(fd, size) != 0) throw io_error("cannot resize", path_);
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (::close(fd) != 0) throw io_error("cannot write", path_);
  }

  void read(const Entry& entry, const torch::Tensor& dst) override {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw io_error("cannot open", path_);
    torch::Tensor host = dst.is_cpu() ? dst : torch::empty_like(dst, torch::kCPU);
    try {
      transfer(fd, host.data_ptr<uint8_t>(), entry.nbytes, entry.offset, false);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    if (!dst.is_cpu()) dst.copy_(host);
  }

  // Runs of entries that lie back to back in the file are read with one preadv each: one open and
  // one sequential stream per file for the kernel's readahead, instead of an open and a pread per
  // storage. (Measured alone, cold, this moved the onload from 0.60 to 0.61-0.71 of a plain read;
  // keeping the files, above, did the rest.)
  void read_all(const std::vector<const Entry*>& entries,
                const std::vector<torch::Tensor>& dsts) override {
    if (!dsts.empty() && !dsts.front().is_cpu()) return Stash::read_all(entries, dsts);
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw io_error("cannot open", path_);
    try {
      std::vector<iovec> run;
      int64_t run_offset = 0, run_bytes = 0;
      auto flush = [&] {
        read_vector(fd, run, run_offset, run_bytes);
        run.clear();
        run_bytes = 0;
      };
      for (size_t i = 0; i < entries.size(); ++i) {
        const Entry& e = *entries[i];
        if (!run.empty() && (run_offset + run_bytes != e.offset || run.size() == kMaxIovecs)) {
          flush();
        }
        if (run.empty()) run_offset = e.offset;
        run.push_back({dsts[i].data_ptr(), static_cast<size_t>(e.nbytes)});
        run_bytes += e.nbytes;
      }
      if (!run.empty()) flush();
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }

  void discard() override {}

 private:
  void transfer(int fd, uint8_t* data, int64_t nbytes, int64_t offset, bool writing) {
    int64_t done = 0;
    while (done < nbytes) {
      const size_t chunk = static_cast<size_t>(std::min<int64_t>(nbytes - done, 1 << 30));
      const ssize_t n = writing ? ::pwrite(fd, data + done, chunk, offset + done)
                                : ::pread(fd, data + done, chunk, offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n == 0) errno = writing ? ENOSPC : EIO;
        throw io_error(writing ? "cannot write" : "short read from", path_);
      }
      done += n;
    }
  }

  static constexpr size_t kMaxIovecs = 512;  // below IOV_MAX (1024 on Linux)

  // preadv of `bytes` bytes at `offset` into `iov`, resumed after short reads.
  void read_vector(int fd, std::vector<iovec> iov, int64_t offset, int64_t bytes) {
    size_t first = 0;
    int64_t done = 0;
    while (done < bytes) {
      const ssize_t n =
          ::preadv(fd, iov.data() + first, static_cast<int>(iov.size() - first), offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n == 0) errno = EIO;
        throw io_error("short read from", path_);
      }
      done += n;
      // Skip the buffers filled and trim the one filled in part.
      size_t left = static_cast<size_t>(n);
      while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
      if (left > 0) {
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
      }
    }
  }

  std::string path_;
};

// Pinned host buffers filled and drained with asynchronous copies on the current stream; wait()
// is the one synchronisation per group, before device storages are freed or buffers dropped. It
// synchronises the device the state lives on, which need not be the current one.
class HostStash : public Stash {
 public:
  HostStash(Tier tier, torch::Device device) : Stash(tier), device_(device) {}
  ~HostStash() override { discard(); }

 protected:
  void write(const std::vector<Entry>& entries, const std::vector<torch::Tensor>& bytes) override {
    for (size_t i = 0; i < entries.size(); ++i) {
      buffers_.push_back(
          torch::empty({entries[i].nbytes}, torch::dtype(torch::kByte).pinned_memory(true)));
      buffers_.back().copy_(bytes[i], /*non_blocking=*/true);
    }
    index_.clear();
    for (size_t i = 0; i < entries.size(); ++i) index_[entries[i].offset] = i;
  }

  void read(const Entry& entry, const torch::Tensor& dst) override {
    dst.copy_(buffers_.at(index_.at(entry.offset)), /*non_blocking=*/true);
  }

  void wait() override { torch::cuda::synchronize(device_.index()); }

  void discard() override {
    if (buffers_.empty()) return;
    wait();
    buffers_.clear();
    index_.clear();
  }

 private:
  torch::Device device_;
  std::vector<torch::Tensor> buffers_;
  std::map<int64_t, size_t> index_;
};

}  // namespace

void Stash::evict(const std::vector<torch::Tensor>& tensors) {
  TORCH_CHECK(entries_.empty(), "offload: a stash is evicted twice");
  std::unordered_set<const c10::StorageImpl*> seen;
  std::vector<torch::Tensor> bytes;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const auto* impl = t.storage().unsafeGetStorageImpl();
    if (impl->nbytes() == 0 || !seen.insert(impl).second) continue;
    entries_.push_back({t, static_cast<int64_t>(impl->nbytes()), offset});
    offset += entries_.back().nbytes;
    bytes.push_back(compat::storage_bytes(t));
  }
  if (entries_.empty()) return;
  write(entries_, bytes);
  wait();
  for (const auto& e : entries_) compat::free_storage(e.tensor);
}

void Stash::restore(const std::function<bool(const torch::Tensor&)>& keep) {
  std::vector<const Entry*> kept;
  std::vector<torch::Tensor> dsts;
  for (const auto& e : entries_) {
    if (!keep(e.tensor)) continue;
    compat::alloc_storage(e.tensor, static_cast<size_t>(e.nbytes));
    kept.push_back(&e);
    dsts.push_back(compat::storage_bytes(e.tensor));
  }
  if (!kept.empty()) read_all(kept, dsts);
  wait();
  discard();
  entries_.clear();
}

const Stash::Entry& Stash::entry_of(const torch::Tensor& tensor) const {
  for (const auto& e : entries_) {
    if (e.tensor.storage().unsafeGetStorageImpl() == tensor.storage().unsafeGetStorageImpl())
      return e;
  }
  throw std::logic_error("offload: the tensor is not in this stash");
}

void Stash::copy_out(const torch::Tensor& tensor, const torch::Tensor& dst) {
  const Entry& e = entry_of(tensor);
  TORCH_CHECK(dst.numel() * dst.element_size() == e.nbytes && dst.is_contiguous(),
              "offload: copy_out needs a contiguous destination of ", e.nbytes, " bytes");
  read(e, torch::from_blob(dst.data_ptr(), {e.nbytes},
                           torch::dtype(torch::kByte).device(dst.device())));
}

int64_t Stash::bytes(const std::function<bool(const torch::Tensor&)>& counted) const {
  int64_t total = 0;
  for (const auto& e : entries_) {
    if (counted(e.tensor)) total += e.nbytes;
  }
  return total;
}

std::unique_ptr<Stash> make_stash(Tier tier, const torch::Device& device, const std::string& path) {
  switch (tier) {
    case Tier::kFile:
      return std::make_unique<FileStash>(tier, path);
    case Tier::kHost:
      if (!device.is_cuda() || !torch::cuda::is_available()) {
        throw std::invalid_argument(fmt::format(
            "offload tier 'host' needs a CUDA compute device, and the mesh computes on {} (host "
            "memory already): use the 'file' tier",
            device.str()));
      }
      return std::make_unique<HostStash>(tier, device);
    case Tier::kCompute:
      break;
  }
  throw std::logic_error("offload: no stash for the compute tier");
}

void release_free_memory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

}  // namespace shardrl::offload
