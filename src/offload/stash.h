// Where the bytes of evicted storages wait: a file on local disk or pinned host memory.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardrl/offload.h"

namespace shardrl::offload {

// One group of storages moved out of compute memory together (one unit's grads, say). The
// tensors stay valid objects whose storages hold no bytes until restore().
class Stash {
 public:
  explicit Stash(Tier tier) : tier_(tier) {}
  virtual ~Stash() = default;
  Stash(const Stash&) = delete;
  Stash& operator=(const Stash&) = delete;

  Tier tier() const { return tier_; }
  // Saves the storages of `tensors` (each once, empty ones skipped) and frees them.
  void evict(const std::vector<torch::Tensor>& tensors);
  // Refills the storages of the evicted tensors `keep` accepts, then forgets every one of them.
  void restore(const std::function<bool(const torch::Tensor&)>& keep);
  // Copies the bytes of evicted `tensor` into `dst` (compute memory), leaving it evicted.
  void copy_out(const torch::Tensor& tensor, const torch::Tensor& dst);
  // Bytes held for the evicted tensors `counted` accepts.
  int64_t bytes(const std::function<bool(const torch::Tensor&)>& counted) const;

 protected:
  struct Entry {
    torch::Tensor tensor;
    int64_t nbytes = 0;
    int64_t offset = 0;  // in the group, entries back to back
  };
  // Saves each entry from `bytes` (its storage, as a byte tensor).
  virtual void write(const std::vector<Entry>& entries,
                     const std::vector<torch::Tensor>& bytes) = 0;
  // Fills `dst` (a byte tensor in compute memory) with the entry's saved bytes.
  virtual void read(const Entry& entry, const torch::Tensor& dst) = 0;
  // read() of several entries, in offset order; a tier may do them as one stream.
  virtual void read_all(const std::vector<const Entry*>& entries,
                        const std::vector<torch::Tensor>& dsts) {
    for (size_t i = 0; i < entries.size(); ++i) read(*entries[i], dsts[i]);
  }
  // Waits for the copies issued so far (asynchronous tiers).
  virtual void wait() {}
  // Drops the saved copies once restored.
  virtual void discard() = 0;

 private:
  const Entry& entry_of(const torch::Tensor& tensor) const;
  Tier tier_;
  std::vector<Entry> entries_;
};

// `path` names the file of the file tier; ignored by the host tier.
std::unique_ptr<Stash> make_stash(Tier tier, const torch::Device& device, const std::string& path);

// Hands freed heap memory back to the system (glibc keeps it otherwise, see World's allocator
// tuning), so that offloading lowers the resident set.
void release_free_memory();

}  // namespace shardrl::offload
