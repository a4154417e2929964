// Activation checkpointing for the C++ frontend (which has no torch.utils.checkpoint): a block's
// forward runs without keeping its activations, and its backward runs the forward again first.
//
// Inside an FSDP unit this composes with the schedule: the unit's params are gathered again
// before its backward (that is when the recompute runs), and the recomputed graph's param grads
// accumulate into the unsharded grads the unit then reduce-scatters. Random ops inside `fn`
// (dropout) would draw different numbers in the recompute: keep them out of checkpointed blocks.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace shardrl::models {

using CheckpointedFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// fn(inputs), with fn's activations freed after forward and recomputed in backward. Under no
// grad, or when no input requires grad (then params inside would get no grads), it is plain
// fn(inputs).
torch::Tensor checkpointed(CheckpointedFn fn, const std::vector<torch::Tensor>& inputs);

}  // namespace shardrl::models
