// FlowModel: how each family's pipeline calls its transformer for a velocity.
#include "shardrl/models/flow_model.h"

#include <fmt/format.h>

#include <stdexcept>

namespace shardrl::models {

namespace {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

// The latent channels Qwen-Image denoises: each token packs a patch_size^2 patch of them.
int64_t qwen_image_latent_channels(const QwenImageConfig& c) {
  return c.in_channels / (c.patch_size * c.patch_size);
}

// sigma as one fp32 value per sample on x's device.
torch::Tensor per_sample(const torch::Tensor& sigma, const torch::Tensor& x) {
  return sigma.to(x.device(), torch::kFloat).expand({x.size(0)}).contiguous();
}

}  // namespace

FlowModel::FlowModel(SD3Transformer2DModel model) : model_(std::move(model)) {}

FlowModel::FlowModel(QwenImageTransformer2DModel model) : model_(std::move(model)) {
  const auto& c = std::get<QwenImageTransformer2DModel>(model_)->config();
  if (c.in_channels != c.out_channels * c.patch_size * c.patch_size) {
    throw std::invalid_argument(fmt::format(
        "Qwen-Image config: in_channels {} must be out_channels {} x patch_size {}^2: the "
        "velocity of packed latents unpacks to the latents' shape",
        c.in_channels, c.out_channels, c.patch_size));
  }
}

torch::Tensor FlowModel::velocity(const torch::Tensor& x, const torch::Tensor& sigma,
                                  const FlowText& text) const {
  TORCH_CHECK(x.dim() == 4, "FlowModel::velocity: latents must be [B, C, H, W], got ", x.sizes());
  return std::visit(
      Overloaded{[&](SD3Transformer2DModel model) {
                   if (!text.pooled.defined()) {
                     throw std::invalid_argument(
                         "pooled_prompt_embeds: missing (the SD3 transformer's pooled projection "
                         "reads it)");
                   }
                   // SD3's scheduler timesteps are 1000 sigma, which the pipeline passes as they
                   // are.
                   return model(x, text.embeds, text.pooled, per_sample(sigma, x) * 1000.0)
                       .to(torch::kFloat);
                 },
                 [&](QwenImageTransformer2DModel model) {
                   // QwenImagePipeline: packed latents, img_shapes (1, H / 2, W / 2), timestep /
                   // 1000 (the sigma; the model embeds 1000 t), the prompt's mask, no pooled
                   // embedding.
                   const int64_t p = model->config().patch_size;
                   const int64_t h = x.size(2), w = x.size(3);
                   auto out =
                       model(qwen_image_pack_latents(x, p), text.embeds, text.mask,
                             per_sample(sigma, x), std::vector<QwenImageShape>{{1, h / p, w / p}});
                   return qwen_image_unpack_latents(out.to(torch::kFloat), h, w, p);
                 }},
      model_);
}

torch::Tensor FlowModel::rescale_guidance(const torch::Tensor& guided,
                                          const torch::Tensor& v_cond) const {
  if (!reads_mask()) return guided;
  const int64_t p = patch_size();
  auto comb = qwen_image_pack_latents(guided, p);
  auto cond = qwen_image_pack_latents(v_cond.to(torch::kFloat), p);
  auto rescaled = comb * (torch::linalg_vector_norm(cond, 2, {-1}, /*keepdim=*/true) /
                          torch::linalg_vector_norm(comb, 2, {-1}, /*keepdim=*/true));
  return qwen_image_unpack_latents(rescaled, guided.size(2), guided.size(3), p);
}

int64_t FlowModel::latent_channels() const {
  return std::visit(
      Overloaded{[](const SD3Transformer2DModel& m) { return m->config().in_channels; },
                 [](const QwenImageTransformer2DModel& m) {
                   return qwen_image_latent_channels(m->config());
                 }},
      model_);
}

int64_t FlowModel::patch_size() const {
  return std::visit([](const auto& m) { return m->config().patch_size; }, model_);
}

bool FlowModel::reads_pooled() const {
  return std::holds_alternative<SD3Transformer2DModel>(model_);
}
bool FlowModel::reads_mask() const {
  return std::holds_alternative<QwenImageTransformer2DModel>(model_);
}

const char* FlowModel::architecture() const {
  return reads_mask() ? kQwenImageArchitecture : kSD3Architecture;
}

torch::nn::Module& FlowModel::module() const {
  return std::visit([](const auto& m) -> torch::nn::Module& { return *m.ptr(); }, model_);
}

nlohmann::json FlowModel::config_json() const {
  return std::visit([](const auto& m) { return m->config().to_json(); }, model_);
}

bool is_qwen_image_config(const nlohmann::json& config_json) {
  return config_json.is_object() &&
         config_json.value("_class_name", std::string()) == std::string(kQwenImageClassName);
}

FlowModel make_flow_model(const nlohmann::json& config_json) {
  if (is_qwen_image_config(config_json)) {
    return QwenImageTransformer2DModel(QwenImageConfig::from_json(config_json));
  }
  return SD3Transformer2DModel(SD3Config::from_json(config_json));
}

int64_t flow_latent_channels(const nlohmann::json& config_json) {
  if (is_qwen_image_config(config_json)) {
    return qwen_image_latent_channels(QwenImageConfig::from_json(config_json));
  }
  return SD3Config::from_json(config_json).in_channels;
}

}  // namespace shardrl::models
