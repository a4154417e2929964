// `shardrl export` of a Qwen-Image checkpoint, read by diffusers and PEFT
// (tests/python/qwen_image_reference.py export): an engine of the diffusion model type trains a
// LoRA adapter on verl-omni's 12 targets, sharded on 2 real ranks, and saves its checkpoint as a
// trainer does (family "qwen_image" from the registry); the real binary exports its base weights,
// the adapter merged in, and the adapter alone.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>

#include "checkpoint/reader.h"  // index_checksum_line, to write a checkpoint with a bad config
#include "model_test_util.h"
#include "shardrl/checkpoint.h"
#include "workers/qwen_image_scenario.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class QwenImageExport : public ::testing::Test {
 protected:
  // One LoRA run for the suite: 2 ranks, every block an FSDP unit, AdamW on the adapter.
  static void SetUpTestSuite() {
    const QwenImageScenario s;
    const std::string dir = make_temp_dir("qwen-image-export-train");
    const auto trained = launch_workers(
        2, {"--out", dir, "--lr", "1e-2", "--lora-rank", "4", "--save", dir + "/ckpt"}, 300,
        "qwen_image_worker");
    if (trained.exit_code != 0) {
      ADD_FAILURE() << trained.output;
      return;
    }
    ckpt_ = dir + "/ckpt/global_step_" + std::to_string(s.steps);
  }
  static std::string ckpt_;
};
std::string QwenImageExport::ckpt_;

// The exports of the checkpoint against ShardRL's forward of its own weights on the same input:
// in diffusers the base export gives the base model's output and the merged export the LoRA
// model's; the adapter export on the base gives the merged output in diffusers and in PEFT.
TEST_F(QwenImageExport, TrainedLoraCheckpointLoadsInDiffusersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"diffusers", "peft", "safetensors"}));
  ASSERT_FALSE(ckpt_.empty());
  const json index = checkpoint::read_index(ckpt_);
  const json& extra = index.at("extra");
  ASSERT_EQ(extra.value("family", ""), "qwen_image") << ckpt_;
  const auto config = models::QwenImageConfig::from_json(extra.at("config"));
  models::QwenImageTransformer2DModel model(config);
  const auto lora = models::lora::config_from_peft(extra.at("lora").at("default"), ckpt_);
  EXPECT_EQ(lora.target_modules.size(), 12u);
  models::lora::apply_lora(*model, lora, "default");
  auto params = models::state_dict(*model);
  std::vector<std::string> names;
  for (const auto& [name, unused] : params) names.push_back(name);
  ASSERT_EQ(index.at("model").size(), names.size()) << "the checkpoint holds every param";
  torch::NoGradGuard no_grad;
  checkpoint::for_each_full_tensor(ckpt_, names, [&](const std::string& name, const auto& full) {
    params.at(name).copy_(full);
  });

  // A batch of the scenario: packed latents, a text mask with padding, sigmas.
  const QwenImageScenario s;
  const auto b = qwen_image_batch(s, 7);
  const std::vector<models::QwenImageShape> shapes = qwen_image_test_shapes(s);
  std::map<std::string, torch::Tensor> io = {
      {"x", b.xt},
      {"prompt_embeds", b.prompt_embeds},
      {"mask", b.prompt_mask.to(torch::kFloat)},
      {"t", b.timestep},
      {"img_shapes", torch::tensor({shapes[0][0], shapes[0][1], shapes[0][2]}).view({1, 3})}};
  auto forward = [&] { return model(io["x"], io["prompt_embeds"], io["mask"], io["t"], shapes); };
  {
    models::lora::DisableAdapters base(*model);
    io["out"] = forward();
  }
  io["out_lora"] = forward();
  const std::string root = make_temp_dir("qwen-image-export-check");
  models::save_weights(io, root + "/io.safetensors");

  const std::string base = root + "/base", merged = root + "/merged", adapter = root + "/adapter";
  for (const auto& [out, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {base, {}},
           // Small files: diffusers' sharded layout.
           {merged, {"--merge-adapter", "default", "--max-shard-size", "20000"}},
           {adapter, {"--adapter", "default"}}}) {
    std::vector<std::string> argv = {ckpt_, out, "--dtype", "fp32"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto exported = shardrl_export(argv);
    ASSERT_EQ(exported.exit_code, 0) << exported.output;
  }
  // diffusers' names: one file alone, or numbered files with their index.
  EXPECT_TRUE(fs::exists(base + "/diffusion_pytorch_model.safetensors"));
  EXPECT_EQ(count_files_matching(base, std::regex(".*safetensors.*")), 1u);
  EXPECT_TRUE(fs::exists(merged + "/diffusion_pytorch_model.safetensors.index.json"));
  EXPECT_GT(count_files_matching(
                merged, std::regex(R"(diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors)")),
            1u);
  for (const auto& dir : {base, merged}) {
    const auto written = json::parse(std::ifstream(dir + "/config.json"));
    EXPECT_EQ(written, config.to_json()) << dir << ": config.json as diffusers writes it";
  }
  expect_checks_pass(
      run_python_reference("qwen_image_reference.py",
                           {"export", base, merged, adapter, root + "/io.safetensors"}),
      5);
}

// A "qwen_image" checkpoint whose config diffusers could not load is refused before anything is
// written, naming the checkpoint, the family and the field.
TEST_F(QwenImageExport, BadConfigIsAnErrorNamingCheckpointAndFamily) {
  ASSERT_FALSE(ckpt_.empty());
  const std::string root = make_temp_dir("qwen-image-export-bad");
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"axes_dims_rope", {2, 2, 2}}, {"_class_name", "SD3Transformer2DModel"}}) {
    const std::string ckpt = root + "/" + field;
    fs::copy(ckpt_, ckpt, fs::copy_options::recursive);
    json index = checkpoint::read_index(ckpt);
    index["extra"]["config"][field] = value;
    const std::string text = index.dump();
    std::ofstream(ckpt + "/" + checkpoint::kIndexFile) << text;
    std::ofstream(ckpt + "/" + checkpoint::kIndexChecksumFile)
        << checkpoint::index_checksum_line(text);
    const auto refused = shardrl_export({ckpt, root + "/out-" + field});
    EXPECT_NE(refused.exit_code, 0) << field;
    for (const std::string& named : {ckpt, std::string("family qwen_image"), field}) {
      EXPECT_NE(refused.output.find(named), std::string::npos) << named << ": " << refused.output;
    }
    EXPECT_FALSE(fs::exists(root + "/out-" + field)) << field;
  }
}

}  // namespace
}  // namespace shardrl::testing
