// The memory plan (include/shardrl/memory_plan.h): its units are the sharded model's, its formula
// counts each tier, `shardrl train` refuses a job that cannot fit before any rank starts, naming
// the settings that would make it fit, and its peak holds to the one measured at 2 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "model_test_util.h"
#include "shardrl/engine.h"
#include "shardrl/memory_plan.h"
#include "shardrl/models/flow_model.h"
#include "test_util.h"
#include "trainer/tasks.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TEST(MemoryPlan, UnitsAreTheShardedModelsUnits) {
  const json llama = {
      {"model_type", "qwen2"},       {"vocab_size", 320},      {"hidden_size", 64},
      {"intermediate_size", 160},    {"num_hidden_layers", 3}, {"num_attention_heads", 4},
      {"num_key_value_heads", 2},    {"attention_bias", true}, {"max_position_embeddings", 64},
      {"tie_word_embeddings", false}};
  std::vector<json> models = {
      {{"family", "llama"}, {"config", llama}},
      {{"family", "llama"}, {"config", llama}, {"lora_rank", 4}},
      {{"family", "gpt"},
       {"config",
        {{"vocab_size", 97},
         {"max_seq_len", 16},
         {"d_model", 32},
         {"n_heads", 4},
         {"n_layers", 2}}},
       {"lora_rank", 2}},
  };
  json tied = llama;
  tied["tie_word_embeddings"] = true;
  models.push_back({{"family", "llama"}, {"config", tied}});
  for (const auto& model : models) {
    engine::EngineConfig config;
    config.model = model;
    const auto planned = engine::EngineRegistry::model_size(config);
    auto engine = engine::EngineRegistry::create(config, dist::World::init_from_env());
    EXPECT_EQ(sorted_units(planned), sharded_units(*engine)) << model.dump();
    EXPECT_GT(planned.blocks, 0);
  }
  engine::EngineConfig sd3;
  sd3.model_type = "diffusion_model";
  sd3.model = {{"config",
                {{"sample_size", 8},
                 {"patch_size", 2},
                 {"in_channels", 4},
                 {"out_channels", 4},
                 {"num_layers", 2},
                 {"attention_head_dim", 8},
                 {"num_attention_heads", 2},
                 {"joint_attention_dim", 16},
                 {"caption_projection_dim", 16},
                 {"pooled_projection_dim", 12},
                 {"pos_embed_max_size", 8},
                 {"dual_attention_layers", {0}},
                 {"qk_norm", "rms_norm"}}},
               {"lora_rank", 2}};
  const auto planned = engine::EngineRegistry::model_size(sd3);
  auto engine = engine::EngineRegistry::create(sd3, dist::World::init_from_env());
  EXPECT_EQ(sorted_units(planned), sharded_units(*engine));
  EXPECT_EQ(planned.buffer_bytes, 8 * 8 * 16 * 4);  // the fixed position table
}

// The diffusion trainer's plan (diffusion_rl_plan, what `shardrl plan` prints) of a Qwen-Image
// job: for the example config, the units it sizes are those FSDP builds from the same engine
// config (LoRA on verl-omni's 12 projections); for Qwen/Qwen-Image's published config, found as
// verl-omni finds it (model.path's model_index.json names QwenImagePipeline) and read without its
// weights, the params are the published count, plus rank 64 adapters on 60 blocks.
TEST(MemoryPlan, QwenImageThroughTheDiffusionTrainersPlan) {
  const std::string example =
      SHARDRL_SOURCE_DIR "/examples/configs/fmnist_qwen_image_flow_grpo.yaml";
  const std::string published = SHARDRL_SOURCE_DIR "/bench/realsize/qwen-image-config";
  engine::Layout one_rank;
  auto plan = [&](const std::string& file, const std::vector<std::string>& overrides) {
    const auto config = trainer::task_config(file, overrides, trainer::ConfigChecks::kValues);
    return trainer::diffusion_rl_plan(config, one_rank);
  };
  const auto small = plan(example, {"actor_rollout_ref.actor.fsdp_config.param_offload=false",
                                    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"});
  EXPECT_TRUE(models::is_qwen_image_config(small.engine.model.at("config")))
      << small.engine.model.dump();
  const auto planned = engine::EngineRegistry::model_size(small.engine);
  auto engine = engine::EngineRegistry::create(small.engine, dist::World::init_from_env());
  EXPECT_EQ(sorted_units(planned), sharded_units(*engine));
  EXPECT_EQ(engine->export_info().at("lora").at("default").at("target_modules").size(), 12u);

  auto total_params = [](const engine::ModelSize& size) {
    int64_t n = 0;
    for (const auto& unit : size.units) n += unit.params;
    return n;
  };
  for (const auto& [lora_rank, expected] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 20430401088}, {64, 20855074368}}) {
    const auto real = plan(SHARDRL_SOURCE_DIR "/bench/realsize/qwen_image_lora_flow_grpo.yaml",
                           {"actor_rollout_ref.model.path=" + published,
                            fmt::format("actor_rollout_ref.model.lora_rank={}", lora_rank)});
    EXPECT_EQ(total_params(engine::EngineRegistry::model_size(real.engine)), expected)
        << "lora_rank " << lora_rank;
  }
}

