// The Qwen-Image flow-matching training scenario shared by qwen_image_worker and the in-process
// tests in tests/test_qwen_image.cpp, so both build the same model and see the same data.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/models/qwen_image.h"

namespace shardrl::testing {

struct QwenImageScenario {
  int64_t steps = 3;
  int64_t batch = 4;        // global batch, split evenly over the data-parallel ranks
  int64_t text_tokens = 5;  // row i masks its last i % 3 of them
  int64_t latent_height = 6, latent_width = 8;  // 3 x 4 patches: 12 image tokens
  double lr = 1e-3;
  uint64_t seed = 29;
};

// Small, with every part of the published one: 2 blocks of 2 heads of 8 dims (rotary axes 2, 2,
// 4), 2 latent channels packed in 2 x 2 patches.
inline models::QwenImageConfig qwen_image_test_config() {
  models::QwenImageConfig c;
  c.patch_size = 2;
  c.in_channels = 8;
  c.out_channels = 2;
  c.num_layers = 2;
  c.attention_head_dim = 8;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 12;
  c.axes_dims_rope = {2, 2, 4};
  return c;
}

inline std::vector<models::QwenImageShape> qwen_image_test_shapes(const QwenImageScenario& s) {
  return {{1, s.latent_height / 2, s.latent_width / 2}};
}

struct QwenImageBatch {
  torch::Tensor xt, prompt_embeds, prompt_mask, timestep, target;
};

// Rectified flow on random latents, packed as the pipeline packs them: x_t = (1 - t) data +
// t noise at diffusers' QwenImage timestep t, velocity target noise - data.
inline QwenImageBatch qwen_image_batch(const QwenImageScenario& s, int64_t step) {
  const auto c = qwen_image_test_config();
  const int64_t channels = c.in_channels / (c.patch_size * c.patch_size);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 1000 + step);
  auto data = models::qwen_image_pack_latents(
      torch::randn({s.batch, channels, s.latent_height, s.latent_width}, gen), c.patch_size);
  auto noise = torch::randn(data.sizes(), gen);
  auto prompt = torch::randn({s.batch, s.text_tokens, c.joint_attention_dim}, gen);
  auto mask = torch::ones({s.batch, s.text_tokens}, torch::kLong);
  for (int64_t i = 0; i < s.batch; ++i) mask[i].narrow(0, s.text_tokens - i % 3, i % 3).zero_();
  auto t = torch::rand({s.batch}, gen);
  auto tt = t.view({-1, 1, 1});
  return {(1 - tt) * data + tt * noise, prompt, mask, t, noise - data};
}

}  // namespace shardrl::testing
