// The Qwen-Image transformer as diffusers' QwenImageTransformer2DModel computes it: an MMDiT of
// dual-stream blocks, each with its own adaLN modulation, norms and MLP for the image stream and
// the text stream and one joint attention over [text, image] (qk RMSNorm, 3-axis rotary positions
// on queries and keys, padding text keys hidden by encoder_hidden_states_mask). The input is the
// pipeline's packed latents (each token a patch_size x patch_size patch of latent channels), the
// text stream enters through an RMSNorm and a projection, the timestep (0..1, as the pipeline
// passes it) is embedded at 1000 t. The config is diffusers' config.json; parameter names are
// diffusers' (`img_in.weight`, `transformer_blocks.0.img_mod.1.weight`,
// `transformer_blocks.0.attn.add_q_proj.weight`, `transformer_blocks.0.txt_mlp.net.0.proj.weight`,
// ...), so its save_pretrained folders load here and what save_qwen_image() writes loads there.
//
// Every transformer block is an fsdp::Unit. The 12 projections of a block are LoraLinear, so
// adapters target them by diffusers' names (verl-omni's to_q, to_k, to_v, to_out.0, add_q_proj,
// add_k_proj, add_v_proj, to_add_out, img_mlp.net.0.proj, img_mlp.net.2, txt_mlp.net.0.proj,
// txt_mlp.net.2) through models::lora.
//
//   auto model = models::load_qwen_image("transformer-folder");      // config.json + weights
//   auto tokens = models::qwen_image_pack_latents(latents, 2);      // [B, C, H, W] -> tokens
//   std::vector<models::QwenImageShape> shapes = {{1, H / 2, W / 2}};
//   auto v = model(tokens, prompt_embeds, prompt_mask, sigma, shapes);  // sigma in 0..1
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <array>
#include <map>
#include <string>
#include <vector>

#include "shardrl/fsdp.h"
#include "shardrl/models/layers.h"
#include "shardrl/models/llama.h"  // RMSNorm
#include "shardrl/models/lora.h"
#include "shardrl/models/wrap_policy.h"

namespace shardrl::models {

// diffusers' QwenImageTransformer2DModel config, field for field (defaults are diffusers', which
// are Qwen/Qwen-Image's). The variants' switches (zero_cond_t: Qwen-Image-Edit-2511's
// condition-image modulation; use_additional_t_cond, use_layer3d_rope: Qwen-Image-Layered) are
// read and must be false: this model is the text-to-image one.
struct QwenImageConfig {
  int64_t patch_size = 2;  // only sizes proj_out: the pipeline packs the patches
  int64_t in_channels = 64;
  int64_t out_channels = 16;  // per latent channel of a patch: proj_out gives patch^2 x this
  int64_t num_layers = 60;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 3584;  // width of encoder_hidden_states (Qwen2.5-VL's hidden)
  bool guidance_embeds = false;        // diffusers builds nothing from it; kept for config.json
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};  // rotary dims of frame, height, width
  bool zero_cond_t = false;
  bool use_additional_t_cond = false;
  bool use_layer3d_rope = false;

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  void validate() const;  // errors name the field
  // diffusers' config.json (with "_class_name": "QwenImageTransformer2DModel").
  nlohmann::json to_json() const;
  // Unknown fields are ignored, as diffusers ignores them (the published config's
  // pooled_projection_dim among them).
  static QwenImageConfig from_json(const nlohmann::json& j);
  static QwenImageConfig load(const std::string& config_json_path);
};

// diffusers' config.json class name of this model.
constexpr const char* kQwenImageClassName = "QwenImageTransformer2DModel";

// One image of the token sequence, in patches: diffusers' img_shapes entry (frame, height,
// width). The text-to-image pipeline passes one, {1, latent height / 2, latent width / 2}; an
// edit pipeline appends its condition images.
using QwenImageShape = std::array<int64_t, 3>;

// The rotary angles of every token as cos and sin, [tokens, attention_head_dim / 2] fp32 each,
// diffusers' QwenEmbedRope (theta 10000, scale_rope): image j's tokens (frame-major, then rows,
// then columns) sit at frame position j + f and at centred row and column positions
// (-(h - h / 2) .. h / 2 - 1); text token i at position m + i on all three axes, m the largest
// h / 2 or w / 2 of the images. Each axis takes its axes_dims_rope share of the head dims, in
// interleaved (real, imaginary) pairs.
struct QwenImageRotary {
  torch::Tensor image_cos, image_sin;  // [sum of f h w, head_dim / 2]
  torch::Tensor text_cos, text_sin;    // [text tokens, head_dim / 2]
};
QwenImageRotary qwen_image_rotary(const QwenImageConfig& config,
                                  const std::vector<QwenImageShape>& img_shapes,
                                  int64_t text_tokens);

