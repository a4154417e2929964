// A class-conditional flow-matching diffusion transformer after DiT (Peebles & Xie) / SiT:
// patchify, fixed 2-D sin-cos position embedding, sinusoidal timestep embedding + MLP, a label
// embedding whose extra row is the null class for classifier-free guidance, adaLN-Zero blocks and
// a velocity head. Parameter names follow facebookresearch/DiT (`blocks.0.attn.qkv.weight`,
// `blocks.0.adaLN_modulation.1.weight`, `final_layer.linear.weight`, ...). The attention and MLP
// projections are LoraLinear; each block is an fsdp::Unit.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "shardrl/fsdp.h"
#include "shardrl/models/layers.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/weights.h"
#include "shardrl/models/wrap_policy.h"

namespace shardrl::models {

struct DiTConfig {
  int64_t input_size = 28;  // square images of input_size x input_size pixels
  int64_t patch_size = 4;
  int64_t in_channels = 1;
  int64_t hidden_size = 64;
  int64_t depth = 2;
  int64_t num_heads = 4;
  double mlp_ratio = 4.0;
  int64_t num_classes = 10;  // label num_classes is the null class
  int64_t frequency_embedding_size = 256;
  // Flow-matching time t in [0, 1] is embedded as t * timestep_scale, so the sinusoid frequencies
  // (made for DDPM's 0..1000 steps) resolve it.
  double timestep_scale = 1000.0;

  int64_t grid_size() const { return input_size / patch_size; }
  int64_t mlp_hidden() const { return static_cast<int64_t>(hidden_size * mlp_ratio); }
  void validate() const;  // errors name the field
  nlohmann::json to_json() const;
  static DiTConfig from_json(const nlohmann::json& j);
};

// DiT's timestep_embedding: [cos(t f), sin(t f)] with f = max_period^(-k / (dim / 2)).
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double max_period = 10000);
// DiT's get_2d_sincos_pos_embed: [grid * grid, dim], width coordinate in the first half.
torch::Tensor sincos_pos_embed_2d(int64_t dim, int64_t grid);

class DiTBlockImpl : public torch::nn::Module {
 public:
  explicit DiTBlockImpl(const DiTConfig& config);
  // x [N, T, D] tokens, c [N, D] conditioning.
  torch::Tensor forward(torch::Tensor x, torch::Tensor c);
  // Recompute this block's activations in backward instead of keeping them.
  bool checkpoint_activations = false;

  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  lora::LoraLinear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};  // attn.*, mlp.*
  torch::nn::Sequential adaLN_modulation{nullptr};  // SiLU, Linear(D, 6 D), zero-initialised

 private:
  torch::Tensor compute(const torch::Tensor& x, const torch::Tensor& c);
  int64_t heads_;
};

class DiTImpl : public torch::nn::Module {
 public:
  explicit DiTImpl(const DiTConfig& config);
  // x [N, C, H, W] noisy images, t [N] in [0, 1], y [N] labels (num_classes = null) -> velocity
  // [N, C, H, W].
  torch::Tensor forward(torch::Tensor x, torch::Tensor t, torch::Tensor y);
  const DiTConfig& config() const { return config_; }
  // Activation checkpointing per block (see activation_checkpoint.h).
  void set_activation_checkpointing(bool enabled);

  torch::Tensor patchify(const torch::Tensor& x);    // [N, C, H, W] -> [N, T, D] embedded tokens
  torch::Tensor unpatchify(const torch::Tensor& x);  // [N, T, p * p * C] -> [N, C, H, W]

  std::vector<fsdp::Unit<DiTBlockImpl>> blocks;

 private:
  DiTConfig config_;
  Conv2d x_proj_{nullptr};                           // x_embedder.proj
  torch::nn::Sequential t_mlp_{nullptr};             // t_embedder.mlp
  Embedding y_table_{nullptr};                       // y_embedder.embedding_table
  torch::nn::LayerNorm final_norm_{nullptr};         // final_layer.norm_final (no params)
  Linear final_linear_{nullptr};                     // final_layer.linear
  torch::nn::Sequential final_modulation_{nullptr};  // final_layer.adaLN_modulation
  torch::Tensor pos_embed_;                          // fixed, not a parameter
};
using DiT = fsdp::Unit<DiTImpl>;

// Shards every block as a unit, then the root (the small embedders and the final layer).
void shard_dit(DiT& model, const dist::DeviceMesh& mesh, const WrapPolicy& policy);

// Labels with each replaced by the null class with probability p (CFG training).
torch::Tensor drop_labels(const torch::Tensor& y, int64_t null_class, double p,
                          at::Generator generator);

// Conditional and unconditional velocities from one batched forward (the batch doubles).
std::pair<torch::Tensor, torch::Tensor> cfg_branches(DiT& model, const torch::Tensor& x,
                                                     const torch::Tensor& t,
                                                     const torch::Tensor& y);
// uncond + scale * (cond - uncond).
torch::Tensor guided_velocity(DiT& model, const torch::Tensor& x, const torch::Tensor& t,
                              const torch::Tensor& y, double scale);

// Writes `dir`/model.safetensors (base weights) and `dir`/config.json.
void save_dit(const std::map<std::string, torch::Tensor>& params, const DiTConfig& config,
              const std::string& dir, torch::ScalarType dtype = torch::kFloat);

}  // namespace shardrl::models
