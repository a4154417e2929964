// Distributed runtime: rendezvous, process groups with timed collectives, and the device mesh.
//
// A job starts the torchrun way: every rank reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
// (set by `shardrl launch`, torchrun or a Slurm wrapper) and meets the others through a TCP store
// hosted by rank 0. Collectives run over Gloo on CPU and NCCL on CUDA.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace c10d {
class Store;
class Work;
}  // namespace c10d

namespace shardrl::dist {

class Liveness;
class HostImage;

// A collective failed or timed out. The message names the op, this rank and, when it can be
// found out, the rank that stopped answering, or the store's host:port when rank 0, which hosts
// it, is gone or cut off. Finding that out takes a few seconds at most and never blocks: a rank
// that lost its peers reports and exits within the timeout plus that.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct InitOptions {
  std::string backend = "auto";  // "gloo", "nccl" or "auto" (nccl on CUDA)
  // Every collective and the rendezvous (`shardrl train`: actor_rollout_ref.nccl_timeout).
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

class ProcessGroup;

// A collective in flight. wait() completes it (running any local post-processing, such as the sum
// of a reduce-scatter) and turns transport failures into CollectiveError. On Gloo wait() blocks
// until the data is there, at most the group's timeout. On NCCL the collective runs on NCCL's own
// stream and wait() orders the current stream after it without blocking the host, so compute
// overlaps communication as in FSDP2; the blocking collectives (all_reduce, broadcast, barrier)
// wait on the host, bounded by the timeout, so a hang still ends in a named CollectiveError.
class Pending {
 public:
  Pending() = default;
  void wait();
  // For a collective whose result will never be read, after a failure: waits (at most the
  // timeout) until the transport is done with its buffers, so they may be freed, and reports
  // nothing.
  void abandon() noexcept;
  bool valid() const { return group_ != nullptr; }

 private:
  friend class ProcessGroup;
  ProcessGroup* group_ = nullptr;
  std::string op_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<void()> finish_;
  bool host_waits_ = true;
};

enum class ReduceOp { kSum, kMax };

class ProcessGroup {
 public:
  struct Impl;  // the transport; built by World
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  std::chrono::milliseconds timeout() const;
  // What carries the bulk collectives (all-gather, reduce-scatter, all-to-all): "nccl"; "shm",
  // shared memory, for CPU ranks that share a host (SHARDRL_SHM_DISABLE=1 turns it off);
  // "gloo (why not shm)", between hosts for one; "none" for a group of one.
  std::string bulk_transport() const;