// A model of 4 units: the root (100 params), three blocks of 300, LoRA-free.
engine::ModelSize four_units() {
  engine::ModelSize size;
  size.units = {{"root", 100, 100}, {"b0", 300, 300}, {"b1", 300, 300}, {"b2", 300, 300}};
  size.blocks = 3;
  size.block_activation_bytes_per_token = 1000;
  size.block_input_bytes_per_token = 10;
  size.vocab_size = 50;
  return size;
}

int64_t line(const std::vector<engine::PlanLine>& lines, const std::string& what,
             const std::string& tier) {
  for (const auto& l : lines) {
    if (l.what.rfind(what, 0) == 0) {
      EXPECT_EQ(l.tier, tier) << what;
      return l.bytes;
    }
  }
  ADD_FAILURE() << "no plan line " << what;
  return -1;
}

TEST(MemoryPlan, FormulaCountsEachStateInItsTier) {
  engine::EngineConfig config;
  config.fsdp.host_shared_params = false;
  config.fsdp.prefetch = 1;
  engine::Workload work;
  work.micro_batch_rows = 2;
  work.tokens_per_row = 5;
  work.logits = true;
  engine::Layout layout;
  layout.ranks_per_node = 2;
  const auto size = four_units();
  auto plan = engine::plan_memory(config, size, work, layout);
  EXPECT_EQ(plan.shard_size, 2);
  EXPECT_EQ(line(plan.update, "params", "compute"), 1000 * 4 / 2);
  EXPECT_EQ(line(plan.update, "grads", "compute"), 1000 * 4 / 2);
  EXPECT_EQ(line(plan.update, "optimizer", "compute"), 1000 * 8 / 2);
  // The root and the unit computing with the one prefetched: 100 + 2 x 300 params, fp32.
  EXPECT_EQ(line(plan.update, "gathered params", "compute"), (100 + 2 * 300) * 4);
  EXPECT_EQ(line(plan.update, "activations", "compute"), 10 * 3 * 1000);
  EXPECT_EQ(line(plan.update, "logits", "compute"), 10 * 50 * 4 * 3);
  EXPECT_TRUE(plan.rollout.empty());
  EXPECT_EQ(plan.peak_per_rank, plan.update_peak);
  EXPECT_EQ(plan.per_host, 2 * plan.peak_per_rank);

  work.gradient_checkpointing = true;  // the blocks' inputs, one block recomputed
  EXPECT_EQ(line(engine::plan_memory(config, size, work, layout).update, "activations", "compute"),
            10 * (3 * 10 + 1000));
  work.gradient_checkpointing = false;

  // use_prefix_grouper: 6 rows in micro-batches of 2, each group's 3 prompt tokens packed once.
  // Groups of 2 fill each micro-batch alone (2 x 5 - 3 tokens); groups of 3 put rows of two
  // groups in the middle micro-batch, which shares nothing.
  work.update_rows = 6;
  work.shared_prompt_tokens = 3;
  work.rows_per_prompt = 2;
  EXPECT_EQ(line(engine::plan_memory(config, size, work, layout).update, "activations", "compute"),
            7 * 3 * 1000);
  work.rows_per_prompt = 3;
  EXPECT_EQ(line(engine::plan_memory(config, size, work, layout).update, "activations", "compute"),
            10 * 3 * 1000);
  work.shared_prompt_tokens = 0;

  // FSDP2's offload policy in the file tier: the state leaves compute memory, one unit's
  // comes back for its step, and the host's disk holds it.
  config.offload_policy = config.offload.param_offload = config.offload.optimizer_offload = true;
  auto offloaded = engine::plan_memory(config, size, work, layout);
  EXPECT_EQ(line(offloaded.update, "params", "file"), 2000);
  EXPECT_EQ(line(offloaded.update, "grads", "file"), 2000);
  EXPECT_EQ(line(offloaded.update, "optimizer", "file"), 4000);
  EXPECT_EQ(line(offloaded.update, "offloaded state of one unit", "compute"), 300 * 16 / 2);
  EXPECT_EQ(offloaded.file_per_host, 2 * 8000);
  EXPECT_EQ(offloaded.peak_per_rank, plan.peak_per_rank - 8000 + 300 * 16 / 2);

  // The host-shared image: one copy a host, in every rank's resident set.
  config = engine::EngineConfig();
  auto shared = engine::plan_memory(config, size, work, layout);
  EXPECT_EQ(shared.host_shared, 1000 * 4);
  EXPECT_EQ(shared.per_host, 2 * (shared.peak_per_rank - 4000) + 4000);

  // A replica rollout adds an fp32 copy a rank for both phases; the actor gathered adds the
  // model in the rollout phase only.
  config.fsdp.host_shared_params = false;
  work.rollout = engine::Workload::Rollout::kReplica;
  work.rollout_rows = 4;
  work.rollout_tokens = 6;
  auto replica = engine::plan_memory(config, size, work, layout);
  EXPECT_EQ(line(replica.update, "rollout replica", "compute"), 4000);
  EXPECT_EQ(line(replica.rollout, "rollout replica", "compute"), 4000);
  work.rollout = engine::Workload::Rollout::kActorGathered;
  auto hf = engine::plan_memory(config, size, work, layout);
  EXPECT_EQ(line(hf.rollout, "actor gathered", "compute"), 4000);
  EXPECT_LT(hf.update_peak, replica.update_peak);
}

