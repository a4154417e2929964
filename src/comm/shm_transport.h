// The bulk collectives of ranks that share a host, through one shared-memory segment.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "compat.h"

namespace shardrl::dist {

// Memory that every rank of a group maps, from /dev/shm: FSDP's unsharded params, which the ranks
// of one host then share instead of each holding, and refilling, a copy of all of them. A rank
// writes only its own rows into it, and reads its peers' rows where they are.
//
// Its header holds, for each rank, the number of the last all-gather into the image whose rows
// that rank no longer reads. A rank writes its rows of gather g only once every peer has
// released gather g - 1 (ShmTransport::all_gather_in_image), so nobody overwrites rows a peer
// still computes with.
class HostImage {
 public:
  ~HostImage();
  HostImage(const HostImage&) = delete;
  HostImage& operator=(const HostImage&) = delete;
  char* data() const { return data_; }
  // This rank reads nothing that gathers up to number `generation` wrote any more.
  void release(uint64_t generation);

 private:
  friend class ShmTransport;
  HostImage() = default;
  std::atomic<uint32_t>* released(int rank) const;
  char* base_ = nullptr;  // the mapping: the header, then the data
  char* data_ = nullptr;
  size_t mapped_ = 0;
  int rank_ = 0;
};

// FSDP's all-gathers and reduce-scatters (and Ulysses' all-to-all) between ranks of one host,
// without the network stack. On Gloo's TCP loopback the kernel copies every byte twice and Gloo's
// threads compete with compute for the same cores; here a rank copies each piece once into its
// slot of a shared segment and every reader copies (or sums) it out once, as NCCL's SHM transport
// and DeepSpeed's CPU shm all-reduce do.
//
// The segment holds, per rank, two slots of `slot_bytes` (double buffering: a rank fills one while
// its peers read the other) and the counters that order them: how many pieces a rank has published
// and how many of each peer's pieces it has consumed. Waits sleep on futexes in slices; each slice
// checks whether the awaited peer's process still exists (a pidfd), so a dead peer is reported at
// once and a stuck one at the group's timeout, both as exceptions that ProcessGroup turns into a
// named CollectiveError. Every piece carries its collective's number, kind and size, so ranks that
// call different collectives fail with both named instead of exchanging the wrong bytes.
//
// Collectives run in the order they were issued, on one thread per group; the returned Work
// completes when this rank's part is done.
class ShmTransport {
 public:
  // Collective over the group: every rank calls it at the same point. Returns null on every rank
  // alike when the ranks do not share a host (boot, /dev/shm, network and PID namespaces), when
  // SHARDRL_SHM_DISABLE=1 is set on any of them, or when the segment cannot be made; `why_not`
  // says which. `global_ranks` names the group's ranks in messages.
  static std::unique_ptr<ShmTransport> connect(c10d::Store& store, int rank,
                                               std::vector<int> global_ranks,
                                               std::chrono::milliseconds timeout,
                                               std::string* why_not);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Flat contiguous CPU tensors, as ProcessGroup's collectives of the same names describe them.
  c10::intrusive_ptr<c10d::Work> all_gather(torch::Tensor in, torch::Tensor out);
  c10::intrusive_ptr<c10d::Work> reduce_scatter(torch::Tensor in, torch::Tensor out);
  c10::intrusive_ptr<c10d::Work> all_to_all(torch::Tensor in, torch::Tensor out);
  // all_gather with the output in pieces, as ProcessGroup::all_gather_segments_async describes:
  // each rank's bytes go straight where they belong, with no rank-major buffer in between.
  c10::intrusive_ptr<c10d::Work> all_gather_segments(torch::Tensor in,
                                                     std::vector<torch::Tensor> parts,
                                                     std::vector<int64_t> segment_numels);
  // reduce_scatter with the input and the output in pieces, as
  // ProcessGroup::reduce_scatter_segments_async describes: each rank's rows are read where they
  // are and each segment's sum, times `scale`, goes to its own output.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_segments(std::vector<torch::Tensor> inputs,
                                                         std::vector<int64_t> segment_numels,
                                                         c10::ScalarType dtype,
                                                         std::vector<torch::Tensor> outputs,
                                                         double scale);
  // Collective: maps `bytes` of zeros that every rank of the group shares, in a file of /dev/shm
  // that rank 0 makes and unlinks once all have mapped it. Null on every rank alike, with
  // `why_not`, where any rank cannot (/dev/shm too small: Docker gives 64 MB by default).
  std::shared_ptr<HostImage> map_image(size_t bytes, std::string* why_not);
  // all_gather_segments for parts that live in `image` (`generation`: this rank's all-gathers
  // into the image so far, this one included, the same on every rank). Waits until every peer
  // has released gather generation - 1, writes this rank's own rows now and returns a Work that
  // completes once every rank has written its own: there is nothing to copy out.
  c10::intrusive_ptr<c10d::Work> all_gather_in_image(HostImage& image, uint64_t generation,
                                                     const torch::Tensor& in,
                                                     std::vector<torch::Tensor> parts,
                                                     std::vector<int64_t> segment_numels);
  // After a failure elsewhere in the group: collectives in flight give up within one wait slice
  // and later ones fail at once, so nothing waits on a group that is being abandoned.
  void abort(const std::string& why);

  struct Impl;

 private:
  explicit ShmTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardrl::dist