// The pipeline's _pack_latents: [B, C, H, W] latents -> [B, (H / p) (W / p), C p p] tokens, each
// a p x p patch, channel-major. H and W must be multiples of p.
torch::Tensor qwen_image_pack_latents(const torch::Tensor& latents, int64_t patch_size);
// Its _unpack_latents without the frame dim: [B, (H / p) (W / p), C p p] -> [B, C, H, W].
torch::Tensor qwen_image_unpack_latents(const torch::Tensor& tokens, int64_t height, int64_t width,
                                        int64_t patch_size);

// diffusers' Attention with QwenDoubleStreamAttnProcessor2_0: `to_*` project the image stream,
// `add_*_proj` the text stream, both attend over the concatenation [text, image].
class QwenImageAttentionImpl : public torch::nn::Module {
 public:
  explicit QwenImageAttentionImpl(const QwenImageConfig& config);
  // image [B, T, D], text [B, L, D], `rotary` for these tokens, `keys` (bool [B, keys], true for
  // a key that may be attended; undefined: all) -> {image out, text out}; text out undefined
  // when `text_output` is false.
  // Under sequence parallelism image, text and rotary are this rank's slices of both streams and
  // `keys` covers every rank's [text, image] slices in rank order: the joint attention runs over
  // all of them for heads / sp of the heads.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& image,
                                                  const torch::Tensor& text,
                                                  const QwenImageRotary& rotary,
                                                  const torch::Tensor& keys,
                                                  bool text_output = true);
  void set_sequence_parallel(dist::ProcessGroup* group) { sequence_parallel_ = group; }

  RMSNorm norm_q{nullptr}, norm_k{nullptr};
  lora::LoraLinear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  lora::LoraLinear add_k_proj{nullptr}, add_v_proj{nullptr}, add_q_proj{nullptr};
  lora::LoraLinear to_out{nullptr};  // to_out.0
  lora::LoraLinear to_add_out{nullptr};
  RMSNorm norm_added_q{nullptr}, norm_added_k{nullptr};

 private:
  int64_t heads_, head_dim_;
  dist::ProcessGroup* sequence_parallel_ = nullptr;
};
TORCH_MODULE(QwenImageAttention);

// diffusers' QwenImageTransformerBlock.
class QwenImageTransformerBlockImpl : public torch::nn::Module {
 public:
  explicit QwenImageTransformerBlockImpl(const QwenImageConfig& config);
  // image [B, T, D], text [B, L, D], temb [B, D] -> {image, text}; `rotary` and `keys` as
  // QwenImageAttentionImpl::forward takes them.
  std::vector<torch::Tensor> forward(torch::Tensor image, torch::Tensor text, torch::Tensor temb,
                                     const QwenImageRotary& rotary, torch::Tensor keys);
  // Recompute this block's activations in backward instead of keeping them.
  bool checkpoint_activations = false;
  // The last block's text stream feeds nothing (diffusers computes it and drops it): false there,
  // so it is not computed, its text params get no grad, and forward returns {image} alone.
  bool text_output = true;

  Linear img_mod{nullptr};  // img_mod.1 (after SiLU): shift, scale, gate of norm1, then of norm2
  QwenImageAttention attn{nullptr};
  lora::LoraLinear img_mlp_proj{nullptr}, img_mlp_out{nullptr};  // img_mlp.net.0.proj, .net.2
  Linear txt_mod{nullptr};                                       // txt_mod.1
  lora::LoraLinear txt_mlp_proj{nullptr}, txt_mlp_out{nullptr};  // txt_mlp.net.0.proj, .net.2

 private:
  std::vector<torch::Tensor> compute(const torch::Tensor& image, const torch::Tensor& text,
                                     const torch::Tensor& temb, const QwenImageRotary& rotary,
                                     const torch::Tensor& keys);
};

