// What every diffusers family's `shardrl export` test does with a LoRA checkpoint: load its own
// weights into a model of its config to compute ShardRL's outputs, and export it three ways (the
// base weights, adapter "default" merged in diffusers' sharded layout, the adapter alone) with
// diffusers' file names and config.json. The family's reference script then reads the exports
// (tests/qwen_image_export_check.h, tests/test_sd3_export.cpp). Gtest assertions.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "model_test_util.h"
#include "shardrl/checkpoint.h"

namespace shardrl::testing {

// Copies every param of `ckpt` (a checkpoint with LoRA adapter "default") into
// `model`, which has the checkpoint's config with the adapter applied.
inline void load_checkpoint_params(const std::string& ckpt, torch::nn::Module& model) {
  const nlohmann::json index = checkpoint::read_index(ckpt);
  auto params = models::state_dict(model);
  std::vector<std::string> names;
  for (const auto& [name, unused] : params) names.push_back(name);
  ASSERT_EQ(index.at("model").size(), names.size()) << "the checkpoint holds every param";
  torch::NoGradGuard no_grad;
  checkpoint::for_each_full_tensor(
      ckpt, names, [&](const std::string& name, const auto& full) { params.at(name).copy_(full); });
}

struct DiffusersExports {
  std::string base, merged, adapter;
};

// `shardrl export` of `ckpt` into root/base, root/merged (--merge-adapter default, small files)
// and root/adapter (--adapter default), in fp32: diffusers' file names (one file alone, or numbered
// files with their index) and `config` as config.json.
inline DiffusersExports export_three_ways(const std::string& ckpt, const std::string& root,
                                          const nlohmann::json& config) {
  namespace fs = std::filesystem;
  const DiffusersExports out{root + "/base", root + "/merged", root + "/adapter"};
  for (const auto& [dir, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {out.base, {}},
           {out.merged, {"--merge-adapter", "default", "--max-shard-size", "20000"}},
           {out.adapter, {"--adapter", "default"}}}) {
    std::vector<std::string> argv = {ckpt, dir, "--dtype", "fp32"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto exported = shardrl_export(argv);
    EXPECT_EQ(exported.exit_code, 0) << exported.output;
  }
  EXPECT_TRUE(fs::exists(out.base + "/diffusion_pytorch_model.safetensors"));
  EXPECT_EQ(count_files_matching(out.base, std::regex(".*safetensors.*")), 1u);
  EXPECT_TRUE(fs::exists(out.merged + "/diffusion_pytorch_model.safetensors.index.json"));
  EXPECT_GT(count_files_matching(
                out.merged, std::regex(R"(diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors)")),
            1u);
  for (const auto& dir : {out.base, out.merged}) {
    const auto written = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    EXPECT_EQ(written, config) << dir << ": config.json as diffusers writes it";
  }
  return out;
}

}  // namespace shardrl::testing
