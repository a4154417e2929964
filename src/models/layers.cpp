#include "shardrl/models/layers.h"

#include <cmath>

#include "shardrl/fsdp.h"

namespace shardrl::models {

namespace F = torch::nn::functional;

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_in) : options(options_in) {
  const int64_t in = options.in_features(), out = options.out_features();
  weight = register_parameter("weight", fsdp::new_parameter({out, in}, [](torch::Tensor& w) {
                                torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
                              }));
  if (options.bias()) {
    const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
    bias = register_parameter("bias", fsdp::new_parameter({out}, [bound](torch::Tensor& b) {
                                torch::nn::init::uniform_(b, -bound, bound);
                              }));
  }
}

torch::Tensor linear_rows(const torch::Tensor& input, const torch::Tensor& weight,
                          const torch::Tensor& bias) {
  if (input.dim() <= 2) return F::linear(input, weight, bias);
  auto sizes = input.sizes().vec();
  sizes.back() = weight.size(0);
  return F::linear(input.reshape({-1, input.size(-1)}), weight, bias).view(sizes);
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
  if (!inference_kernel_) return linear_rows(input, weight, bias);
  TORCH_CHECK(!torch::GradMode::is_enabled(),
              "Linear: packed for inference (pack_for_inference), so it runs without grad only");
  return inference_kernel_(input);
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim) {
  weight = register_parameter(
      "weight", fsdp::new_parameter({num_embeddings, embedding_dim},
                                    [](torch::Tensor& w) { torch::nn::init::normal_(w); }));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& indices) {
  return torch::embedding(weight, indices);
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps) : dim_(dim), eps_(eps) {
  weight = register_parameter("weight",
                              fsdp::new_parameter({dim}, [](torch::Tensor& w) { w.fill_(1); }));
  bias =
      register_parameter("bias", fsdp::new_parameter({dim}, [](torch::Tensor& b) { b.zero_(); }));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& input) {
  return torch::layer_norm(input, {dim_}, weight, bias, eps_);
}

Conv2dImpl::Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride)
    : stride_(stride) {
  weight = register_parameter(
      "weight",
      fsdp::new_parameter({out_channels, in_channels, kernel, kernel}, [](torch::Tensor& w) {
        torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
      }));
  const int64_t fan_in = in_channels * kernel * kernel;
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  bias = register_parameter("bias", fsdp::new_parameter({out_channels}, [bound](torch::Tensor& b) {
                              torch::nn::init::uniform_(b, -bound, bound);
                            }));
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& input) {
  return torch::conv2d(input, weight, bias, stride_);
}

void zero_unless_empty(const torch::Tensor& param) {
  if (fsdp::has_no_values(param)) return;
  torch::NoGradGuard no_grad;
  param.detach().zero_();
}

}  // namespace shardrl::models
