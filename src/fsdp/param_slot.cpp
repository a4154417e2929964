#include "fsdp/param_slot.h"

#include "compat.h"
#include "shardrl/fsdp.h"

namespace shardrl::fsdp {

ParamSlot::ParamSlot(std::string name, torch::Tensor param, int shard_group_size)
    : name_(std::move(name)),
      unsharded_(std::move(param)),
      shape_(unsharded_.sizes().vec()),
      rows_(unsharded_.dim() == 0 ? 1 : unsharded_.size(0)),
      group_size_(shard_group_size) {
  row_numel_ = rows_ == 0 ? 0 : unsharded_.numel() / rows_;
  chunk_rows_ = (rows_ + group_size_ - 1) / group_size_;
  awaiting_load = has_no_values(unsharded_);
}

int64_t ParamSlot::valid_rows_on(int rank) const {
  return std::max<int64_t>(0, std::min(chunk_rows_, rows_ - rank * chunk_rows_));
}

int64_t ParamSlot::row_offset_on(int rank) const {
  return std::min(rows_, rank * chunk_rows_);
}

void ParamSlot::shard_into(const torch::Tensor& flat_shard, int64_t offset, int rank,
                           torch::ScalarType param_dtype) {
  torch::NoGradGuard no_grad;
  offset_ = offset;
  std::vector<int64_t> shard_shape = shape_.empty() ? std::vector<int64_t>{1} : shape_;
  shard_shape[0] = chunk_rows_;
  torch::Tensor view = flat_shard.narrow(0, offset_, shard_numel()).view(shard_shape);
  const int64_t valid = valid_rows_on(rank);
  if (valid > 0 && !awaiting_load) {
    view.view({chunk_rows_, row_numel_})
        .narrow(0, 0, valid)
        .copy_(
            unsharded_.detach().reshape({rows_, row_numel_}).narrow(0, row_offset_on(rank), valid));
  }
  shard_ = view.detach().set_requires_grad(unsharded_.requires_grad());
  // A fresh, exclusive storage in the compute dtype on the shard's device; freed right away,
  // refilled by all-gathers.
  unsharded_.set_data(torch::empty(shape_, torch::dtype(param_dtype).device(flat_shard.device())));
  compat::free_storage(unsharded_);
}

torch::Tensor ParamSlot::gather_destination() {
  compat::alloc_storage(unsharded_);
  // variable_data() does not share the version counter: refilling the storage must not look
  // like an in-place edit to the views autograd saved in forward.
  return unsharded_.variable_data().view(-1);
}

torch::Tensor ParamSlot::gather_destination_at(char* where, std::shared_ptr<void> owner) {
  auto* keep = new std::shared_ptr<void>(std::move(owner));
  compat::set_storage(
      unsharded_,
      at::DataPtr(
          where, keep, [](void* ctx) { delete static_cast<std::shared_ptr<void>*>(ctx); },
          unsharded_.device()),
      static_cast<size_t>(unsharded_bytes()));
  return unsharded_.variable_data().view(-1);
}

int64_t ParamSlot::unsharded_bytes() const {
  return unsharded_.numel() * static_cast<int64_t>(unsharded_.element_size());
}

void ParamSlot::copy_out(const torch::Tensor& gathered_by_rank) {
  torch::Tensor dst = gather_destination().view({rows_, row_numel_});
  for (int r = 0; r < group_size_; ++r) {
    const int64_t valid = valid_rows_on(r);
    if (valid == 0) continue;
    dst.narrow(0, row_offset_on(r), valid)
        .copy_(
            gathered_by_rank[r].narrow(0, offset_, valid * row_numel_).view({valid, row_numel_}));
  }
}

void ParamSlot::keep_grad_for_sync(torch::ScalarType reduce_dtype) {
  torch::Tensor& grad = unsharded_.mutable_grad();
  if (!grad.defined() || c10::elementSize(reduce_dtype) <= c10::elementSize(grad.scalar_type()))
    return;
  torch::NoGradGuard no_grad;
  if (kept_grad_.defined()) {
    kept_grad_.add_(grad);
  } else {
    kept_grad_ = grad.to(reduce_dtype);
  }
  grad = torch::Tensor();
}

torch::Tensor ParamSlot::take_grad() {
  torch::Tensor grad = std::move(unsharded_.mutable_grad());
  unsharded_.mutable_grad() = torch::Tensor();
  if (!kept_grad_.defined()) return grad;
  torch::Tensor total = std::move(kept_grad_);
  kept_grad_ = torch::Tensor();
  if (grad.defined()) {
    torch::NoGradGuard no_grad;
    total.add_(grad);
  }
  return total;
}

void ParamSlot::clear_unsharded_grads() {
  unsharded_.mutable_grad() = torch::Tensor();
  kept_grad_ = torch::Tensor();
}

int64_t ParamSlot::unsharded_grad_bytes() const {
  int64_t bytes = 0;
  for (const auto* t : {&unsharded_.grad(), &kept_grad_}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->storage().nbytes());
  }
  return bytes;
}

bool ParamSlot::copy_in_grad(const torch::Tensor& grad, const torch::Tensor& send_by_rank,
                             int64_t column, double scale) const {
  const torch::Tensor grad_rows = grad.defined() ? grad.reshape({rows_, row_numel_}) : grad;
  for (int r = 0; r < group_size_; ++r) {
    torch::Tensor chunk =
        send_by_rank[r].narrow(0, column, shard_numel()).view({chunk_rows_, row_numel_});
    const int64_t valid = grad.defined() ? valid_rows_on(r) : 0;
    if (valid > 0) {
      torch::Tensor dst = chunk.narrow(0, 0, valid);
      torch::Tensor src = grad_rows.narrow(0, row_offset_on(r), valid);
      if (dst.scalar_type() == src.scalar_type()) {
        at::mul_out(dst, src, scale);  // the copy and the averaging factor in one pass
      } else {
        dst.copy_(src).mul_(scale);  // bf16 grads into an fp32 reduction, say
      }
    }
    if (valid < chunk_rows_) chunk.narrow(0, valid, chunk_rows_ - valid).zero_();
  }
  return grad.defined();
}

torch::Tensor ParamSlot::full_from_gathered(const torch::Tensor& gathered) const {
  return gathered.view({group_size_ * chunk_rows_, row_numel_}).narrow(0, 0, rows_).reshape(shape_);
}

}  // namespace shardrl::fsdp
