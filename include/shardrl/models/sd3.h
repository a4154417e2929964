// The Stable Diffusion 3 / 3.5 transformer (MMDiT) as diffusers' SD3Transformer2DModel computes
// it: image patches and text tokens in two streams that meet in one joint attention per block,
// adaLN-Zero modulation from the timestep and the pooled text embedding, a cropped 2-D sin-cos
// position embedding, and SD3.5's options (qk_norm: rms_norm, dual_attention_layers with a second
// image-only attention). The config is diffusers' config.json; parameter names are diffusers'
// (`transformer_blocks.0.attn.to_q.weight`, `transformer_blocks.0.norm1.linear.weight`,
// `context_embedder.weight`, `pos_embed.proj.weight`, ...), so its save_pretrained folders load
// here and what save_sd3() writes loads in diffusers.
//
// Every transformer block is an fsdp::Unit. The attention projections are LoraLinear, so adapters
// target them by diffusers' names (to_q, to_k, to_v, to_out.0, add_q_proj, add_k_proj,
// add_v_proj, to_add_out) through models::lora.
//
//   auto model = models::load_sd3("sd3-folder");                     // config.json + weights
//   auto v = model(latents, prompt_embeds, pooled_prompt_embeds, timestep);
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "shardrl/fsdp.h"
#include "shardrl/models/layers.h"
#include "shardrl/models/llama.h"  // RMSNorm
#include "shardrl/models/lora.h"
#include "shardrl/models/wrap_policy.h"

namespace shardrl::models {

// diffusers' SD3Transformer2DModel config, field for field (defaults are diffusers').
struct SD3Config {
  int64_t sample_size = 128;  // latent height / width the position embedding is scaled for
  int64_t patch_size = 2;
  int64_t in_channels = 16;
  int64_t num_layers = 18;
  int64_t attention_head_dim = 64;
  int64_t num_attention_heads = 18;
  int64_t joint_attention_dim = 4096;     // width of encoder_hidden_states (prompt_embeds)
  int64_t caption_projection_dim = 1152;  // context_embedder's output: must be the inner dim
  int64_t pooled_projection_dim = 2048;   // width of pooled_projections
  int64_t out_channels = 16;
  int64_t pos_embed_max_size = 96;             // the position table is pos_embed_max_size^2 patches
  std::vector<int64_t> dual_attention_layers;  // blocks with attn2 (SD3.5)
  std::string qk_norm;                         // "" (none, JSON null) or "rms_norm"

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  bool dual_attention(int64_t layer) const;
  void validate() const;  // errors name the field
  // diffusers' config.json (with "_class_name": "SD3Transformer2DModel").
  nlohmann::json to_json() const;
  static SD3Config from_json(const nlohmann::json& j);
  static SD3Config load(const std::string& config_json_path);
};

// diffusers' get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0):
// [cos(t f), sin(t f)] with f = 10000^(-k / (dim / 2)), in fp32.
torch::Tensor sd3_timestep_embedding(const torch::Tensor& t, int64_t dim);
// diffusers' get_2d_sincos_pos_embed(dim, grid, base_size): [grid * grid, dim], positions scaled
// by base_size / grid, the width coordinate in the first half.
torch::Tensor sd3_pos_embed(int64_t dim, int64_t grid, int64_t base_size);

// diffusers' Attention with JointAttnProcessor2_0: `to_*` project the image stream, `add_*_proj`
// the text stream (absent in attn2), both attend over the concatenation [image, text].
class SD3AttentionImpl : public torch::nn::Module {
 public:
  // joint: with the text-stream projections; context_out: with to_add_out (all but the last block).
  SD3AttentionImpl(const SD3Config& config, bool joint, bool context_out);
  // x [B, T, D] (image), context [B, L, D] or undefined -> {image out, text out or undefined}.
  // With `need_context` false the text queries are not computed (the last block discards them).
  // Under sequence parallelism x and context are this rank's slices of both streams and `keys`
  // (bool [sp, T + L]) says which positions of every rank's slices are real: the joint attention
  // runs over all of them for heads / sp of the heads, padding keys hidden.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x,
                                                  const torch::Tensor& context, bool need_context,
                                                  const torch::Tensor& keys = {});
  void set_sequence_parallel(dist::ProcessGroup* group) { sequence_parallel_ = group; }

  lora::LoraLinear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};  // to_out.0
  lora::LoraLinear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr};
  lora::LoraLinear to_add_out{nullptr};
  RMSNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};

 private:
  int64_t heads_, head_dim_;
  dist::ProcessGroup* sequence_parallel_ = nullptr;
};
TORCH_MODULE(SD3Attention);

// diffusers' JointTransformerBlock.
class JointTransformerBlockImpl : public torch::nn::Module {
 public:
  JointTransformerBlockImpl(const SD3Config& config, int64_t layer);
  // hidden [B, T, D], context [B, L, D], temb [B, D] -> {hidden, context}; the last block
  // (context_pre_only) returns {hidden} alone. `keys`: SD3AttentionImpl::forward's, under
  // sequence parallelism.
  std::vector<torch::Tensor> forward(torch::Tensor hidden, torch::Tensor context,
                                     torch::Tensor temb, torch::Tensor keys = {});
  // Recompute this block's activations in backward instead of keeping them.
  bool checkpoint_activations = false;
  bool context_pre_only() const { return context_pre_only_; }

