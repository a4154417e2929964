// Real Hugging Face clients on what `shardrl train` and `shardrl export` write: transformers
// loads the exports, PEFT the adapter, the safetensors library every file, and ShardRL loads
// transformers' save_pretrained; logits and greedy tokens agree (tests/python/hf_clients.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string hf_clients_script() {
  return std::string(SHARDRL_SOURCE_DIR "/tests/python/hf_clients.py");
}

struct TrainedRun {
  std::string root, checkpoint;
  json model_overrides;  // actor_rollout_ref.model.config.* given on the command line
};

std::string example_config() {
  return std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml");
}

// The GRPO arithmetic job with LoRA, shortened: a trainer checkpoint of a model whose adapter
// has moved.
TrainedRun train_with_lora(const std::string& tag, const json& model_overrides) {
  TrainedRun run;
  run.root = make_temp_dir(tag);
  run.model_overrides = model_overrides;
  std::vector<std::string> argv = {bin("shardrl"),
                                   "train",
                                   example_config(),
                                   "trainer.default_local_dir=" + run.root,
                                   "trainer.total_training_steps=3",
                                   "trainer.save_freq=3",
                                   "sft.steps=20",
                                   "actor_rollout_ref.model.lora_rank=4",
                                   "actor_rollout_ref.model.lora_alpha=8",
                                   "actor_rollout_ref.actor.optim.lr=0.02"};
  for (const auto& [key, value] : model_overrides.items()) {
    argv.push_back("actor_rollout_ref.model.config." + key + "=" +
                   (value.is_string() ? value.get<std::string>() : value.dump()));
  }
  const auto trained = run_process(argv, {{"OMP_NUM_THREADS", "1"}}, 600);
  EXPECT_EQ(trained.exit_code, 0) << trained.output;
  run.checkpoint = run.root + "/checkpoints/global_step_3";
  return run;
}

void export_and_check(const TrainedRun& run, const std::string& family_model_type,
                      const std::string& tokens) {
  ASSERT_TRUE(fs::exists(run.checkpoint + "/index.json")) << run.checkpoint;
  // What export needs rides in the checkpoint: the family, its HF config, the adapter's PEFT
  // config.
  const json extra = json::parse(std::ifstream(run.checkpoint + "/index.json"))["extra"];
  EXPECT_EQ(extra["family"], "llama") << extra.dump();
  EXPECT_EQ(extra["config"]["model_type"], family_model_type) << extra.dump();
  EXPECT_EQ(extra["lora"]["default"]["r"], 4) << extra.dump();
  EXPECT_EQ(extra["lora"]["default"]["lora_alpha"], 8.0) << extra.dump();

  // A checkpoint without the model's config is refused rather than exported into a directory no
  // library loads. Such a checkpoint is an old one: its index is of version 1, from before
  // index.json.crc32.
  const std::string bare = run.root + "/bare-checkpoint";
  fs::copy(run.checkpoint, bare, fs::copy_options::recursive);
  json index = json::parse(std::ifstream(bare + "/index.json"));
  index["extra"].erase("config");
  index["version"] = 1;
  std::ofstream(bare + "/index.json") << index.dump();
  fs::remove(bare + "/index.json.crc32");
  const auto refused = run_process({bin("shardrl"), "export", bare, run.root + "/export-bare"});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("extra.config"), std::string::npos) << refused.output;
  const std::string base = run.root + "/export-base", merged = run.root + "/export-merged",
                    adapter = run.root + "/export-adapter";
  for (const auto& [out, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {base, {"--dtype", "fp32"}},
           {merged, {"--dtype", "fp32", "--merge-adapter", "default"}},
           {adapter, {"--adapter", "default"}}}) {
    std::vector<std::string> argv = {bin("shardrl"), "export", run.checkpoint, out};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto exported = run_process(argv);
    ASSERT_EQ(exported.exit_code, 0) << exported.output;
  }
  // The config transformers reads is the model's, not an empty one.
  const json config = json::parse(std::ifstream(base + "/config.json"));
  EXPECT_EQ(config.value("architectures", json::array()).size(), 1u) << config.dump();
  EXPECT_TRUE(config.contains("hidden_size")) << config.dump();

  expect_checks_pass(
      run_process({SHARDRL_PYTHON, hf_clients_script(), "exports", bin("shardrl"), base, merged,
                   adapter, run.checkpoint, tokens, example_config(), run.model_overrides.dump()},
                  {{"HF_HUB_OFFLINE", "1"}}, 600),
      10);
}

// LLaMA with tied embeddings and GQA (the job's model), through train, export and the clients.
TEST(HfClients, LlamaTrainerCheckpointExportsLoadInTransformersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"torch", "safetensors", "transformers", "peft", "yaml"}));
  export_and_check(train_with_lora("hf-llama", json::object()), "llama", "1,5,12,3,14,7,11");
}

// Qwen2 (q/k/v biases) with untied embeddings, the same way.
TEST(HfClients, Qwen2TrainerCheckpointExportsLoadInTransformersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"torch", "safetensors", "transformers", "peft", "yaml"}));
  export_and_check(
      train_with_lora("hf-qwen2", {{"model_type", "qwen2"}, {"tie_word_embeddings", false}}),
      "qwen2", "2,9,13,4,14,6,10");
}

// Qwen3 (per-head q/k norms, head_dim 24 where hidden / heads is 16, one key/value head for 4
// query heads, untied), the same way: the supervised stage and GRPO through `shardrl train`.
TEST(HfClients, Qwen3TrainerCheckpointExportsLoadInTransformersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"torch", "safetensors", "transformers", "peft", "yaml"}));
  export_and_check(train_with_lora("hf-qwen3", {{"model_type", "qwen3"},
                                                {"head_dim", 24},
                                                {"num_key_value_heads", 1},
                                                {"tie_word_embeddings", false}}),
                   "qwen3", "3,8,13,2,14,9,10");
}

// Llama 3.x's RoPE scaling (a pretraining context of 16 puts the frequencies of head_dim 32 in
// all three of its bands), the same way.
TEST(HfClients, Llama3RopeTrainerCheckpointExportsLoadInTransformersAndPeft) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"torch", "safetensors", "transformers", "peft", "yaml"}));
  const json rope = {{"rope_type", "llama3"},   {"rope_theta", 500000.0},
                     {"factor", 8.0},           {"low_freq_factor", 1.0},
                     {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}};
  export_and_check(train_with_lora("hf-llama3", {{"rope_parameters", rope}, {"head_dim", 32}}),
                   "llama", "4,7,12,1,14,5,11");
}

// transformers' save_pretrained of random Llama / Qwen2 / Qwen3 / Llama 3.x models, and PEFT's
// save_pretrained of an adapter on each, read by `shardrl generate`.
TEST(HfClients, ShardrlLoadsTransformersSavePretrained) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"torch", "safetensors", "transformers", "peft", "yaml"}));
  expect_checks_pass(run_process({SHARDRL_PYTHON, hf_clients_script(), "pretrained", bin("shardrl"),
                                  make_temp_dir("hf-pretrained")},
                                 {{"HF_HUB_OFFLINE", "1"}}, 600),
                     40);
}

}  // namespace
}  // namespace shardrl::testing