  // out (contiguous, size() * shard.numel() elements) receives every rank's shard, rank-major.
  Pending all_gather_async(const torch::Tensor& shard, torch::Tensor out);
  // input holds size() equal contiguous chunks; out receives the sum of chunk[rank()] over ranks.
  // Gloo moves each chunk once (alltoall) and sums locally in fp32: (W-1)/W of the bytes, where
  // allreduce-then-slice would move about twice that. out may be wider than input (bf16 in, fp32
  // out) where sums_low_precision_in_fp32().
  Pending reduce_scatter_async(const torch::Tensor& input, torch::Tensor out);
  // Whether a reduce-scatter of bf16 or fp16 input sums in fp32 and rounds once into its output,
  // which may be wider (shared memory; Gloo, by its all-to-all and local sum; a group of one). Then
  // low-precision grads can travel as they are, at half the bytes of an fp32 wire, and sum to
  // exactly what fp32 copies of them would. NCCL sums in the wire's dtype.
  bool sums_low_precision_in_fp32() const;
  // Whether all_gather_segments_async and reduce_scatter_segments_async are available: the
  // transport reads and writes each rank's bytes where they are (shared memory), so FSDP gathers
  // into the params' own storage and reduces from the grads' own, with no pack in between.
  bool has_segment_collectives() const;
  // all_gather_async with the output in pieces: the shard is segments_numels.size() segments, in
  // order; rank q's segment s goes to parts[s] (contiguous) at q * segment_numels[s] elements,
  // cut at parts[s]'s end (FSDP: a param's rows, the last ranks' padding cut). No gather buffer
  // and no copy-out. The parts are written until wait() (or abandon()) returns.
  Pending all_gather_segments_async(const torch::Tensor& shard, std::vector<torch::Tensor> parts,
                                    std::vector<int64_t> segment_numels);
  // reduce_scatter_async with the input and the output in pieces: rank q's rows of segment s are
  // inputs[s] (contiguous, `dtype`) at q * segment_numels[s] elements, zeros past its end or
  // where inputs[s] is undefined (FSDP: a param's unsharded grad, or none). outputs[s]
  // (contiguous, segment_numels[s] elements, any floating dtype) receives `scale` times the sum
  // over ranks of this rank's rows, summed in fp32 at least. The inputs are read and the outputs
  // written until wait() (or abandon()) returns.
  Pending reduce_scatter_segments_async(std::vector<torch::Tensor> inputs,
                                        std::vector<int64_t> segment_numels,
                                        torch::ScalarType dtype, std::vector<torch::Tensor> outputs,
                                        double scale);
  // Where has_segment_collectives(): `bytes` of zeros that every rank of the group maps, for
  // FSDP's unsharded params, which the ranks of a host then share (see all_gather_in_image_async).
  // Collective. Null on every rank alike, with `why_not`, where the transport cannot
  // (/dev/shm too small, or not shared memory).
  std::shared_ptr<HostImage> map_host_image(size_t bytes, std::string* why_not);
  // all_gather_segments_async for parts that live in `image`: each rank writes only its own rows,
  // and reads its peers' where they are, so nothing is copied out. `generation` counts this
  // rank's all-gathers into the image, this one included. The call first waits, bounded by the
  // timeout, until every peer has resharded its last gather into the image, released with
  // HostImage::release.
  Pending all_gather_in_image_async(HostImage& image, uint64_t generation,
                                    const torch::Tensor& shard, std::vector<torch::Tensor> parts,
                                    std::vector<int64_t> segment_numels);
  void all_gather(const torch::Tensor& shard, torch::Tensor out) {
    all_gather_async(shard, out).wait();
  }
  void reduce_scatter(const torch::Tensor& input, torch::Tensor out) {
    reduce_scatter_async(input, out).wait();
  }
  // input holds size() equal contiguous chunks; chunk j goes to rank j, and out (shaped as input)
  // receives every rank's chunk for this rank, rank-major: Ulysses' sequence/head exchange.
  Pending all_to_all_async(const torch::Tensor& input, torch::Tensor out);
  void all_to_all(const torch::Tensor& input, torch::Tensor out) {
    all_to_all_async(input, out).wait();
  }
  // In place; blocks until the result is there (at most the timeout).
  void all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // In place; on NCCL, wait() only orders the current stream after it.
  Pending all_reduce_async(torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  void broadcast(torch::Tensor& tensor, int root);
  void barrier();

  // Payload bytes this rank handed to the transport, for traffic accounting.
  uint64_t bytes_sent() const { return bytes_sent_; }
  // Seconds this rank spent blocked waiting for collectives: communication not hidden by compute.
  double wait_seconds() const { return wait_seconds_; }
  void reset_bytes_sent() {
    bytes_sent_ = 0;
    wait_seconds_ = 0;
  }

  // Wraps a transport failure: finds which ranks still answer through the store and names the
  // ones that do not. Never returns.
  [[noreturn]] void raise_failure(const std::string& op, const std::string& cause);

 private:
  friend class Pending;
  Pending make_pending(std::string op, std::vector<c10::intrusive_ptr<c10d::Work>> works,
                       std::function<void()> finish = nullptr, bool host_needs_result = false);
  Pending start_all_reduce(torch::Tensor& tensor, ReduceOp op, bool host_needs_result);
  c10::intrusive_ptr<c10d::Work> launch(const std::string& op,
                                        const std::function<c10::intrusive_ptr<c10d::Work>()>& f);
  c10::intrusive_ptr<c10d::Work> launch_all_to_all(const std::string& op, torch::Tensor send,
                                                   torch::Tensor recv);

  std::unique_ptr<Impl> impl_;
  uint64_t bytes_sent_ = 0;
  double wait_seconds_ = 0;
};

// Every rank's string, in group rank order, on every rank of `group` (tensors on `device`).
std::vector<std::string> all_gather_strings(ProcessGroup& group, const std::string& mine,
                                            torch::Device device);

// The job: this process's place in it, the store, and the global process group.
class World {
 public:
  // Reads the torchrun environment. Without RANK and WORLD_SIZE it forms a world of one, so the
  // same program runs unsharded. Errors name the variable, the rank or the port at fault.
  static std::shared_ptr<World> init_from_env(const InitOptions& options = {});

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  torch::Device device() const { return device_; }
  ProcessGroup& group() { return *global_; }
  const InitOptions& options() const { return options_; }

