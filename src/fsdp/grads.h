// Operations on the grads of a set of shards, shared by FSDPModule::clip_grad_norm_ and the
// optimizer step that clips as it steps (optim::clip_and_step).
#pragma once

#include <vector>

#include "shardrl/fsdp.h"

namespace shardrl::fsdp {

// The squares, in fp64, of the 2-norms of every defined grad of `shards`, in shard order; each
// norm is taken in its grad's dtype, as clip_grad_norm_ takes it, by one _foreach_norm per dtype
// (one multi-tensor kernel on a GPU rather than a reduction per param).
torch::Tensor squared_grad_norms(const std::vector<ShardedParameter>& shards);

// Multiplies every defined grad of `shards` by `coef` in place: one multi-tensor kernel on a GPU
// (clip_grad_norm_'s _foreach_mul_), the same per-tensor multiplications on the CPU.
void scale_grads(const std::vector<ShardedParameter>& shards, double coef);

}  // namespace shardrl::fsdp
