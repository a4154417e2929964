#include "shardrl/ulysses.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

namespace shardrl::ulysses {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

dist::ProcessGroup* group_from(AutogradContext* ctx) {
  return reinterpret_cast<dist::ProcessGroup*>(ctx->saved_data["group"].toInt());
}

int64_t normalized_dim(int64_t dim, int64_t rank) {
  return dim < 0 ? dim + rank : dim;
}

// The exchange itself, without autograd: chunk j of `x` along scatter_dim to rank j, the chunks
// received concatenated along gather_dim.
torch::Tensor exchange(const torch::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                       dist::ProcessGroup& group) {
  const int sp = group.size();
  TORCH_CHECK(x.size(scatter_dim) % sp == 0, "ulysses all-to-all: dim ", scatter_dim, " of ",
              x.sizes(), " does not split into ", sp, " equal chunks");
  // [sp, chunk...]: chunk j contiguous at row j, as the transport sends dim-0 rows.
  auto chunks = x.chunk(sp, scatter_dim);
  auto send = torch::stack(chunks, 0).contiguous();
  auto received = torch::empty_like(send);
  group.all_to_all(send, received);
  return torch::cat(received.unbind(0), gather_dim);
}

struct AllToAll : public torch::autograd::Function<AllToAll> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t scatter_dim,
                               int64_t gather_dim, int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["scatter_dim"] = scatter_dim;
    ctx->saved_data["gather_dim"] = gather_dim;
    return exchange(x, scatter_dim, gather_dim, *reinterpret_cast<dist::ProcessGroup*>(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The transposed exchange: what was gathered along gather_dim is scattered back along it.
    auto grad = exchange(grads[0].contiguous(), ctx->saved_data["gather_dim"].toInt(),
                         ctx->saved_data["scatter_dim"].toInt(), *group_from(ctx));
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct GatherOutputs : public torch::autograd::Function<GatherOutputs> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim,
                               int64_t group) {
    auto& g = *reinterpret_cast<dist::ProcessGroup*>(group);
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["local"] = x.size(dim);
    auto mine = x.contiguous();
    auto all = torch::empty({g.size() * mine.numel()}, mine.options());
    g.all_gather(mine, all);
    std::vector<int64_t> shape{g.size()};
    for (auto s : mine.sizes()) shape.push_back(s);
    return torch::cat(all.view(shape).unbind(0), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t local = ctx->saved_data["local"].toInt();
    const int64_t dim = ctx->saved_data["dim"].toInt();
    auto grad = grads[0].narrow(dim, group_from(ctx)->rank() * local, local);
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};

int64_t handle(dist::ProcessGroup& group) {
  return reinterpret_cast<int64_t>(&group);
}

}  // namespace

SequenceSlice sequence_slice(int64_t length, const dist::ProcessGroup& group) {
  const int64_t sp = group.size();
  SequenceSlice s;
  s.length = length;
  s.padded_length = (length + sp - 1) / sp * sp;
  s.local_length = s.padded_length / sp;
  s.begin = group.rank() * s.local_length;
  return s;
}

torch::Tensor pad_and_slice(const torch::Tensor& x, int64_t dim, const dist::ProcessGroup& group,
                            double value) {
  dim = normalized_dim(dim, x.dim());
  const auto slice = sequence_slice(x.size(dim), group);
  torch::Tensor padded = x;
  if (slice.padded_length > slice.length) {
    // constant_pad_nd counts its pairs from the last dim.
    std::vector<int64_t> pad(2 * (x.dim() - dim), 0);
    pad[pad.size() - 1] = slice.padded_length - slice.length;
    padded = at::constant_pad_nd(x, pad, value);
  }
  return padded.narrow(dim, slice.begin, slice.local_length);
}

torch::Tensor all_to_all(const torch::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                         dist::ProcessGroup& group) {
  if (group.size() == 1) return x;
  return AllToAll::apply(x, normalized_dim(scatter_dim, x.dim()),
                         normalized_dim(gather_dim, x.dim()), handle(group));
}

torch::Tensor gather_outputs_and_unpad(const torch::Tensor& x, int64_t dim, int64_t length,
                                       dist::ProcessGroup& group) {
  dim = normalized_dim(dim, x.dim());
  torch::Tensor all = group.size() == 1 ? x : GatherOutputs::apply(x, dim, handle(group));
  TORCH_CHECK(length <= all.size(dim), "gather_outputs_and_unpad: length ", length,
              " exceeds the gathered ", all.size(dim));
  return all.narrow(dim, 0, length);
}

void check_heads(int64_t heads, int64_t kv_heads, int sp) {
  if (sp < 1 || heads % sp != 0) {
    throw std::invalid_argument(fmt::format(
        "ulysses_sequence_parallel_size={} must divide the number of attention heads {} (each "
        "rank attends with heads / sp of them)",
        sp, heads));
  }
  if (kv_heads % sp != 0 && sp % kv_heads != 0) {
    throw std::invalid_argument(fmt::format(
        "ulysses_sequence_parallel_size={} must divide the number of key/value heads {} or be a "
        "multiple of it (key/value heads are then repeated, one per rank)",
        sp, kv_heads));
  }
}

}  // namespace shardrl::ulysses
