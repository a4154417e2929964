#include "fsdp/collectives.h"

#include <algorithm>

#include "comm/shm_transport.h"

namespace shardrl::fsdp {

torch::Tensor all_gather_input(const torch::Tensor& flat_shard, torch::ScalarType param_dtype) {
  return flat_shard.scalar_type() == param_dtype ? flat_shard : flat_shard.to(param_dtype);
}

dist::Pending all_gather_into_params(dist::ProcessGroup& group, const torch::Tensor& input,
                                     std::vector<ParamSlot>& params) {
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> shard_numels;
  for (auto& slot : params) {
    parts.push_back(slot.gather_destination());
    shard_numels.push_back(slot.shard_numel());
  }
  return group.all_gather_segments_async(input, std::move(parts), std::move(shard_numels));
}

dist::Pending all_gather_into_image(dist::ProcessGroup& group,
                                    const std::shared_ptr<dist::HostImage>& image,
                                    uint64_t generation, const torch::Tensor& input,
                                    std::vector<ParamSlot>& params,
                                    const std::vector<int64_t>& offsets) {
  std::vector<int64_t> shard_numels;
  for (const auto& slot : params) shard_numels.push_back(slot.shard_numel());
  return group.all_gather_in_image_async(*image, generation, input,
                                         point_params_at_image(params, image, offsets),
                                         std::move(shard_numels));
}

std::vector<torch::Tensor> point_params_at_image(std::vector<ParamSlot>& params,
                                                 const std::shared_ptr<dist::HostImage>& image,
                                                 const std::vector<int64_t>& offsets) {
  std::vector<torch::Tensor> parts;
  for (size_t k = 0; k < params.size(); ++k)
    parts.push_back(params[k].gather_destination_at(image->data() + offsets[k], image));
  return parts;
}

void all_gather_copy_out(std::vector<ParamSlot>& params, const torch::Tensor& output,
                         int group_size) {
  torch::NoGradGuard no_grad;
  const torch::Tensor by_rank = output.view({group_size, -1});
  for (auto& slot : params) slot.copy_out(by_rank);
}

torch::Tensor GradReduceScatter::reduced(size_t k) const {
  if (!flat.defined()) return own[k];
  return flat.narrow(0, columns[k], params[k]->shard_numel()).view(params[k]->shard().sizes());
}

torch::Tensor GradReduceScatter::flags() const {
  if (!flat.defined()) return own.back();
  return flat.narrow(0, flags_at, static_cast<int64_t>(params.size()));
}

namespace {

// The pack: for each destination rank, the shard columns of every param, then the flags.
void pack_grads(GradReduceScatter& r, int group_size, double scale) {
  const auto device = r.params.front()->shard().device();
  // Every element is written below: no zero-fill of the whole buffer first.
  torch::Tensor input =
      torch::empty({group_size, r.flags_at + static_cast<int64_t>(r.params.size())},
                   torch::dtype(r.wire).device(device));
  for (size_t k = 0; k < r.params.size(); ++k) {
    const bool had_grad =
        r.params[k]->copy_in_grad(r.params[k]->take_grad(), input, r.columns[k], scale);
    input.select(1, r.flags_at + static_cast<int64_t>(k)).fill_(had_grad ? 1 : 0);
  }
  r.sent = {input};
}

}  // namespace

torch::ScalarType grad_wire_dtype(const dist::ProcessGroup& group,
                                  const std::vector<ParamSlot*>& trainable,
                                  torch::ScalarType reduce_dtype, bool kept_sums) {
  if (kept_sums || !group.sums_low_precision_in_fp32() || trainable.empty()) return reduce_dtype;
  const auto computes_in = trainable.front()->unsharded().scalar_type();
  const bool narrower = c10::isReducedFloatingType(computes_in) && reduce_dtype == torch::kFloat;
  const bool shared = std::all_of(trainable.begin(), trainable.end(), [&](const ParamSlot* slot) {
    return slot->unsharded().scalar_type() == computes_in;
  });
  return narrower && shared ? computes_in : reduce_dtype;
}

GradReduceScatter reduce_scatter_grads(dist::ProcessGroup& group,
                                       const std::vector<ParamSlot*>& trainable,
                                       torch::ScalarType reduce_dtype, double scale,
                                       bool one_buffer, bool kept_sums) {
  torch::NoGradGuard no_grad;
  GradReduceScatter r;
  r.params = trainable;
  r.wire = grad_wire_dtype(group, trainable, reduce_dtype, kept_sums);
  int64_t width = 0;
  for (const ParamSlot* slot : trainable) {
    r.columns.push_back(width);
    width += slot->shard_numel();
  }
  r.flags_at = width;
  const auto count = static_cast<int64_t>(trainable.size());
  const auto device = trainable.front()->shard().device();
  const auto options = torch::dtype(reduce_dtype).device(device);
  if (group.size() == 1 && !one_buffer) {
    // Nothing to reduce (FSDP2 still copies in and out here): each grad, in reduce_dtype and
    // times `scale`, becomes its grad shard itself. Autograd hands it over exclusively, as it
    // hands unsharded training the .grad that the optimizer and clipping then edit in place.
    r.wire = reduce_dtype;
    std::vector<float> had;
    for (ParamSlot* slot : trainable) {
      torch::Tensor grad = slot->take_grad();
      had.push_back(grad.defined() ? 1 : 0);
      if (grad.defined()) {
        grad = grad.to(reduce_dtype).contiguous();
        if (scale != 1.0) grad.mul_(scale);
        // Only a scalar param's shard ([1]) is shaped otherwise; a view would refuse detach_().
        if (grad.sizes() != slot->shard().sizes())
          grad = grad.reshape(slot->shard().sizes()).clone();
      }
      r.own.push_back(grad);
    }
    r.own.push_back(torch::tensor(had).to(options));
    return r;  // no collective: r.pending is complete
  }
  // Params that compute in the wire's dtype have their grads in it: no_sync keeps a sum of its
  // own only in a wider reduce_dtype, which is then the wire. Deciding on the dtypes, not on
  // which grads this rank has, keeps every rank on the same path.
  const bool grads_in_wire_dtype =
      std::all_of(trainable.begin(), trainable.end(),
                  [&](const ParamSlot* slot) { return slot->unsharded().scalar_type() == r.wire; });
  if (!group.has_segment_collectives() || !grads_in_wire_dtype) {
    const bool prescale = r.wire == reduce_dtype;
    pack_grads(r, group.size(), prescale ? scale : 1.0);
    r.unapplied_scale = prescale ? 1.0 : scale;
    r.flat = torch::empty({width + count}, options);
    r.pending = group.reduce_scatter_async(r.sent.front().view(-1), r.flat);
    return r;
  }
  std::vector<int64_t> numels;
  std::vector<float> had;
  for (ParamSlot* slot : trainable) {
    torch::Tensor grad = slot->take_grad();
    had.push_back(grad.defined() ? 1 : 0);
    r.sent.push_back(grad.defined() ? grad.contiguous() : grad);
    numels.push_back(slot->shard_numel());
  }
  // Each destination rank gets this rank's flags.
  r.sent.push_back(
      torch::tensor(had).to(torch::dtype(r.wire).device(device)).repeat({group.size()}));
  numels.push_back(count);
  std::vector<torch::Tensor> outputs;
  if (one_buffer) {
    r.flat = torch::empty({width + count}, options);
    for (size_t k = 0; k < trainable.size(); ++k)
      outputs.push_back(r.flat.narrow(0, r.columns[k], numels[k]));
    outputs.push_back(r.flat.narrow(0, r.flags_at, count));
  } else {
    // Shaped as the shards: each becomes a grad shard as it is, not a view of one.
    for (const ParamSlot* slot : trainable)
      r.own.push_back(torch::empty(slot->shard().sizes(), options));
    r.own.push_back(torch::empty({count}, options));
    outputs = r.own;
  }
  r.pending =
      group.reduce_scatter_segments_async(r.sent, numels, r.wire, std::move(outputs), scale);
  return r;
}

CreatedGrads reduce_scatter_copy_out(const GradReduceScatter& reduction) {
  torch::NoGradGuard no_grad;
  CreatedGrads out;
  // In place on the sums, in reduce_dtype (the flags are only compared with zero).
  if (reduction.unapplied_scale != 1.0) reduction.flat.mul_(reduction.unapplied_scale);
  // fp32, and a copy where they are a part of `flat`.
  out.flags = reduction.flags().to(torch::kFloat, /*non_blocking=*/false,
                                   /*copy=*/reduction.flat.defined());
  for (size_t k = 0; k < reduction.params.size(); ++k) {
    const ParamSlot& slot = *reduction.params[k];
    const torch::Tensor reduced = reduction.reduced(k);
    if (!reduced.defined()) continue;  // world size 1, no grad: nothing to add or create
    // A param no rank used adds zeros (exact) to an existing grad shard.
    if (slot.shard().grad().defined()) {
      slot.shard().mutable_grad().add_(reduced);
      continue;
    }
    torch::Tensor grad = reduced.to(slot.shard().scalar_type());
    // A part of `flat` in the shard's dtype already is a view: the grad gets a copy.
    const bool exclusive = !reduction.flat.defined() || !grad.is_same(reduced);
    slot.shard().mutable_grad() = exclusive ? grad : grad.clone();
    out.created.emplace_back(reduction.params[k], static_cast<int64_t>(k));
  }
  return out;
}

}  // namespace shardrl::fsdp