std::string write_config(const std::string& dir, const std::string& text) {
  fs::create_directories(dir);
  const std::string path = dir + "/config.yaml";
  std::ofstream(path) << text;
  return path;
}

// A 2.5B-param decoder, fully fine-tuned: 16 bytes a param of state on 2 ranks, more than a host
// of this kind has, but small once offloaded to the file tier. `shardrl train` refuses it before
// any rank starts (no rank's output, no OOM), naming the settings that would make it fit.
TEST(MemoryPlanTrain, RefusesAJobThatCannotFitNamingTheSettings) {
  const auto dir = make_temp_dir("plan_refusal");
  const auto path = write_config(dir, R"(trainer:
  task: lm_pretrain
  n_gpus_per_node: 2
  total_training_steps: 2
data:
  train_batch_size: 4
  max_seq_len: 32
actor_rollout_ref:
  model:
    family: gpt
    config: {vocab_size: 256, max_seq_len: 32, d_model: 2560, n_heads: 20, n_layers: 32}
)");
  const auto r = run_process(
      {bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/run"}, {}, 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the memory plan does not fit"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("actor_rollout_ref.actor.fsdp_config.param_offload=true"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("[rank 0]"), std::string::npos) << "a rank started:\n" << r.output;
  EXPECT_FALSE(fs::exists(dir + "/run/metrics.jsonl"));

  // The same job with the named settings: `shardrl plan` says it fits (exit 0).
  const auto fits = run_process(
      {bin("shardrl"), "plan", path, "actor_rollout_ref.actor.fsdp_config.param_offload=true",
       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
       "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
       "actor_rollout_ref.actor.fsdp_config.host_shared_params=false"},
      {}, 60);
  EXPECT_EQ(fits.exit_code, 0) << fits.output;
  EXPECT_NE(fits.output.find("fits:"), std::string::npos) << fits.output;
}

// `shardrl plan` sizes a cluster job: verl's nnodes x n_gpus_per_node, on a GPU, against a GPU's
// memory; nproc_per_node (the older key) still sets the ranks a node runs.
TEST(MemoryPlanTrain, PlanSizesAnyWorldAndDevice) {
  const auto dir = make_temp_dir("plan_world");
  // The small job's config with verl's key for the ranks a node runs.
  std::string text = kSmallLmConfig;
  text.replace(text.find("nproc_per_node"), 14, "n_gpus_per_node");
  const auto path = write_config(dir, text);
  auto plan_json = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {bin("shardrl"), "plan", path, "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = run_process(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return json::parse(r.output.substr(r.output.find('{')));
  };
  const auto two = plan_json({});
  EXPECT_EQ(two["ranks_per_node"], 2);
  const auto cluster = plan_json(
      {"trainer.nnodes=4", "trainer.n_gpus_per_node=8", "--device", "cuda", "--memory-gb", "80"});
  EXPECT_EQ(cluster["nnodes"], 4);
  EXPECT_EQ(cluster["ranks_per_node"], 8);
  EXPECT_EQ(cluster["shard_size"], 32);
  EXPECT_EQ(cluster["device"], "cuda");
  // 32 ranks shard what 2 did: the params line shrinks 16x.
  EXPECT_EQ(cluster["update"][0]["bytes"].get<int64_t>(),
            (two["update"][0]["bytes"].get<int64_t>() * 2 + 31) / 32);
  // The older key alone still sets it (kSmallLmConfig has nproc_per_node: 2); set apart, the two
  // must agree.
  const auto older =
      run_process({bin("shardrl"), "plan", write_config(dir + "/older", kSmallLmConfig), "--json",
                   "trainer.nproc_per_node=3"},
                  {}, 60);
  EXPECT_EQ(older.exit_code, 0) << older.output;
  EXPECT_EQ(json::parse(older.output.substr(older.output.find('{')))["ranks_per_node"], 3);
  const auto clash =
      run_process({bin("shardrl"), "plan", path, "trainer.nproc_per_node=4"}, {}, 60);
  EXPECT_NE(clash.exit_code, 0);
  EXPECT_NE(clash.output.find("'trainer.n_gpus_per_node' (2) and 'trainer.nproc_per_node' (4)"),
            std::string::npos)
      << clash.output;
}

// The plan against the peak resident set `shardrl train` measures (memory_peak_rss_gb, the
// largest VmHWM of any rank) at 2 ranks, for an lm_pretrain job of `steps` steps on the GPT
// `model` (its config), `actor` configuring the rest.
void expect_peak_holds_to_the_plan(const std::string& tag, const std::string& model, int steps,
                                   const std::string& actor) {
  const auto dir = make_temp_dir(tag);
  const auto path = write_config(dir, fmt::format(R"(trainer:
  task: lm_pretrain
  nproc_per_node: 2
  total_training_steps: {}
  save_freq: -1
data:
  train_batch_size: 8
  max_seq_len: 64
actor_rollout_ref:
  model:
    family: gpt
    config: {}
  actor:
    ppo_micro_batch_size_per_gpu: 4
{})",
                                                  steps, model, actor));
  const auto plan = run_process({bin("shardrl"), "plan", path, "--json"}, {}, 60);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto planned = json::parse(plan.output.substr(plan.output.find('{')));
  const auto r = run_process(
      {bin("shardrl"), "train", path, "trainer.default_local_dir=" + dir + "/run"}, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  double measured = 0;
  for (const auto& m : read_jsonl(dir + "/run/metrics.jsonl")) {
    measured = std::max(measured, m.at("memory_peak_rss_gb").get<double>());
  }
  const double expected = planned["peak_per_rank_bytes"].get<double>() / 1e9;
  // The issue's tolerance at real size is 15% + 1 GiB; at this size the fixed part is smaller.
  EXPECT_NEAR(measured, expected, 0.15 * expected + 0.15)
      << "plan " << expected << " GB, measured " << measured << " GB\n"
      << plan.output;
}

// A decoder big enough that its state, image and activations, not the process alone, make the
// peak.
TEST(MemoryPlanTrain, PeakHoldsToTheMeasuredPeakAtTwoRanks) {
  expect_peak_holds_to_the_plan(
      "plan_peak", "{vocab_size: 256, max_seq_len: 64, d_model: 768, n_heads: 12, n_layers: 8}", 3,
      "");
}

// Its state in files (FSDP2's offload policy, the file tier): a unit's state is in memory only
// while it is used, so the peak stays near the gathered units and one unit's state, step after
// step (plan 1.50 GB, measured 1.25). The embeddings (a 32768-id vocabulary) make the root unit
// 3.5x a block, as a real decoder's are: glibc's kept heap, whose holes the next unit's state did
// not fit, once piled the state up in the resident set (2.18 GB by step 4 here; Qwen3-1.7B's
// 27.5 GB met the OOM killer in step 2).
TEST(MemoryPlanTrain, PeakWithTheStateInFilesHoldsToThePlan) {
  expect_peak_holds_to_the_plan(
      "plan_peak_offload",
      "{vocab_size: 32768, max_seq_len: 64, d_model: 768, n_heads: 12, n_layers: 16}", 4,
      R"(    fsdp_config:
      param_offload: true
      optimizer_offload: true
      offload_policy: true
      offload_tier: file
      host_shared_params: false
)");
}

}  // namespace
}  // namespace shardrl::testing
