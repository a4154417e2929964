#include "comm/process_group_impl.h"

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <thread>

namespace shardrl::dist {
namespace {

uint64_t nbytes(const torch::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

// After a collective wrote `on_device`, a staged copy of the host tensor `out`
// (ProcessGroup::Impl::staged): the copy back, or nothing when the collective wrote `out` itself.
std::function<void()> copy_back(torch::Tensor out, torch::Tensor on_device) {
  if (on_device.is_same(out)) return nullptr;
  return [out, on_device]() mutable { out.copy_(on_device); };
}

// Blocks until `work` is done: on the host, at most `timeout`, or (NCCL, host_waits false) by
// making the current stream wait for NCCL's while the host goes on. Throws the transport's error.
void wait_on(c10d::Work& work, bool host_waits, std::chrono::milliseconds timeout) {
  if (host_waits) {
    work.wait(timeout);
  } else {
    work.wait();
  }
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() {
  // Gloo's destructor drains its queue first, and after a failure every queued collective would
  // wait out its own timeout against a peer that is gone: a rank reporting a lost peer could take
  // minutes to exit. A failed transport is left to the process's end instead.
  if (impl_ && impl_->failed && impl_->backend) (void)impl_->backend.release();
}

int ProcessGroup::rank() const {
  return impl_->rank;
}
int ProcessGroup::size() const {
  return static_cast<int>(impl_->global_ranks.size());
}
const std::string& ProcessGroup::name() const {
  return impl_->name;
}
std::string ProcessGroup::bulk_transport() const {
  if (size() == 1) return "none";
  if (impl_->is_nccl) return "nccl";
  return impl_->shm ? "shm" : fmt::format("gloo ({})", impl_->no_shm_because);
}
std::chrono::milliseconds ProcessGroup::timeout() const {
  return impl_->timeout;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::launch(
    const std::string& op, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  try {
    return start();
  } catch (const std::exception& e) {
    raise_failure(op, e.what());
  }
}

Pending ProcessGroup::make_pending(std::string op,
                                   std::vector<c10::intrusive_ptr<c10d::Work>> works,
                                   std::function<void()> finish, bool host_needs_result) {
  Pending p;
  p.group_ = this;
  p.op_ = std::move(op);
  p.works_ = std::move(works);
  p.finish_ = std::move(finish);
  p.host_waits_ = !impl_->is_nccl || host_needs_result;
  return p;
}

void Pending::abandon() noexcept {
  if (!group_) return;
  ProcessGroup* group = group_;
  group_ = nullptr;
  for (auto& work : works_) {
    try {
      wait_on(*work, host_waits_, group->timeout());
    } catch (...) {
      // Its failure, if any, is the one already reported.
    }
  }
  works_.clear();
  finish_ = nullptr;
}

void Pending::wait() {
  if (!group_) return;
  ProcessGroup* group = group_;
  group_ = nullptr;  // a failed wait must not be waited on again
  const auto start = std::chrono::steady_clock::now();
  for (auto& work : works_) {
    try {
      wait_on(*work, host_waits_, group->timeout());
    } catch (const std::exception& e) {
      group->raise_failure(op_, e.what());
    }
  }
  works_.clear();
  group->wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (finish_) finish_();
}

Pending ProcessGroup::all_gather_async(const torch::Tensor& shard, torch::Tensor out) {
  const int group_size = size();
  const int64_t n = shard.numel();
  TORCH_CHECK(out.is_contiguous() && out.numel() == n * group_size,
              "all_gather: output must be contiguous with world_size * shard numel elements");
  TORCH_CHECK(out.scalar_type() == shard.scalar_type(), "all_gather: dtype mismatch");
  torch::Tensor flat_out = out.view(-1);
  torch::Tensor flat_in = shard.reshape(-1);
  bytes_sent_ += static_cast<uint64_t>(group_size - 1) * nbytes(shard);
  if (group_size == 1) {
    if (flat_out.data_ptr() != flat_in.data_ptr()) flat_out.copy_(flat_in);
    return make_pending("all_gather", {});
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (impl_->is_nccl) {
    torch::Tensor in = impl_->staged(flat_in), gathered = impl_->staged(flat_out);
    works.push_back(launch("all_gather", [&] {
      return impl_->backend->_allgather_base(gathered, in, c10d::AllgatherOptions());
    }));
    auto finish = copy_back(flat_out, gathered);
    const bool host_reads = finish != nullptr;  // the host waits for a staged result
    return make_pending("all_gather", std::move(works), std::move(finish), host_reads);
  }
  if (impl_->shm) {
    works.push_back(
        launch("all_gather", [&] { return impl_->shm->all_gather(flat_in, flat_out); }));
    return make_pending("all_gather", std::move(works));
  }
  // Gloo's list all-gather copies through its own buffer; W broadcasts straight into views of the
  // output were measured faster here and send the same (W-1)/W of the bytes.
  torch::Tensor mine = flat_out.narrow(0, rank() * n, n);
  if (mine.data_ptr() != flat_in.data_ptr()) mine.copy_(flat_in);
  auto views = std::make_shared<std::vector<std::vector<at::Tensor>>>(group_size);
  for (int r = 0; r < group_size; ++r) {
    (*views)[r] = {flat_out.narrow(0, r * n, n)};
    c10d::BroadcastOptions opts;
    opts.rootRank = r;
    opts.timeout = timeout();
    works.push_back(
        launch("all_gather", [&] { return impl_->backend->broadcast((*views)[r], opts); }));
  }
  return make_pending("all_gather", std::move(works), [views] {});
}

bool ProcessGroup::sums_low_precision_in_fp32() const {
  return !impl_->is_nccl;
}

bool ProcessGroup::has_segment_collectives() const {
  return impl_->shm != nullptr;
}

namespace {

// all_gather_segments' parts, flattened, after the checks both of its forms make.
void check_gather_parts(const char* op, const torch::Tensor& shard,
                        std::vector<torch::Tensor>& parts,
                        const std::vector<int64_t>& segment_numels, int group_size) {
  TORCH_CHECK(parts.size() == segment_numels.size(), op, ": one part per segment");
  int64_t total = 0;
  for (size_t s = 0; s < parts.size(); ++s) {
    TORCH_CHECK(parts[s].is_contiguous() && parts[s].scalar_type() == shard.scalar_type() &&
                    parts[s].numel() <= group_size * segment_numels[s],
                op, ": part ", s,
                " must be contiguous, of the shard's dtype, and hold at most size() * its "
                "segment's elements");
    parts[s] = parts[s].view(-1);
    total += segment_numels[s];
  }
  TORCH_CHECK(total == shard.numel(), op, ": the segments must cover the shard");
}

}  // namespace

Pending ProcessGroup::all_gather_segments_async(const torch::Tensor& shard,
                                                std::vector<torch::Tensor> parts,
                                                std::vector<int64_t> segment_numels) {
  TORCH_CHECK(impl_->shm, "all_gather_segments: process group '", name(),
              "' has no transport that takes segments (see has_segment_collectives())");
  check_gather_parts("all_gather_segments", shard, parts, segment_numels, size());
  bytes_sent_ += static_cast<uint64_t>(size() - 1) * nbytes(shard);
  torch::Tensor flat_in = shard.reshape(-1);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.push_back(launch("all_gather", [&] {
    return impl_->shm->all_gather_segments(flat_in, std::move(parts), std::move(segment_numels));
  }));
  return make_pending("all_gather", std::move(works));
}

std::shared_ptr<HostImage> ProcessGroup::map_host_image(size_t bytes, std::string* why_not) {
  if (!impl_->shm) {
    *why_not = fmt::format("process group '{}' does not use shared memory", name());
    return nullptr;
  }
  std::shared_ptr<HostImage> image;
  launch("map_host_image", [&] {
    image = impl_->shm->map_image(bytes, why_not);
    return c10::intrusive_ptr<c10d::Work>();
  });
  return image;
}

Pending ProcessGroup::all_gather_in_image_async(HostImage& image, uint64_t generation,
                                                const torch::Tensor& shard,
                                                std::vector<torch::Tensor> parts,
                                                std::vector<int64_t> segment_numels) {
  TORCH_CHECK(impl_->shm, "all_gather_in_image: process group '", name(),
              "' does not use shared memory");
  check_gather_parts("all_gather_in_image", shard, parts, segment_numels, size());
  // The same count as any all-gather: what each rank makes its peers' to read.
  bytes_sent_ += static_cast<uint64_t>(size() - 1) * nbytes(shard);
  torch::Tensor flat_in = shard.reshape(-1);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.push_back(launch("all_gather", [&] {
    return impl_->shm->all_gather_in_image(image, generation, flat_in, std::move(parts),
                                           std::move(segment_numels));
  }));
  return make_pending("all_gather", std::move(works));
}

Pending ProcessGroup::reduce_scatter_segments_async(std::vector<torch::Tensor> inputs,
                                                    std::vector<int64_t> segment_numels,
                                                    torch::ScalarType dtype,
                                                    std::vector<torch::Tensor> outputs,
                                                    double scale) {
  TORCH_CHECK(impl_->shm, "reduce_scatter_segments: process group '", name(),
              "' has no transport that takes segments (see has_segment_collectives())");
  TORCH_CHECK(inputs.size() == segment_numels.size() && outputs.size() == segment_numels.size(),
              "reduce_scatter_segments: one input and one output per segment");
  int64_t total = 0;
  for (size_t s = 0; s < inputs.size(); ++s) {
    if (inputs[s].defined()) {
      TORCH_CHECK(inputs[s].is_contiguous() && inputs[s].scalar_type() == dtype &&
                      inputs[s].numel() <= size() * segment_numels[s],
                  "reduce_scatter_segments: input ", s, " must be contiguous, of dtype ",
                  c10::toString(dtype), ", and hold at most size() * its segment's elements");
      inputs[s] = inputs[s].view(-1);
    }
    TORCH_CHECK(outputs[s].defined() && outputs[s].is_contiguous() &&
                    outputs[s].numel() == segment_numels[s] &&
                    c10::isFloatingType(outputs[s].scalar_type()) &&
                    outputs[s].scalar_type() == outputs.front().scalar_type(),
                "reduce_scatter_segments: output ", s,
                " must be contiguous, hold its segment's elements, and share the others' "
                "floating dtype");
    outputs[s] = outputs[s].view(-1);
    total += segment_numels[s];
  }
  bytes_sent_ += static_cast<uint64_t>(size() - 1) * total * c10::elementSize(dtype);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.push_back(launch("reduce_scatter", [&] {
    return impl_->shm->reduce_scatter_segments(std::move(inputs), std::move(segment_numels), dtype,
                                               std::move(outputs), scale);
  }));
  return make_pending("reduce_scatter", std::move(works));
}

Pending ProcessGroup::reduce_scatter_async(const torch::Tensor& input, torch::Tensor out) {
  const int group_size = size();
  const int64_t n = out.numel();
  TORCH_CHECK(input.is_contiguous() && input.numel() == n * group_size,
              "reduce_scatter: input must be contiguous with world_size * output numel elements");
  TORCH_CHECK(input.scalar_type() == out.scalar_type() || sums_low_precision_in_fp32(),
              "reduce_scatter: process group '", name(), "' sums in the input's dtype (",
              c10::toString(input.scalar_type()), "); the output must have it too, not ",
              c10::toString(out.scalar_type()));
  bytes_sent_ += static_cast<uint64_t>(group_size - 1) * n * input.element_size();
  if (group_size == 1) {
    out.view(-1).copy_(input.view(-1));
    return make_pending("reduce_scatter", {});
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (impl_->is_nccl) {
    torch::Tensor flat_out = out.view(-1);
    torch::Tensor in = impl_->staged(input.view(-1)), reduced = impl_->staged(flat_out);
    works.push_back(launch("reduce_scatter", [&] {
      return impl_->backend->_reduce_scatter_base(reduced, in, c10d::ReduceScatterOptions());
    }));
    auto finish = copy_back(flat_out, reduced);
    const bool host_reads = finish != nullptr;  // the host waits for a staged result
    return make_pending("reduce_scatter", std::move(works), std::move(finish), host_reads);
  }
  if (impl_->shm) {
    // The transport sums straight into a contiguous output.
    torch::Tensor target = out.is_contiguous() ? out.view(-1) : torch::empty({n}, out.options());
    works.push_back(launch("reduce_scatter",
                           [&] { return impl_->shm->reduce_scatter(input.view(-1), target); }));
    std::function<void()> finish;
    if (!out.is_contiguous())
      finish = [out, target]() mutable { out.copy_(target.view(out.sizes())); };
    return make_pending("reduce_scatter", std::move(works), std::move(finish));
  }
  // alltoall hands chunk j to rank j; every rank then sums the W chunks it received.
  auto received = torch::empty_like(input);
  torch::Tensor send = input.view(-1);
  works.push_back(launch_all_to_all("reduce_scatter", send, received.view(-1)));
  return make_pending(
      "reduce_scatter", std::move(works), [received, out, send, group_size, n]() mutable {
        torch::Tensor rows = received.view({group_size, n});
        if (rows.scalar_type() == torch::kFloat || rows.scalar_type() == torch::kDouble) {
          if (out.scalar_type() == rows.scalar_type() && out.is_contiguous()) {
            torch::Tensor flat = out.view(-1);
            torch::sum_out(flat, rows, 0);
          } else {
            out.view(-1).copy_(rows.sum(0));
          }
        } else {
          // Low-precision inputs are summed in fp32 and rounded once.
          out.view(-1).copy_(rows.to(torch::kFloat).sum(0));
        }
      });
}

Pending ProcessGroup::all_to_all_async(const torch::Tensor& input, torch::Tensor out) {
  const int group_size = size();
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous() && out.numel() == input.numel() &&
                  input.numel() % group_size == 0,
              "all_to_all: input and output must be contiguous, of the same size, in size() equal "
              "chunks");
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "all_to_all: dtype mismatch");
  bytes_sent_ += nbytes(input) / group_size * (group_size - 1);
  if (group_size == 1) {
    if (out.data_ptr() != input.data_ptr()) out.copy_(input);
    return make_pending("all_to_all", {});
  }
  torch::Tensor send = input.view(-1);
  torch::Tensor recv = out.view(-1);
  if (impl_->shm) {
    return make_pending("all_to_all",
                        {launch("all_to_all", [&] { return impl_->shm->all_to_all(send, recv); })});
  }
  // The buffers must outlive the transfer, whoever drops their tensors first.
  return make_pending("all_to_all", {launch_all_to_all("all_to_all", send, recv)}, [send, recv] {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::launch_all_to_all(const std::string& op,
                                                               torch::Tensor send,
                                                               torch::Tensor recv) {
  // Equal splits along dim 0 (empty split lists): chunk j of `send` goes to rank j.
  c10d::AllToAllOptions opts;
  opts.timeout = timeout();
  std::vector<int64_t> equal_splits;
  return launch(op, [&] {
    return impl_->backend->alltoall_base(recv, send, equal_splits, equal_splits, opts);
  });
}

Pending ProcessGroup::start_all_reduce(torch::Tensor& tensor, ReduceOp op, bool host_needs_result) {
  if (size() == 1) return make_pending("all_reduce", {});
  torch::Tensor on_device = impl_->staged(tensor);
  auto finish = copy_back(tensor, on_device);
  if (finish) host_needs_result = true;  // the host waits for a staged result
  std::vector<at::Tensor> tensors{on_device};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
  opts.timeout = timeout();
  bytes_sent_ += 2 * nbytes(tensors[0]) * (size() - 1) / size();
  auto work = launch("all_reduce", [&] { return impl_->backend->allreduce(tensors, opts); });
  return make_pending("all_reduce", {work}, std::move(finish), host_needs_result);
}

void ProcessGroup::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  start_all_reduce(tensor, op, /*host_needs_result=*/true).wait();
}

Pending ProcessGroup::all_reduce_async(torch::Tensor& tensor, ReduceOp op) {
  return start_all_reduce(tensor, op, /*host_needs_result=*/false);
}

void ProcessGroup::broadcast(torch::Tensor& tensor, int root) {
  if (size() == 1) return;
  torch::Tensor on_device = impl_->staged(tensor);
  std::vector<at::Tensor> tensors{on_device};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout();
  if (rank() == root) bytes_sent_ += nbytes(tensor) * (size() - 1);
  auto work = launch("broadcast", [&] { return impl_->backend->broadcast(tensors, opts); });
  make_pending("broadcast", {work}, copy_back(tensor, on_device), /*host_needs_result=*/true)
      .wait();
}

void ProcessGroup::barrier() {
  if (size() == 1) return;
  c10d::BarrierOptions opts;
  opts.timeout = timeout();
  auto work = launch("barrier", [&] { return impl_->backend->barrier(opts); });
  make_pending("barrier", {work}, nullptr, /*host_needs_result=*/true).wait();
}

void ProcessGroup::raise_failure(const std::string& op, const std::string& cause) {
  impl_->failed = true;
  // Shared-memory collectives still in flight would otherwise wait out their timeout.
  if (impl_->shm) impl_->shm->abort(fmt::format("an earlier {} of the group failed", op));
  std::string culprit;
  try {
    culprit = impl_->liveness ? impl_->liveness->describe_unresponsive(impl_->global_ranks)
                              : "no liveness information";
  } catch (const std::exception& e) {
    culprit = fmt::format("the liveness probe failed ({})", e.what());
  }
  std::string first_line = cause.substr(0, cause.find('\n'));
  throw CollectiveError(
      fmt::format("{} failed on rank {} (process group '{}', timeout {} ms): {}. "
                  "Transport said: {}",
                  op, impl_->world_rank, impl_->name, impl_->timeout.count(), culprit, first_line));
}

std::vector<std::string> all_gather_strings(ProcessGroup& group, const std::string& mine,
                                            torch::Device device) {
  const int n = group.size();
  const torch::Tensor length =
      torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong).to(device);
  torch::Tensor lengths = torch::empty({n}, torch::dtype(torch::kLong).device(device));
  group.all_gather(length, lengths);
  lengths = lengths.cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  torch::Tensor bytes = torch::zeros({longest}, torch::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  torch::Tensor all = torch::empty({n * longest}, torch::dtype(torch::kByte).device(device));
  group.all_gather(bytes.to(device), all);
  all = all.cpu();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    const char* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest;
    out.emplace_back(p, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

}  // namespace shardrl::dist
