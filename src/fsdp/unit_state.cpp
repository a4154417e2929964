#include "fsdp/unit_state.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>

#include "comm/shm_transport.h"
#include "compat.h"
#include "fsdp/trace.h"

namespace shardrl::fsdp {
namespace {

std::string current_exception_message() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

}  // namespace

UnitState::UnitState(std::shared_ptr<torch::nn::Module> module_in, const dist::DeviceMesh& mesh_in,
                     const Options& options_in)
    : module(std::move(module_in)), path(module->name()), mesh(mesh_in), options(options_in) {}

void UnitState::check_usable() const {
  if (!root || root->failure.empty()) return;
  throw std::runtime_error(fmt::format(
      "FSDP unit '{}' cannot run: {}. Its buffers were never filled and the ranks' collectives "
      "may be out of step, so this model cannot be used again in this process: restart the job "
      "(from the last checkpoint)",
      path, root->failure));
}

void UnitState::shard_parameters(const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  const int group_size = mesh.shard_size();
  const int rank = mesh.shard_group().rank();
  int64_t total = 0;
  for (const auto& [name, param] : named) {
    params.emplace_back(name, param, group_size);
    total += params.back().shard_numel();
  }
  flat_shard = torch::zeros({total}, torch::dtype(torch::kFloat).device(mesh.device()));
  int64_t offset = 0;
  for (auto& slot : params) {
    slot.shard_into(flat_shard, offset, rank, options.mixed_precision.param_dtype);
    offset += slot.shard_numel();
  }
}

void UnitState::unshard() {
  if (stage != Stage::kSharded || params.empty()) return;
  if (parked_ && root && root->backward_callback_queued) {
    reuse_parked_gather();
    return;
  }
  for (const auto& slot : params) {
    // Every rank has the same flags, so every rank stops here before the collective.
    TORCH_CHECK(!slot.awaiting_load, "FSDP: parameter '", slot.name(), "' of unit ", module->name(),
                " was created under fsdp::EmptyInit and has no values yet: load the model "
                "(checkpoint::load_hf_from_rank0, load_hf or checkpoint::load) before using it");
  }
  check_usable();
  torch::NoGradGuard no_grad;
  torch::Tensor shard = residency ? residency->gather_input(view()) : flat_shard;
  dist::ProcessGroup& group = mesh.shard_group();
  if (group.size() == 1) {
    // Nothing to gather (FSDP2 skips the collective here too): each param is filled from its
    // shard, cast to the compute dtype in the same pass. No gather buffer, no second copy.
    all_gather_copy_out(params, shard.reshape({1, -1}), 1);
    gathering_in_place_ = true;  // nothing is left for wait_for_unshard to copy out
    gather_pending_ = dist::Pending();
    trace::record(trace::Event::kGatherIssued, *this, options.mixed_precision.param_dtype, 0);
    stage = Stage::kUnsharding;
    return;
  }
  torch::Tensor input = all_gather_input(shard, options.mixed_precision.param_dtype);
  const uint64_t sent_before = group.bytes_sent();
  try {
    if (group.has_segment_collectives()) {
      if (!image_tried_) map_host_image();
      gathering_in_place_ = true;
      parked_ = false;  // the gather releases this rank's hold on the image's last rows
      gather_pending_ = image_ ? all_gather_into_image(group, image_, ++image_gathers_, input,
                                                       params, image_offsets_)
                               : all_gather_into_params(group, input, params);
    } else {
      gather_output_ = torch::empty({mesh.shard_size() * flat_shard.numel()}, input.options());
      gather_pending_ = group.all_gather_async(input, gather_output_);
    }
  } catch (...) {
    drop_gather();
    root->fail(*this, "all-gather", current_exception_message());
    throw;
  }
  if (trace::enabled()) {
    trace::record(trace::Event::kGatherIssued, *this, input.scalar_type(),
                  mesh.shard_group().bytes_sent() - sent_before);
  }
  stage = Stage::kUnsharding;
}

void UnitState::drop_gather() {
  if (gathering_in_place_) {
    // The transport writes the params' storage until it is done; only then may it be freed.
    gather_pending_.abandon();
    free_unsharded();
    gathering_in_place_ = false;
  }
  gather_pending_ = dist::Pending();
  gather_output_ = torch::Tensor();
  stage = Stage::kSharded;
}

void UnitState::wait_for_unshard() {
  if (params.empty()) {
    stage = Stage::kUnsharded;
    return;
  }
  if (stage == Stage::kUnsharded) return;
  // A gather started before another unit's collective failed is not waited on: its output could
  // hold another collective's data.
  check_usable();
  if (stage == Stage::kSharded) unshard();
  if (stage == Stage::kUnsharded) return;  // a parked gather, reused
  try {
    gather_pending_.wait();
  } catch (...) {
    // The output was never filled: sharded, and the model refuses to run (a retried gather would
    // pair with whatever collective the other ranks are in).
    drop_gather();
    root->fail(*this, "all-gather", current_exception_message());
    throw;
  }
  if (!gathering_in_place_) all_gather_copy_out(params, gather_output_, mesh.shard_size());
  gathering_in_place_ = false;
  gather_output_ = torch::Tensor();
  stage = Stage::kUnsharded;
  trace::record(trace::Event::kGatherWaited, *this);
}

void UnitState::reshard(bool for_backward) {
  if (stage == Stage::kUnsharding) {
    if (root && !root->failure.empty()) {
      drop_gather();  // never read; resharding must not throw (UnshardScope's destructor)
    } else {
      wait_for_unshard();  // must complete on every rank
    }
  }
  if (held_unsharded) return;
  free_unsharded(/*keep_rows=*/for_backward && stage == Stage::kUnsharded);
  stage = Stage::kSharded;
}

void UnitState::free_unsharded(bool keep_rows) {
  for (auto& slot : params) compat::free_storage(slot.unsharded());
  if (!image_) return;
  parked_ = keep_rows;
  if (!parked_) image_->release(image_gathers_);
}

void UnitState::reuse_parked_gather() {
  point_params_at_image(params, image_, image_offsets_);
  parked_ = false;
  stage = Stage::kUnsharded;
  trace::record(trace::Event::kGatherReused, *this);
}

void UnitState::map_host_image() {
  image_tried_ = true;
  if (!options.host_shared_params || !mesh.device().is_cpu()) return;
  int64_t bytes = 0;
  for (const auto& slot : params) {
    image_offsets_.push_back(bytes);
    bytes += (slot.unsharded_bytes() + 63) / 64 * 64;  // each param on a cache line of its own
  }
  std::string why_not;
  image_ = mesh.shard_group().map_host_image(static_cast<size_t>(bytes), &why_not);
  static std::atomic<bool> said{false};  // once a process: every unit would say the same
  if (!image_ && mesh.shard_group().rank() == 0 && !said.exchange(true)) {
    fmt::print(stderr,
               "FSDP: each rank holds unsharded params of its own (from unit '{}' on): {}\n", path,
               why_not);
  }
}

void UnitState::reduce_grads() {
  std::vector<ParamSlot*> trainable;
  for (auto& slot : params) {
    if (slot.unsharded().requires_grad()) trainable.push_back(&slot);
  }
  if (trainable.empty()) return;
  if (!root->requires_gradient_sync) {
    for (ParamSlot* slot : trainable)
      slot->keep_grad_for_sync(options.mixed_precision.reduce_dtype);
    kept_grads_since_reduce_ = true;
    return;
  }
  check_usable();

  dist::ProcessGroup& group = mesh.shard_group();
  dist::ProcessGroup* replicate = mesh.replicate_group();
  auto reduction = std::make_shared<GradReduceScatter>();
  const uint64_t sent_before = group.bytes_sent();
  try {
    *reduction = reduce_scatter_grads(group, trainable, options.mixed_precision.reduce_dtype,
                                      1.0 / mesh.data_parallel_size(), replicate != nullptr,
                                      kept_grads_since_reduce_);
  } catch (...) {
    root->fail(*this, "reduce-scatter", current_exception_message());
    throw;
  }
  kept_grads_since_reduce_ = false;
  if (trace::enabled()) {
    trace::record(trace::Event::kReduceScatterIssued, *this, reduction->wire,
                  group.bytes_sent() - sent_before);
  }
  dist::Pending pending = std::move(reduction->pending);
  root->enqueue_reduce(this, std::move(pending), [this, reduction, replicate] {
    torch::NoGradGuard guard;
    reduction->sent.clear();
    if (replicate) {
      reduction->flat = reduction->flat.to(torch::kFloat);
      replicate->all_reduce_async(reduction->flat).wait();
    }
    // Offloaded grad shards come in to take the sum and go back after it.
    if (residency) residency->acquire(view(), ShardUse::kGrads);
    auto created = reduce_scatter_copy_out(*reduction);
    if (residency) residency->release(view(), ShardUse::kGrads);
    return created;
  });
}

void UnitState::pre_backward() {
  check_usable();
  root->on_backward_started();
  if (backward_reads_params) wait_for_unshard();
  root->prefetch_before_in_backward(this);
  trace::record(trace::Event::kBackwardBegin, *this);
}

void UnitState::post_backward() {
  trace::record(trace::Event::kBackwardEnd, *this);
  reduce_grads();
  if (!is_root) reshard();
  post_backward_done = true;
}

RootContext::RootContext(UnitState* root) : root_(root) {}

void RootContext::fail(const UnitState& unit, const std::string& op, const std::string& cause) {
  if (failure.empty())
    failure = fmt::format("the {} of unit '{}' failed ({})", op, unit.path, cause);
  reduces_.clear();
  created_grads_.clear();
}

void RootContext::begin_forward() {
  root_->check_usable();
  // A forward inside the backward (recomputation) belongs to that backward.
  if (backward_callback_queued && torch::autograd::get_current_graph_task_id() != backward_task) {
    abandon_stale_backward();
  }
  forward_order.clear();
}

void RootContext::prefetch_after_in_forward(UnitState* unit) {
  auto it = std::find(units.begin(), units.end(), unit);
  for (int k = 0; k < root_->options.prefetch && it != units.end(); ++k) {
    if (++it == units.end()) break;
    (*it)->unshard();
  }
}

void RootContext::prefetch_before_in_backward(UnitState* unit) {
  auto it = std::find(forward_order.rbegin(), forward_order.rend(), unit);
  for (int k = 0; k < root_->options.prefetch && it != forward_order.rend();) {
    if (++it == forward_order.rend()) break;
    // A unit whose outputs needed no grad (frozen embeddings under LoRA) has no backward, and
    // one whose backward reads no params (a trainable embedding) needs no gather for it.
    if (!(*it)->backward_expected || !(*it)->backward_reads_params) continue;
    (*it)->unshard();
    ++k;
  }
}

void RootContext::on_backward_started() {
  const int task = torch::autograd::get_current_graph_task_id();
  if (backward_callback_queued) {
    if (task == backward_task) return;
    abandon_stale_backward();
  }
  backward_callback_queued = true;
  backward_task = task;
  for (auto* unit : units) unit->post_backward_done = false;
  // Runs once the whole backward is done: units whose inputs carried no grad (the root, say)
  // reduce here, and everything is resharded.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
}

void RootContext::abandon_stale_backward() {
  backward_callback_queued = false;
  while (!reduces_.empty()) {
    auto oldest = std::move(reduces_.front());
    reduces_.pop_front();
    try {
      oldest.pending.wait();
    } catch (...) {
      fail(*oldest.unit, "reduce-scatter", current_exception_message());
      throw;
    }
  }
  drop_unused_grads();
  for (auto* unit : units) {
    unit->reshard();
    unit->post_backward_done = false;
  }
}

void RootContext::enqueue_reduce(UnitState* unit, dist::Pending pending,
                                 std::function<CreatedGrads()> apply) {
  reduces_.push_back({unit, std::move(pending), std::move(apply)});
  while (reduces_.size() > 1) apply_oldest_reduce();
}

void RootContext::apply_oldest_reduce() {
  auto oldest = std::move(reduces_.front());
  reduces_.pop_front();
  try {
    oldest.pending.wait();
    created_grads_.push_back(oldest.apply());
  } catch (...) {
    // The unit's grads of this backward are lost (part of them may have been added).
    fail(*oldest.unit, "reduce-scatter", current_exception_message());
    throw;
  }
}

void RootContext::drain_reduces() {
  while (!reduces_.empty()) apply_oldest_reduce();
}

void RootContext::finalize_backward() {
  backward_callback_queued = false;
  for (auto* unit : units) {
    if (!unit->post_backward_done) unit->reduce_grads();
  }
  drain_reduces();
  drop_unused_grads();
  for (auto* unit : units) {
    unit->reshard();
    unit->post_backward_done = false;
  }
}

void RootContext::drop_unused_grads() {
  // One host read of every "had a grad" flag this backward created a grad shard for: a param no
  // rank used keeps no grad, as in unsharded training.
  std::vector<torch::Tensor> flags;
  for (const auto& c : created_grads_) {
    if (!c.created.empty()) flags.push_back(c.flags);
  }
  if (!flags.empty()) {
    torch::Tensor on_host = torch::cat(flags).cpu();
    const float* had = on_host.data_ptr<float>();
    int64_t base = 0;
    for (const auto& c : created_grads_) {
      if (c.created.empty()) continue;
      for (const auto& [slot, k] : c.created) {
        if (had[base + k] == 0.0f) slot->shard().mutable_grad() = torch::Tensor();
      }
      base += c.flags.numel();
    }
  }
  created_grads_.clear();
}

}  // namespace shardrl::fsdp
