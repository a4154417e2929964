// `shardrl export` of a Qwen-Image LoRA checkpoint read by diffusers and PEFT
// (tests/python/qwen_image_reference.py export), for any checkpoint of family "qwen_image": the
// engine test's and the diffusion trainer's. Gtest assertions; call it from a TEST body.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "diffusers_export_check.h"
#include "model_test_util.h"
#include "shardrl/models/qwen_image.h"

namespace shardrl::testing {

// The exports of `ckpt` (base, adapter "default" merged in diffusers' sharded layout, adapter
// alone) against ShardRL's forward of the checkpoint's own weights on a random packed batch with
// a padded text mask: in diffusers the base export gives the base model's output and the merged
// export the LoRA model's; the adapter export on the base gives the merged output in diffusers and
// in PEFT. The adapter targets `lora_targets` modules.
inline void expect_qwen_image_lora_export_loads_in_diffusers_and_peft(const std::string& ckpt,
                                                                      size_t lora_targets) {
  using nlohmann::json;
  const json index = checkpoint::read_index(ckpt);
  const json& extra = index.at("extra");
  ASSERT_EQ(extra.value("family", ""), "qwen_image") << ckpt;
  const auto config = models::QwenImageConfig::from_json(extra.at("config"));
  models::QwenImageTransformer2DModel model(config);
  const auto lora = models::lora::config_from_peft(extra.at("lora").at("default"), ckpt);
  EXPECT_EQ(lora.target_modules.size(), lora_targets);
  models::lora::apply_lora(*model, lora, "default");
  load_checkpoint_params(ckpt, *model);
  torch::NoGradGuard no_grad;

  // Two samples of 3 x 4 patches, 5 text tokens of which the second sample's last 2 are padding.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const std::vector<models::QwenImageShape> shapes = {{1, 3, 4}};
  auto mask = torch::ones({2, 5});
  mask[1].narrow(0, 3, 2).zero_();
  std::map<std::string, torch::Tensor> io = {
      {"x", torch::randn({2, 12, config.in_channels}, gen)},
      {"prompt_embeds", torch::randn({2, 5, config.joint_attention_dim}, gen)},
      {"mask", mask},
      {"t", torch::tensor({0.3f, 0.85f})},
      {"img_shapes", torch::tensor({shapes[0][0], shapes[0][1], shapes[0][2]}).view({1, 3})}};
  auto forward = [&] { return model(io["x"], io["prompt_embeds"], io["mask"], io["t"], shapes); };
  {
    models::lora::DisableAdapters base(*model);
    io["out"] = forward();
  }
  io["out_lora"] = forward();
  const std::string root = make_temp_dir("qwen-image-export-check");
  models::save_weights(io, root + "/io.safetensors");

  const auto exports = export_three_ways(ckpt, root, config.to_json());
  expect_checks_pass(
      run_python_reference("qwen_image_reference.py", {"export", exports.base, exports.merged,
                                                       exports.adapter, root + "/io.safetensors"}),
      5);
}

}  // namespace shardrl::testing
