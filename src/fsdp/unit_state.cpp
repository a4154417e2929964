#include "fsdp/unit_state.h"

#include <torch/csrc/autograd/engine.h>

#include "compat.h"

namespace shardrl::fsdp {
UnitState::UnitState(std::shared_ptr<torch::nn::Module> module_in, const dist::DeviceMesh& mesh_in,
                     const Options& options_in)
    : module(std::move(module_in)), mesh(mesh_in), options(options_in) {}

void UnitState::start_gather() {
  if (stage != Stage::kSharded || params.empty()) return;
  for (const auto& slot : params) {
    // Every rank has the same flags, so every rank stops here before the collective.
    TORCH_CHECK(!slot.awaiting_load, "FSDP: parameter '", slot.name, "' of unit ", module->name(),
                " was created under fsdp::EmptyInit and has no values yet: load the model "
                "(checkpoint::load_hf_from_rank0, load_hf or checkpoint::load) before using it");
  }
  const auto dtype = options.mixed_precision.param_dtype;
  const int world = mesh.shard_size();
  torch::NoGradGuard no_grad;
  torch::Tensor shard = residency ? residency->gather_input(*this) : flat_shard;
  torch::Tensor input = dtype == torch::kFloat ? shard : shard.to(dtype);
  gather_output_ = torch::empty({world * flat_shard.numel()}, input.options());
  gather_pending_ = mesh.shard_group().all_gather_async(input, gather_output_);
  stage = Stage::kGathering;
}

void UnitState::finish_gather() {
  if (params.empty()) {
    stage = Stage::kUnsharded;
    return;
  }
  if (stage == Stage::kUnsharded) return;
  if (stage == Stage::kSharded) start_gather();
  gather_pending_.wait();
  const int world = mesh.shard_size();
  torch::NoGradGuard no_grad;
  torch::Tensor rows_by_rank = gather_output_.view({world, flat_shard.numel()});
  for (auto& slot : params) {
    compat::alloc_storage(slot.unsharded);
    // variable_data() does not share the version counter: refilling the storage must not look
    // like an in-place edit to the views autograd saved in forward.
    torch::Tensor dst = slot.unsharded.variable_data().view({slot.rows, slot.row_numel});
    for (int r = 0; r < world; ++r) {
      const int64_t valid = slot.valid_rows_on(r);
      if (valid == 0) continue;
      dst.narrow(0, r * slot.chunk_rows, valid)
          .copy_(rows_by_rank[r]
                     .narrow(0, slot.offset, valid * slot.row_numel)
                     .view({valid, slot.row_numel}));
    }
  }
  gather_output_ = torch::Tensor();
  stage = Stage::kUnsharded;
}

void UnitState::reshard() {
  if (stage == Stage::kGathering) finish_gather();  // the collective must complete on every rank
  if (held_unsharded) return;
  for (auto& slot : params) compat::free_storage(slot.unsharded);
  stage = Stage::kSharded;
}

void UnitState::reduce_grads() {
  std::vector<ParamSlot*> trainable;
  for (auto& slot : params) {
    if (slot.unsharded.requires_grad()) trainable.push_back(&slot);
  }
  if (trainable.empty() || !root->requires_gradient_sync) return;

  const int world = mesh.shard_size();
  // Layout per destination rank: every trainable param's shard, then one "had a grad" flag per
  // param. The flags ride in the same collective, so a param no rank used keeps no grad (as in
  // unsharded training) without a second round trip.
  std::vector<int64_t> offsets;
  int64_t width = 0;
  for (auto* slot : trainable) {
    offsets.push_back(width);
    width += slot->shard_numel();
  }
  const int64_t flags_at = width;
  width += static_cast<int64_t>(trainable.size());

  torch::NoGradGuard no_grad;
  const auto reduce_dtype = options.mixed_precision.reduce_dtype;
  auto device = flat_shard.device();
  torch::Tensor send = torch::zeros({world, width}, torch::dtype(reduce_dtype).device(device));
  for (size_t k = 0; k < trainable.size(); ++k) {
    ParamSlot& slot = *trainable[k];
    torch::Tensor grad = slot.unsharded.grad();
    if (!grad.defined()) continue;
    torch::Tensor grad_rows = grad.reshape({slot.rows, slot.row_numel});
    for (int r = 0; r < world; ++r) {
      const int64_t valid = slot.valid_rows_on(r);
      if (valid == 0) continue;
      send[r]
          .narrow(0, offsets[k], valid * slot.row_numel)
          .view({valid, slot.row_numel})
          .copy_(grad_rows.narrow(0, r * slot.chunk_rows, valid));
    }
    send.select(1, flags_at + static_cast<int64_t>(k)).fill_(1);
    slot.unsharded.mutable_grad() = torch::Tensor();
  }
  torch::Tensor received = torch::empty({width}, send.options());
  auto pending = mesh.shard_group().reduce_scatter_async(send.view(-1), received);
  const int dp_size = mesh.data_parallel_size();
  dist::ProcessGroup* replicate = mesh.replicate_group();
  root->enqueue_reduce(
      std::move(pending), [this, trainable, offsets, flags_at, received, dp_size, replicate] {
        torch::NoGradGuard guard;
        torch::Tensor summed = received.to(torch::kFloat);
        if (replicate) replicate->all_reduce(summed);
        summed.div_(dp_size);
        // One host copy of the flags instead of a device sync per parameter.
        torch::Tensor had_grad =
            summed.narrow(0, flags_at, static_cast<int64_t>(trainable.size())).cpu();
        // Offloaded grad shards come in to take the sum and go back after it.
        if (residency) residency->acquire(*this, ShardUse::kGrads);
        for (size_t k = 0; k < trainable.size(); ++k) {
          if (had_grad[static_cast<int64_t>(k)].item<float>() == 0.0f) continue;
          ParamSlot& slot = *trainable[k];
          torch::Tensor grad =
              summed.narrow(0, offsets[k], slot.shard_numel()).view(slot.shard.sizes());
          if (slot.shard.grad().defined()) {
            slot.shard.mutable_grad().add_(grad);
          } else {
            slot.shard.mutable_grad() = grad.clone();
          }
        }
        if (residency) residency->release(*this, ShardUse::kGrads);
      });
}

void UnitState::pre_backward() {
  root->on_backward_started();
  finish_gather();
  root->prefetch_before_in_backward(this);
}

void UnitState::post_backward() {
  reduce_grads();
  if (!is_root) reshard();
  post_backward_done = true;
}

RootContext::RootContext(UnitState* root) : root_(root) {}

void RootContext::begin_forward() {
  forward_order.clear();
}

void RootContext::prefetch_after_in_forward(UnitState* unit) {
  auto it = std::find(units.begin(), units.end(), unit);
  for (int k = 0; k < root_->options.prefetch && it != units.end(); ++k) {
    if (++it == units.end()) break;
    (*it)->start_gather();
  }
}

void RootContext::prefetch_before_in_backward(UnitState* unit) {
  auto it = std::find(forward_order.rbegin(), forward_order.rend(), unit);
  for (int k = 0; k < root_->options.prefetch && it != forward_order.rend(); ++k) {
    if (++it == forward_order.rend()) break;
    (*it)->start_gather();
  }
}

void RootContext::on_backward_started() {
  if (backward_callback_queued) return;
  backward_callback_queued = true;
  for (auto* unit : units) unit->post_backward_done = false;
  // Runs once the whole backward is done: units whose inputs carried no grad (the root, say)
  // reduce here, and everything is resharded.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
}

void RootContext::enqueue_reduce(dist::Pending pending, std::function<void()> apply) {
  reduces_.push_back({std::move(pending), std::move(apply)});
  while (reduces_.size() > 1) {
    auto oldest = std::move(reduces_.front());
    reduces_.pop_front();
    oldest.pending.wait();
    oldest.apply();
  }
}

void RootContext::drain_reduces() {
  while (!reduces_.empty()) {
    auto oldest = std::move(reduces_.front());
    reduces_.pop_front();
    oldest.pending.wait();
    oldest.apply();
  }
}

void RootContext::finish_backward() {
  backward_callback_queued = false;
  for (auto* unit : units) {
    if (!unit->post_backward_done) unit->reduce_grads();
  }
  drain_reduces();
  for (auto* unit : units) {
    unit->reshard();
    unit->post_backward_done = false;
  }
}

}  // namespace shardrl::fsdp
