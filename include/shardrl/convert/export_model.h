// `shardrl export`: a sharded checkpoint as the library of its model family loads it. The family
// is the checkpoint's extra.family, which Engine::save_checkpoint records with the family's
// config.json as extra.config:
//   "sd3"         a diffusers SD3Transformer2DModel folder (from_pretrained reads it)
//   "qwen_image"  a diffusers QwenImageTransformer2DModel folder
//   any other     a transformers-style folder (model-0000k-of-0000n.safetensors + index,
//   config.json)
//
//   models::export_model("ckpt/global_step_100", "out");               // base weights
//   models::export_model("ckpt/global_step_100", "merged", "default");  // with the LoRA folded in
#pragma once

#include <string>
#include <vector>

#include "shardrl/checkpoint.h"

namespace shardrl::convert {

// The base weights without adapter tensors, or with adapter `merge_adapter` folded in
// (lora::export_base), in the layout the family needs; options.dtype and max_shard_bytes apply to
// every family. A family whose config is missing or invalid is an error naming the checkpoint and
// the family. Returns the files written.
std::vector<std::string> export_model(const std::string& ckpt_dir, const std::string& out_dir,
                                      const std::string& merge_adapter = "",
                                      checkpoint::ExportOptions options = {});

}  // namespace shardrl::convert
