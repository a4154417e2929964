#include "fsdp/collectives.h"

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

void all_gather_copy_out(std::vector<ParamSlot>& params, const torch::Tensor& output,
                         int group_size) {
  torch::NoGradGuard no_grad;
  const torch::Tensor by_rank = output.view({group_size, -1});
  for (auto& slot : params) slot.copy_out(by_rank);
}

ReduceScatterPack reduce_scatter_copy_in(const std::vector<ParamSlot*>& trainable, int group_size,
                                         torch::ScalarType reduce_dtype, double scale) {
  ReduceScatterPack pack;
  pack.params = trainable;
  int64_t width = 0;
  for (const ParamSlot* slot : trainable) {
    pack.columns.push_back(width);
    width += slot->shard_numel();
  }
  pack.flags_at = width;
  width += static_cast<int64_t>(trainable.size());

  torch::NoGradGuard no_grad;
  const auto device = trainable.front()->shard().device();
  // Every element is written below: no zero-fill of the whole buffer first.
  pack.input = torch::empty({group_size, width}, torch::dtype(reduce_dtype).device(device));
  for (size_t k = 0; k < trainable.size(); ++k) {
    const bool had_grad =
        trainable[k]->copy_in_grad(trainable[k]->take_grad(), pack.input, pack.columns[k], scale);
    pack.input.select(1, pack.flags_at + static_cast<int64_t>(k)).fill_(had_grad ? 1 : 0);
  }
  pack.output = torch::empty({width}, pack.input.options());
  return pack;
}

CreatedGrads reduce_scatter_copy_out(const ReduceScatterPack& pack, const torch::Tensor& summed) {
  torch::NoGradGuard no_grad;
  CreatedGrads out;
  out.flags = summed.narrow(0, pack.flags_at, static_cast<int64_t>(pack.params.size())).clone();
  for (size_t k = 0; k < pack.params.size(); ++k) {
    const ParamSlot& slot = *pack.params[k];
    torch::Tensor grad =
        summed.narrow(0, pack.columns[k], slot.shard_numel()).view(slot.shard().sizes());
    // A param no rank used adds zeros (exact) to an existing grad shard.
    if (slot.shard().grad().defined()) {
      slot.shard().mutable_grad().add_(grad);
    } else {
      slot.shard().mutable_grad() = grad.clone();
      out.created.emplace_back(pack.params[k], static_cast<int64_t>(k));
    }
  }
  return out;
}

}  // namespace shardrl::fsdp