  Linear norm1{nullptr};          // norm1.linear: 6 D (9 D with attn2) adaLN-Zero chunks
  Linear norm1_context{nullptr};  // norm1_context.linear: 6 D, or 2 D (AdaLayerNormContinuous)
  SD3Attention attn{nullptr}, attn2{nullptr};
  lora::LoraLinear ff_proj{nullptr}, ff_out{nullptr};  // ff.net.0.proj, ff.net.2
  // ff_context.net.0.proj, ff_context.net.2; absent in the last block (context_pre_only).
  lora::LoraLinear ff_context_proj{nullptr}, ff_context_out{nullptr};

 private:
  std::vector<torch::Tensor> compute(const torch::Tensor& hidden, const torch::Tensor& context,
                                     const torch::Tensor& temb, const torch::Tensor& keys);
  bool context_pre_only_, dual_;
  int64_t dim_;
};

class SD3Transformer2DModelImpl : public torch::nn::Module {
 public:
  explicit SD3Transformer2DModelImpl(const SD3Config& config);
  // hidden_states [B, in_channels, H, W] latents (H, W multiples of patch_size, at most
  // pos_embed_max_size patches), encoder_hidden_states [B, L, joint_attention_dim],
  // pooled_projections [B, pooled_projection_dim], timestep [B] (diffusers' scale, 0..1000)
  // -> [B, out_channels, H, W].
  //
  // Under Ulysses sequence parallelism (set_sequence_parallel) every rank of the group takes the
  // same inputs and returns the same output, and the blocks run on this rank's slice of the image
  // tokens and of the text tokens, each padded to a multiple of the group size.
  torch::Tensor forward(torch::Tensor hidden_states, torch::Tensor encoder_hidden_states,
                        torch::Tensor pooled_projections, torch::Tensor timestep);
  const SD3Config& config() const { return config_; }
  void set_activation_checkpointing(bool enabled);
  // Ulysses sequence parallelism over `group` (DeviceMesh::sequence_parallel_group; null turns it
  // off); its size must divide num_attention_heads.
  void set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group);

  // diffusers' `pos_embed.pos_embed` (a persistent buffer there, a fixed table here: never a
  // param, so never trained or sharded) [1, max * max, D]; loading a file replaces it.
  const torch::Tensor& pos_embed_table() const { return pos_embed_; }
  void set_pos_embed_table(const torch::Tensor& table);

  std::vector<fsdp::Unit<JointTransformerBlockImpl>> blocks;  // transformer_blocks.N

 private:
  torch::Tensor patch_embed(const torch::Tensor& x);  // [B, C, H, W] -> [B, T, D] + cropped pos

  SD3Config config_;
  Conv2d pos_proj_{nullptr};                                // pos_embed.proj
  Linear t_linear_1_{nullptr}, t_linear_2_{nullptr};        // time_text_embed.timestep_embedder.*
  Linear text_linear_1_{nullptr}, text_linear_2_{nullptr};  // time_text_embed.text_embedder.*
  Linear context_embedder_{nullptr};
  Linear norm_out_{nullptr};  // norm_out.linear (AdaLayerNormContinuous: scale, then shift)
  Linear proj_out_{nullptr};
  torch::Tensor pos_embed_;
  std::shared_ptr<dist::ProcessGroup> sequence_parallel_;
};
using SD3Transformer2DModel = fsdp::Unit<SD3Transformer2DModelImpl>;

// Shards every transformer block as a unit, then the root (embedders, norm_out, proj_out).
void shard_sd3(SD3Transformer2DModel& model, const dist::DeviceMesh& mesh,
               const WrapPolicy& policy);

// diffusers' tensor name of the fixed position table.
constexpr const char* kSD3PosEmbedName = "pos_embed.pos_embed";

// Loads diffusers' weights (a folder with diffusion_pytorch_model.safetensors or its sharded
// index, or one .safetensors file) into the model's base params and position table; a missing,
// unexpected or misshapen tensor is an error naming the file and the tensor. Call before sharding.
void load_sd3_weights(SD3Transformer2DModelImpl& model, const std::string& path);
// A diffusers folder (save_pretrained's config.json + weights) as an unsharded model.
SD3Transformer2DModel load_sd3(const std::string& dir);

// Writes `dir`/diffusion_pytorch_model.safetensors (the base params of `params` in `dtype`, with
// the position table) and `dir`/config.json: a folder SD3Transformer2DModel.from_pretrained reads.
void save_sd3(const std::map<std::string, torch::Tensor>& params, const SD3Config& config,
              const std::string& dir, torch::ScalarType dtype = torch::kFloat);

// What a checkpoint of this model needs to export as a diffusers folder
// (SD3Transformer2DModel.from_pretrained): diffusers' file names
// (diffusion_pytorch_model[-0000k-of-0000n].safetensors), its config.json without transformers'
// torch_dtype, and the position table, which is no param and so not in the checkpoint.
void add_sd3_export(const SD3Config& config, checkpoint::ExportOptions& options);

// Writes adapter `name` of `params` (full params, e.g. FSDPModule::full_parameters() or
// state_dict) as diffusers loads a LoRA: `dir`/adapter_model.safetensors with tensors named
// `transformer.<module>.lora_A.weight` and its LoraConfig in the header's lora_adapter_metadata
// (so `SD3Transformer2DModel.load_lora_adapter(dir, weight_name="adapter_model.safetensors")` and
// SD3 pipelines' load_lora_weights read it), beside PEFT's adapter_config.json.
void save_sd3_lora(const std::map<std::string, torch::Tensor>& params,
                   const lora::LoraConfig& config, const std::string& name, const std::string& dir);

}  // namespace shardrl::models