  // Every rank must call this with the same ranks and tag, in the same order; members get their
  // group, others null. A tag may be used again: each call makes a distinct group.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& tag);

 private:
  World() = default;
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  std::string master_addr_ = "127.0.0.1";
  torch::Device device_ = torch::kCPU;
  InitOptions options_;
  bool use_nccl_ = false;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<Liveness> liveness_;
  std::shared_ptr<ProcessGroup> global_;
  std::map<std::string, int> tag_uses_;  // new_group calls per tag
};

// Ranks laid out as [replicate, shard]: parameters are sharded over `shard` ranks (fsdp_size) and
// replicated over the rest (hybrid sharding, HSDP). fsdp_size <= 0 or == world size gives 1-D FSDP.
//
// With Ulysses sequence parallelism (ulysses_sequence_parallel_size = sp > 1) the same ranks also
// form verl's (dp, sp) mesh: rank = dp_rank * sp + sp_rank, so a sequence-parallel group is a run
// of sp neighbouring ranks. FSDP still shards over every rank of the mesh, but the sp ranks of a
// group feed the same samples, each a slice of their sequence: the data-parallel size is the mesh
// size / sp, and FSDP averages gradients over it (summing the sp ranks' parts of each sample).
class DeviceMesh {
 public:
  static DeviceMesh create(World& world, int fsdp_size = -1,
                           int ulysses_sequence_parallel_size = 1);

  ProcessGroup& shard_group() const { return *shard_; }
  // Null for a 1-D mesh.
  ProcessGroup* replicate_group() const { return replicate_.get(); }
  int shard_size() const { return shard_->size(); }
  int replicate_size() const { return replicate_ ? replicate_->size() : 1; }
  // This rank among every rank of the mesh (replica-major), and their count: whose shard files a
  // checkpoint holds, whatever the sequence parallelism.
  int rank() const;
  int size() const { return shard_size() * replicate_size(); }
  // The ranks that hold different samples: size() / sequence_parallel_size().
  int data_parallel_size() const { return size() / sequence_parallel_size(); }
  int data_parallel_rank() const { return rank() / sequence_parallel_size(); }
  // The ranks at this rank's sp position, one per data-parallel rank: a gather over it sees every
  // sample once (global advantage statistics, say). The world's group when sp == 1.
  ProcessGroup& data_parallel_group() const { return *data_parallel_; }
  // This rank's Ulysses group (null when sp == 1): the ranks that split each sample's sequence.
  const std::shared_ptr<ProcessGroup>& sequence_parallel_group() const { return sequence_; }
  int sequence_parallel_size() const { return sequence_ ? sequence_->size() : 1; }
  torch::Device device() const { return device_; }

 private:
  std::shared_ptr<ProcessGroup> shard_, replicate_, data_parallel_, sequence_;
  torch::Device device_ = torch::kCPU;
};

}  // namespace shardrl::dist
