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

// The same where the host's ranks share one image of the unit's unsharded params: each param's
// storage is its place in `image` (at `offsets`, in bytes), each rank writes only its own rows
// and reads its peers' where they are. `generation`: this unit's gathers into the image so far,
// this one included.
// Points each param's storage at its place in `image` (at `offsets`, in bytes) and returns those
// places as flat tensors: the gather's parts, or, for a backward that reads the rows its forward
// gathered, just the params made whole again.
std::vector<torch::Tensor> point_params_at_image(std::vector<ParamSlot>& params,
                                                 const std::shared_ptr<dist::HostImage>& image,
                                                 const std::vector<int64_t>& offsets);
dist::Pending all_gather_into_image(dist::ProcessGroup& group,
                                    const std::shared_ptr<dist::HostImage>& image,
                                    uint64_t generation, const torch::Tensor& input,
                                    std::vector<ParamSlot>& params,
                                    const std::vector<int64_t>& offsets);

// All-gather copy-out: `output` holds every rank's flat shard, rank-major; each param gets its
// rows back.
void all_gather_copy_out(std::vector<ParamSlot>& params, const torch::Tensor& output,
                         int group_size);

// One unit's reduce-scatter of grads in flight. Each rank gets, for the rows it holds of every
// trainable param, `scale` (1 / data-parallel size) times the sum over ranks: the mean. One "had a
// grad" flag per param rides in the same collective, so a param no rank used keeps no grad (as in
// unsharded training) without a second round trip.
struct GradReduceScatter {
  std::vector<ParamSlot*> params;
  dist::Pending pending;
  torch::ScalarType wire = torch::kFloat;  // the dtype the grads travel in (see grad_wire_dtype)
  // The factor the sums still need: a low-precision pack is not pre-scaled, which would round
  // each grad before the fp32 sum.
  double unapplied_scale = 1.0;
  // What the transport reads until the collective completes: the packed [group size, width]
  // input, or the unsharded grads themselves.
  std::vector<torch::Tensor> sent;
  // Where the sums land, in reduce_dtype: `flat` ([width]: each param's shard at its column, then
  // the flags), or, when undefined, a tensor of each param's own in `own` (then the flags; at a
  // shard group of one, a param without a grad has an undefined tensor there).
  torch::Tensor flat;
  std::vector<int64_t> columns;
  int64_t flags_at = 0;
  std::vector<torch::Tensor> own;

  torch::Tensor reduced(size_t k) const;  // param k's sums, shaped as its shard
  torch::Tensor flags() const;            // [params.size()]: > 0 where any rank had a grad
};

// The dtype a unit's grads travel in. Grads of params that compute in a narrower float than
// reduce_dtype (bf16 params, fp32 reduce) travel as they are where the transport sums them in
// fp32 (group.sums_low_precision_in_fp32()): the same sums at half the bytes of FSDP2's fp32
// wire. They travel in reduce_dtype where the transport sums in the wire's dtype (NCCL), and when
// no_sync kept sums in reduce_dtype since the unit's last reduce-scatter (`kept_sums`): those
// must not be rounded. Decided on dtypes and on the no_sync history, never on which grads this
// rank has, so every rank picks the same wire.
torch::ScalarType grad_wire_dtype(const dist::ProcessGroup& group,
                                  const std::vector<ParamSlot*>& trainable,
                                  torch::ScalarType reduce_dtype, bool kept_sums);

// Starts the reduce-scatter of the unsharded grads of `trainable` (with what no_sync kept), which
// are dropped from the params (they live on in `sent`). The sums are in reduce_dtype; the wire
// is grad_wire_dtype(group, trainable, reduce_dtype, kept_sums).
// - Where the transport takes segments (shared memory) and the grads are in the wire's dtype
//   already, it reads each grad where it is and sums each param into a tensor of its own, which
//   becomes the grad shard: no pack and no copy-out (FSDP2 packs, as ShardRL does below).
// - Otherwise the grads are packed into one [group size, width] buffer in the wire's dtype, times
//   `scale` where that is reduce_dtype.
// - At a shard group of one, and unless `one_buffer`, there is no collective: each grad (in
//   reduce_dtype, times `scale`) becomes its grad shard as it is, undefined where there was none.
// `one_buffer`: the sums must land in `flat` (an HSDP replicate all-reduce follows).
GradReduceScatter reduce_scatter_grads(dist::ProcessGroup& group,
                                       const std::vector<ParamSlot*>& trainable,
                                       torch::ScalarType reduce_dtype, double scale,
                                       bool one_buffer, bool kept_sums);

// Reduce-scatter copy-out, once the collective (and any all-reduce of `flat`) is done: adds this
// rank's reduced grads into the grad shards (in fp32); a grad shard that did not exist becomes the
// sum itself where that is a tensor of its own, else a copy (optimizers may detach_ a grad in
// place, which a view forbids). Returns the "had a grad" flags, still on the device, with the
// params whose grad shard this call created: a created grad whose flag reads zero is dropped once
// per backward, so the host never waits on the device per unit.
struct CreatedGrads {
  torch::Tensor flags;  // [params.size()] fp32 on the device: > 0 if any rank had a grad
  std::vector<std::pair<ParamSlot*, int64_t>> created;  // (param, index into flags)
};
CreatedGrads reduce_scatter_copy_out(const GradReduceScatter& reduction);

}  // namespace shardrl::fsdp
