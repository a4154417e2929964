// The one velocity interface of the flow-matching transformers the diffusion algorithms train:
// SD3's MMDiT and Qwen-Image's. Each family's pipeline feeds its transformer differently (SD3:
// the latents as they are, timestep 1000 sigma, a pooled text projection; Qwen-Image: the latents
// packed into 2x2 patch tokens, timestep sigma, the text tokens' mask, and true CFG rescaled to
// the conditional prediction's norm); FlowModel does that feeding, so that the sampler and every
// loss see "the velocity of latents x [B, C, H, W] at noise level sigma [B]" alone.
//
// A FlowModel is a handle (the holder's shared module, sharded or not): copies call the same
// model, and an SD3 or Qwen-Image holder converts to one implicitly.
//
//   models::FlowModel model = sd3;                        // or a QwenImageTransformer2DModel
//   auto v = model.velocity(x, sigma, {embeds, pooled, mask});  // [B, C, H, W] fp32
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <string>
#include <variant>

#include "shardrl/models/qwen_image.h"
#include "shardrl/models/sd3.h"

namespace shardrl::models {

// One batch's text conditioning as the transformers read it (diffusers' argument names).
struct FlowText {
  torch::Tensor embeds;  // [B, L, joint_attention_dim]: prompt_embeds
  // [B, pooled_projection_dim]: SD3's pooled_prompt_embeds (required there; Qwen-Image has none).
  torch::Tensor pooled;
  // [B, L], 1 (or true) on a real token: Qwen-Image's encoder_hidden_states_mask (undefined:
  // every token is). SD3 attends to every token, as its pipeline does.
  torch::Tensor mask;
};

class FlowModel {
 public:
  FlowModel(SD3Transformer2DModel model);        // NOLINT(google-explicit-constructor)
  FlowModel(QwenImageTransformer2DModel model);  // NOLINT(google-explicit-constructor)

  // The velocity of latents x [B, C, H, W] at noise level sigma [B] (fp32, in [0, 1]; a 0-dim
  // sigma is every sample's) given `text` [B, ...], without guidance: [B, C, H, W] fp32.
  torch::Tensor velocity(const torch::Tensor& x, const torch::Tensor& sigma,
                         const FlowText& text) const;
  // The family pipeline's correction of the true-CFG velocity `guided` (v_uncond + s (v_cond -
  // v_uncond), [B, C, H, W]): SD3 none; Qwen-Image rescales each patch token of it to the norm of
  // the same token of v_cond (QwenImagePipeline's and verl-omni's Qwen-Image pipelines').
  torch::Tensor rescale_guidance(const torch::Tensor& guided, const torch::Tensor& v_cond) const;

  // C of the latents it denoises (Qwen-Image: in_channels / patch_size^2).
  int64_t latent_channels() const;
  // H and W must be multiples of it (SD3's and Qwen-Image's patch size).
  int64_t patch_size() const;
  bool reads_pooled() const;  // SD3
  bool reads_mask() const;    // Qwen-Image
  // diffusers' pipeline class of the family (verl-omni's model.architecture):
  // "StableDiffusion3Pipeline" or "QwenImagePipeline".
  const char* architecture() const;
  torch::nn::Module& module() const;
  // The diffusers config.json of the transformer (with its _class_name).
  nlohmann::json config_json() const;

 private:
  std::variant<SD3Transformer2DModel, QwenImageTransformer2DModel> model_;
};

// diffusers' pipeline class names (verl-omni's model.architecture values).
constexpr const char* kSD3Architecture = "StableDiffusion3Pipeline";
constexpr const char* kQwenImageArchitecture = "QwenImagePipeline";

// A transformer of `config_json` (diffusers' config.json: QwenImageTransformer2DModel's when its
// _class_name says so, else SD3's), unsharded and initialised from the current seed.
FlowModel make_flow_model(const nlohmann::json& config_json);
// Whether a diffusers transformer config.json is Qwen-Image's (its _class_name).
bool is_qwen_image_config(const nlohmann::json& config_json);
// The latent channels a transformer of that config denoises.
int64_t flow_latent_channels(const nlohmann::json& config_json);

}  // namespace shardrl::models
