// DeepSpeed-Ulysses sequence parallelism, as verl's verl/utils/ulysses.py does it.
//
// The sp ranks of a sequence-parallel group (dist::DeviceMesh::sequence_parallel_group) feed the
// same samples and each keeps a contiguous slice of every sequence, padded to a multiple of sp.
// Everything that acts on one token at a time (embeddings, norms, MLPs, projections) runs on the
// slice. Around attention, an all-to-all swaps the sequence split for a head split, so that each
// rank attends over the whole sequence with 1/sp of the heads; the inverse all-to-all swaps back.
// Each all-to-all's backward is the transposed all-to-all. At the end, per-token outputs are
// all-gathered and the padding dropped; the gather's backward hands each rank the gradient of its
// own slice. Summed over the group, the ranks' gradients are the gradient of the whole sequence:
// FSDP averages over data-parallel ranks only (DeviceMesh::data_parallel_size).
//
// Every rank of the group must run the same collectives in the same order, forward and backward:
// an output that does not depend on a rank's slice would leave that rank's backward idle while
// its peers wait on it in an all-to-all.
#pragma once

#include <torch/torch.h>

#include "shardrl/dist.h"

namespace shardrl::ulysses {

// Where one rank's slice of a sequence of `length` positions lies once padded for the group.
struct SequenceSlice {
  int64_t length = 0;         // real positions
  int64_t padded_length = 0;  // the next multiple of the group size
  int64_t begin = 0;          // the first (padded) position this rank holds
  int64_t local_length = 0;   // padded_length / group size
};
SequenceSlice sequence_slice(int64_t length, const dist::ProcessGroup& group);

// `x` padded with `value` along `dim` to the padded length, then this rank's slice of it
// (verl's ulysses_pad_and_slice_inputs). Differentiable.
torch::Tensor pad_and_slice(const torch::Tensor& x, int64_t dim, const dist::ProcessGroup& group,
                            double value = 0);

// All-to-all over the group: `x` is split into size() chunks along scatter_dim, chunk j goes to
// rank j, and the chunks received are concatenated along gather_dim in rank order. Its backward
// is the same exchange with the two dims swapped.
torch::Tensor all_to_all(const torch::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                         dist::ProcessGroup& group);

// [.., S / sp at seq_dim, .., H at head_dim, ..] -> [.., S, .., H / sp, ..]: before attention.
inline torch::Tensor gather_seq_scatter_heads(const torch::Tensor& x, int64_t seq_dim,
                                              int64_t head_dim, dist::ProcessGroup& group) {
  return all_to_all(x, head_dim, seq_dim, group);
}
// The inverse: [.., S, .., H / sp, ..] -> [.., S / sp, .., H, ..], after attention.
inline torch::Tensor gather_heads_scatter_seq(const torch::Tensor& x, int64_t head_dim,
                                              int64_t seq_dim, dist::ProcessGroup& group) {
  return all_to_all(x, seq_dim, head_dim, group);
}

// Every rank's slice of `x` concatenated along `dim`, then cut to the first `length` positions
// (verl's gather_outputs_and_unpad). Its backward passes on this rank's slice of the gradient.
torch::Tensor gather_outputs_and_unpad(const torch::Tensor& x, int64_t dim, int64_t length,
                                       dist::ProcessGroup& group);

// Checks that a model with `heads` query heads and `kv_heads` key/value heads can split its heads
// over `sp` ranks: sp must divide heads, and divide kv_heads or be a multiple of it (key/value
// heads are then repeated until each rank has one, as verl's repeat_kv). Errors name
// ulysses_sequence_parallel_size.
void check_heads(int64_t heads, int64_t kv_heads, int sp);

}  // namespace shardrl::ulysses
