// One sharded parameter: its shard layout and its copy-in/copy-out (FSDP2's FSDPParam). The only
// place that knows how dim-0 rows are padded and split over the shard group.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace shardrl::fsdp {

class ParamSlot {
 public:
  // `param` is the module's parameter; its rows are split over `shard_group_size` ranks.
  ParamSlot(std::string name, torch::Tensor param, int shard_group_size);

  // Layout.
  const std::string& name() const { return name_; }  // relative to the unit's module
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t rows() const { return rows_; }              // dim 0 (1 for scalars)
  int64_t chunk_rows() const { return chunk_rows_; }  // rows per rank, padded: ceil(rows / N)
  int64_t shard_numel() const { return chunk_rows_ * row_numel_; }
  int64_t valid_rows_on(int rank) const;  // rows of rank's shard that are real, not padding
  int64_t row_offset_on(int rank) const;  // first global row rank holds

  // Places the shard at `offset` of the unit's flat fp32 shard buffer, filled from the unsharded
  // param's rows (unless it awaits a loader), and frees the unsharded storage: from here on it
  // is refilled by all-gathers only.
  void shard_into(const torch::Tensor& flat_shard, int64_t offset, int rank,
                  torch::ScalarType param_dtype);

  // The unit's all-gather output viewed [group size, flat shard numel] -> the unsharded param
  // (its storage is reallocated; autograd's saved views of it come back to life).
  void copy_out(const torch::Tensor& gathered_by_rank);
  // The unsharded param's storage, reallocated, as a flat tensor for an all-gather to fill in
  // place: rank r's shard belongs at r * shard_numel(), cut at numel() (the rest is padding rows).
  torch::Tensor gather_destination();
  // gather_destination() in memory the caller provides (a host-shared image of the unsharded
  // params), which `owner` keeps mapped while the storage points there.
  torch::Tensor gather_destination_at(char* where, std::shared_ptr<void> owner);
  int64_t unsharded_bytes() const;  // in the compute dtype
  // Under no_sync: moves the param's .grad into the sum kept across micro-batches, in
  // reduce_dtype when that is wider than the grad's dtype (FSDP2 accumulates in reduce_dtype:
  // bf16 sums of many micro-batches lose the low bits fp32 keeps). Otherwise the grad stays,
  // and autograd accumulates into it.
  void keep_grad_for_sync(torch::ScalarType reduce_dtype);
  // The unsharded grad to reduce (the kept sum plus this backward's .grad); both are dropped.
  // Undefined when the param got no grad.
  torch::Tensor take_grad();
  // Drops the param's .grad and the kept sum.
  void clear_unsharded_grads();
  // Bytes of unsharded grads held (the .grad and the kept sum).
  int64_t unsharded_grad_bytes() const;
  // `grad` (from take_grad()), times `scale`, -> this param's columns of the reduce-scatter
  // input [group size, width] at `column`, padding rows zeroed; undefined `grad`: zeros.
  // Returns whether there was a grad.
  bool copy_in_grad(const torch::Tensor& grad, const torch::Tensor& send_by_rank, int64_t column,
                    double scale) const;
  // An all-gather output of this param's shards alone ([group size * shard_numel]) -> the full
  // param.
  torch::Tensor full_from_gathered(const torch::Tensor& gathered) const;

  int64_t offset() const { return offset_; }  // in the unit's flat shard buffer
  const torch::Tensor& unsharded() const { return unsharded_; }
  const torch::Tensor& shard() const { return shard_; }  // fp32 leaf, [chunk_rows, ...]; .grad()
  bool awaiting_load = false;  // created under EmptyInit; its shard holds no values yet

 private:
  std::string name_;
  torch::Tensor unsharded_;  // the module's parameter; storage freed while sharded
  torch::Tensor kept_grad_;  // no_sync's sum in reduce_dtype (see keep_grad_for_sync)
  std::vector<int64_t> shape_;
  int64_t rows_ = 1, row_numel_ = 1, chunk_rows_ = 1;
  int group_size_ = 1;
  int64_t offset_ = 0;
  torch::Tensor shard_;
};

}  // namespace shardrl::fsdp
