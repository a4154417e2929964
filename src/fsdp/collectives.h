// How a unit's parameters and gradients are packed into one collective and unpacked from it
// (FSDP2's _fsdp_collectives): one flat all-gather per unit, one reduce-scatter per unit.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "fsdp/param_slot.h"
#include "shardrl/dist.h"

namespace shardrl::fsdp {

// All-gather copy-in: this rank's flat fp32 shard as the collective's input, in the compute
// dtype (bf16 on the wire when params compute in bf16).
torch::Tensor all_gather_input(const torch::Tensor& flat_shard, torch::ScalarType param_dtype);

// The all-gather that fills the params' own storage, where the transport can (shared memory):
// one segment per param, no gather buffer, no copy-out.
dist::Pending all_gather_into_params(dist::ProcessGroup& group, const torch::Tensor& input,
                                     std::vector<ParamSlot>& params);

// All-gather copy-out: `output` holds every rank's flat shard, rank-major; each param gets its
// rows back.
void all_gather_copy_out(std::vector<ParamSlot>& params, const torch::Tensor& output,
                         int group_size);

// The reduce-scatter input of a unit: for each destination rank, the shard columns of every
// trainable param, then one "had a grad" flag per param. The flags ride in the same collective,
// so a param no rank used keeps no grad (as in unsharded training) without a second round trip.
struct ReduceScatterPack {
  std::vector<ParamSlot*> params;
  std::vector<int64_t> columns;  // where each param's shard starts in a rank's row
  int64_t flags_at = 0;
  torch::Tensor input;   // [group size, width] in reduce_dtype, contiguous
  torch::Tensor output;  // [width] in reduce_dtype: this rank's sum after the collective
};

// Packs the unsharded grads of `trainable` (with what no_sync kept), times `scale` (1 /
// data-parallel size: the sum that comes back is the mean), and drops them (they live on in the
// pack).
ReduceScatterPack reduce_scatter_copy_in(const std::vector<ParamSlot*>& trainable, int group_size,
                                         torch::ScalarType reduce_dtype, double scale);

// Reduce-scatter copy-out: adds this rank's reduced grads (fp32, [width]) into the grad shards;
// a grad shard that did not exist is created (a copy: optimizers may detach_ a grad in place,
// which a view forbids). Returns the "had a grad" flags, still on the
// device, with the params whose grad shard this call created: a created grad whose flag reads
// zero is dropped once per backward, so the host never waits on the device per unit.
struct CreatedGrads {
  torch::Tensor flags;  // [params.size()] fp32 on the device: > 0 if any rank had a grad
  std::vector<std::pair<ParamSlot*, int64_t>> created;  // (param, index into flags)
};
CreatedGrads reduce_scatter_copy_out(const ReduceScatterPack& pack, const torch::Tensor& summed);

}  // namespace shardrl::fsdp
