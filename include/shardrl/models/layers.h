// Linear, Embedding, LayerNorm and Conv2d as torch::nn's (same param names, initialisation and
// output), with their params created through fsdp::new_parameter(), so a model built from them
// inside an fsdp::EmptyInit scope allocates nothing unsharded. LibTorch's own modules always
// allocate and initialise their params on construction. Llama, the GPT Transformer and the SD3
// transformer are built from these.
#pragma once

#include <torch/torch.h>

#include <functional>

#include "shardrl/fsdp.h"

namespace shardrl::models {

// F::linear over the input's rows as one 2-D GEMM, whatever the input's strides. at::matmul folds
// a strided 3-D input into one GEMM (copying it) when an operand requires grad and batches it
// otherwise, so the plain call's kernel, and the last bits of its result, would depend on
// requires_grad: a rollout replica (frozen params) and the trainer (trained ones) would compute
// different bits on the same inputs. A contiguous input is folded without a copy, as before.
torch::Tensor linear_rows(const torch::Tensor& input, const torch::Tensor& weight,
                          const torch::Tensor& bias = {});

class LinearImpl : public torch::nn::Module {
 public:
  // Kaiming-uniform weight and uniform bias, drawn in torch::nn::Linear's order.
  explicit LinearImpl(const torch::nn::LinearOptions& options);
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  torch::Tensor forward(const torch::Tensor& input);

  // A forward-only kernel that replaces F::linear on an inference replica (a rollout model):
  // the rollout installs one that holds the weight packed for a faster GEMM
  // (pack_for_inference). It does not follow later changes of `weight`: install it again after
  // each weight sync; an empty one restores F::linear. A forward with grad enabled while one is
  // installed is an error (no autograd reaches it).
  using InferenceKernel = std::function<torch::Tensor(const torch::Tensor&)>;
  void set_inference_kernel(InferenceKernel kernel) { inference_kernel_ = std::move(kernel); }
  bool packed_for_inference() const { return static_cast<bool>(inference_kernel_); }

  torch::nn::LinearOptions options;
  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out], undefined without bias

 private:
  InferenceKernel inference_kernel_;
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public torch::nn::Module {
 public:
  // N(0, 1) weight, as torch::nn::Embedding.
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
  torch::Tensor forward(const torch::Tensor& indices);

  torch::Tensor weight;  // [num_embeddings, embedding_dim]
};
TORCH_MODULE(Embedding);

}  // namespace shardrl::models

// An embedding's backward scatters the output's gradient into the weight's rows and never reads
// the weight: its FSDP unit gathers nothing for backward (the weight is used by nothing else here;
// a tied head shares it with the root's unit instead).
template <>
struct shardrl::fsdp::backward_reads_params<shardrl::models::EmbeddingImpl> : std::false_type {};

namespace shardrl::models {

class LayerNormImpl : public torch::nn::Module {
 public:
  // Normalises the last dim; weight ones and bias zeros.
  explicit LayerNormImpl(int64_t dim, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& input);

  torch::Tensor weight, bias;  // [dim]

 private:
  int64_t dim_;
  double eps_;
};
TORCH_MODULE(LayerNorm);

class Conv2dImpl : public torch::nn::Module {
 public:
  // Square kernel, no padding, no dilation or groups (a patch embedding when stride == kernel);
  // kaiming-uniform weight and uniform bias, as torch::nn::Conv2d.
  Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride = 1);
  torch::Tensor forward(const torch::Tensor& input);

  torch::Tensor weight;  // [out, in, kernel, kernel]
  torch::Tensor bias;    // [out]

 private:
  int64_t stride_;
};
TORCH_MODULE(Conv2d);

// Zeroes a param after its layer drew its usual initial values (adaLN-Zero's zero layers), so
// the random draws stay those of torch::nn; a param built under EmptyInit has no values to zero.
void zero_unless_empty(const torch::Tensor& param);

}  // namespace shardrl::models
