// What diffusers' transformers share, for the models built after them (sd3.cpp, qwen_image.cpp):
// their module layout, embeddings, feed-forward, weight files and LoRA files.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>

#include "shardrl/checkpoint.h"
#include "shardrl/models/lora.h"

namespace shardrl::models::detail {

// diffusers' weight files: `<stem>.safetensors`, or numbered files with
// `<stem>.safetensors.index.json`.
constexpr const char* kDiffusersWeightsStem = "diffusion_pytorch_model";
std::string diffusers_weights_file();  // "<stem>.safetensors"

// Registers an empty module `name` on `parent`, so children get diffusers' dotted names.
std::shared_ptr<torch::nn::Module> holder(torch::nn::Module& parent, const std::string& name);

// diffusers' SD3 and Qwen-Image transformers: eps of every LayerNorm and RMSNorm, and the
// sinusoidal timestep channels before the timestep MLP.
constexpr double kNormEps = 1e-6;
constexpr int64_t kTimestepChannels = 256;

// nn.LayerNorm(elementwise_affine=False): the norm before an adaLN modulation.
torch::Tensor plain_norm(const torch::Tensor& x, double eps = kNormEps);

// x * (1 + scale) + shift, with scale and shift [B, D] broadcast over the tokens of x [B, T, D].
torch::Tensor modulate(const torch::Tensor& normed, const torch::Tensor& shift,
                       const torch::Tensor& scale);

// diffusers' FeedForward(dim, activation_fn="gelu-approximate"): net.0.proj (dim -> 4 dim), tanh
// GELU, net.2 (4 dim -> dim), both LoraLinear.
struct FeedForward {
  lora::LoraLinear proj{nullptr}, out{nullptr};
  torch::Tensor operator()(const torch::Tensor& x);
};
// Registers `name`.net.0.proj and `name`.net.2 on `block`.
FeedForward feed_forward(torch::nn::Module& block, const std::string& name, int64_t dim);

// diffusers' get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0, scale):
// [cos(scale t f), sin(scale t f)] with f = 10000^(-k / (dim / 2)), fp32, the frequencies first
// rounded to t's dtype as diffusers rounds them.
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double scale);

// `dir`/diffusion_pytorch_model.safetensors (`tensors` in `dtype`, adapters left out) and
// `dir`/config.json: what save_pretrained writes.
void save_diffusers_folder(const std::map<std::string, torch::Tensor>& tensors,
                           const nlohmann::json& config, const std::string& dir,
                           torch::ScalarType dtype);

// A checkpoint export in diffusers' layout: its file names, and config.json without
// transformers' torch_dtype.
void set_diffusers_export_layout(checkpoint::ExportOptions& options);

// Adapter `name` of `params` as diffusers' pipelines and load_lora_adapter read a LoRA of their
// "transformer": `dir`/adapter_model.safetensors with tensors named
// `transformer.<module>.lora_A.weight` and the LoraConfig in the header's lora_adapter_metadata
// (every key under the same prefix), beside PEFT's adapter_config.json. `caller` names the
// function in errors.
void save_diffusers_lora(const std::map<std::string, torch::Tensor>& params,
                         const lora::LoraConfig& config, const std::string& name,
                         const std::string& dir, const std::string& caller);

}  // namespace shardrl::models::detail