class QwenImageTransformer2DModelImpl : public torch::nn::Module {
 public:
  explicit QwenImageTransformer2DModelImpl(const QwenImageConfig& config);
  // hidden_states [B, S, in_channels] packed latents (S the f h w of img_shapes together),
  // encoder_hidden_states [B, L, joint_attention_dim], encoder_hidden_states_mask [B, L] (1 or
  // true for a real token; undefined: every token is), timestep [B] in diffusers' QwenImage scale
  // (the sigma, 0..1: the model embeds 1000 t), img_shapes as diffusers' img_shapes[0] (every
  // sample shares them, as diffusers uses the first sample's) -> [B, S, patch^2 out_channels].
  //
  // Under Ulysses sequence parallelism (set_sequence_parallel) every rank of the group takes the
  // same inputs and returns the same output, and the blocks run on this rank's slice of the image
  // tokens and of the text tokens, each padded to a multiple of the group size.
  torch::Tensor forward(torch::Tensor hidden_states, torch::Tensor encoder_hidden_states,
                        torch::Tensor encoder_hidden_states_mask, torch::Tensor timestep,
                        const std::vector<QwenImageShape>& img_shapes);
  const QwenImageConfig& config() const { return config_; }
  void set_activation_checkpointing(bool enabled);
  // Ulysses sequence parallelism over `group` (DeviceMesh::sequence_parallel_group; null turns it
  // off); its size must divide num_attention_heads.
  void set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group);

  std::vector<fsdp::Unit<QwenImageTransformerBlockImpl>> blocks;  // transformer_blocks.N

 private:
  QwenImageConfig config_;
  Linear t_linear_1_{nullptr}, t_linear_2_{nullptr};  // time_text_embed.timestep_embedder.*
  RMSNorm txt_norm_{nullptr};
  Linear img_in_{nullptr}, txt_in_{nullptr};
  Linear norm_out_{nullptr};  // norm_out.linear (AdaLayerNormContinuous: scale, then shift)
  Linear proj_out_{nullptr};
  std::shared_ptr<dist::ProcessGroup> sequence_parallel_;
};
using QwenImageTransformer2DModel = fsdp::Unit<QwenImageTransformer2DModelImpl>;

// Shards every transformer block as a unit, then the root (embedders, txt_norm, norm_out,
// proj_out).
void shard_qwen_image(QwenImageTransformer2DModel& model, const dist::DeviceMesh& mesh,
                      const WrapPolicy& policy);

// verl-omni's LoRA target modules for Qwen-Image: every projection of a block.
std::vector<std::string> qwen_image_lora_targets();

// Loads diffusers' weights (a folder with diffusion_pytorch_model.safetensors or its sharded
// index, or one .safetensors file) into the model's base params; a missing, unexpected or
// misshapen tensor is an error naming the file and the tensor. Call before sharding.
void load_qwen_image_weights(QwenImageTransformer2DModelImpl& model, const std::string& path);
// A diffusers folder (save_pretrained's config.json + weights) as an unsharded model.
QwenImageTransformer2DModel load_qwen_image(const std::string& dir);

// Writes `dir`/diffusion_pytorch_model.safetensors (the base params of `params` in `dtype`) and
// `dir`/config.json: a folder QwenImageTransformer2DModel.from_pretrained reads.
void save_qwen_image(const std::map<std::string, torch::Tensor>& params,
                     const QwenImageConfig& config, const std::string& dir,
                     torch::ScalarType dtype = torch::kFloat);

// What a checkpoint of this model needs to export as a diffusers folder
// (QwenImageTransformer2DModel.from_pretrained): diffusers' file names
// (diffusion_pytorch_model[-0000k-of-0000n].safetensors) and its config.json without
// transformers' torch_dtype. The rotary table is no tensor of the model's files.
void add_qwen_image_export(checkpoint::ExportOptions& options);

// Writes adapter `name` of `params` (full params) as diffusers loads a LoRA:
// `dir`/adapter_model.safetensors with tensors named `transformer.<module>.lora_A.weight` and its
// LoraConfig in the header's lora_adapter_metadata (so
// `QwenImageTransformer2DModel.load_lora_adapter(dir, weight_name="adapter_model.safetensors")`
// and QwenImagePipeline's load_lora_weights read it), beside PEFT's adapter_config.json.
void save_qwen_image_lora(const std::map<std::string, torch::Tensor>& params,
                          const lora::LoraConfig& config, const std::string& name,
                          const std::string& dir);

}  // namespace shardrl::models
