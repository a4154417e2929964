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
#include "qwen_image_export_check.h"
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

// The exports of the checkpoint read by diffusers and PEFT with ShardRL's output
// (qwen_image_export_check.h).
TEST_F(QwenImageExport, TrainedLoraCheckpointLoadsInDiffusersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"diffusers", "peft", "safetensors"}));
  ASSERT_FALSE(ckpt_.empty());
  expect_qwen_image_lora_export_loads_in_diffusers_and_peft(ckpt_, 12);
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
