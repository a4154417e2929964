// The Engine: verl's engine interface over FSDP, on real ranks.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "model_test_util.h"
#include "shardrl/engine.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/transformer.h"
#include "shardrl/models/weights.h"
#include "test_util.h"
#include "workers/llama_scenario.h"
#include "workers/param_files.h"

namespace shardrl::testing {
namespace {

std::vector<std::string> metric_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// What each FSDP unit's reduce-scatter carries per rank, in elements, worked out from the model's
// param shapes alone (as engine_worker --trace writes them), not from FSDP's layout code. Unit 0 is
// the root; `unit_prefixes` names the params of every other unit in module order (the trace's
// unit k + 1 holds the params under unit_prefixes[k]), and the root holds the rest. A trainable
// param's grad is split by rows, ceil(rows / world) per rank (the last rank's part padded), and
// each rank's part carries one "had a grad" flag per trainable param after the grads. A unit
// without trainable params (a frozen base under LoRA) reduces nothing and is absent.
std::map<int, int64_t> reduce_scatter_widths(const nlohmann::json& params,
                                             const std::vector<std::string>& unit_prefixes,
                                             int world) {
  std::map<int, int64_t> widths;
  for (const auto& p : params) {
    if (!p["requires_grad"].get<bool>()) continue;
    const std::string name = p["name"];
    int unit = 0;
    for (size_t k = 0; k < unit_prefixes.size(); ++k) {
      if (name.rfind(unit_prefixes[k], 0) == 0) unit = static_cast<int>(k) + 1;
    }
    const auto shape = p["shape"].get<std::vector<int64_t>>();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    widths[unit] += (rows + world - 1) / world * row_numel + 1;
  }
  return widths;
}

// The gradient sync of every step in one rank's trace (engine_worker --trace): the step ran
// `micro_batches` forwards of the root, and each unit with trainable params issued exactly one
// fp32 reduce-scatter, after the last micro-batch's forward ended (during its backward or after
// it), of (world - 1) / world of its input, as the process group counts what this rank sends:
// world parts of `widths[unit]` elements, one kept. Units without trainable params issue none.
// Returns each step's reduce-scatter bytes.
std::vector<uint64_t> expect_one_reduce_scatter_per_unit(const nlohmann::json& steps,
                                                         const std::map<int, int64_t>& widths,
                                                         int units, int world,
                                                         int64_t micro_batches) {
  std::vector<uint64_t> bytes_per_step;
  for (size_t step = 0; step < steps.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto& events = steps[step];
    int64_t root_forwards = 0;
    size_t last_forward_end = 0;
    std::map<int, int> reduces;
    uint64_t step_bytes = 0;
    for (size_t i = 0; i < events.size(); ++i) {
      const auto& e = events[i];
      const std::string event = e["event"];
      const int unit = e["unit"];
      EXPECT_GE(unit, 0) << e.dump();
      EXPECT_LT(unit, units) << e.dump();
      if (unit == 0 && event == "forward_begin") ++root_forwards;
      if (unit == 0 && event == "forward_end") last_forward_end = i;
    }
    EXPECT_EQ(root_forwards, micro_batches);
    for (size_t i = 0; i < events.size(); ++i) {
      const auto& e = events[i];
      if (e["event"] != "reduce_scatter_issued") continue;
      const int unit = e["unit"];
      ++reduces[unit];
      EXPECT_GT(i, last_forward_end)
          << "unit " << unit << " reduced before the last micro-batch's backward";
      EXPECT_EQ(e["dtype"], "Float") << e.dump();
      const int64_t width = widths.count(unit) ? widths.at(unit) : 0;
      EXPECT_EQ(e["bytes"].get<uint64_t>(), static_cast<uint64_t>((world - 1) * width * 4))
          << "unit " << unit;
      step_bytes += e["bytes"].get<uint64_t>();
    }
    for (int unit = 0; unit < units; ++unit) {
      EXPECT_EQ(reduces[unit], widths.count(unit) ? 1 : 0) << "reduce-scatters of unit " << unit;
    }
    bytes_per_step.push_back(step_bytes);
  }
  return bytes_per_step;
}

// One engine_worker run at 2 ranks with --trace: every rank's steps have one reduce-scatter per
// unit with trainable params, of the bytes the shapes give. With LoRA only the units whose prefix
// starts with `lora_units` (the blocks, which hold every adapter) reduce. Returns rank 0's bytes
// per step.
std::vector<uint64_t> expect_engine_syncs_once_per_step(
    const std::vector<std::string>& args, const std::vector<std::string>& unit_prefixes,
    const std::string& lora_units, int64_t steps, int64_t micro_batches, bool lora) {
  constexpr int kWorld = 2;
  const auto dir = make_temp_dir("engine_sync");
  std::vector<std::string> worker_args = {"--out", dir, "--trace", "--steps",
                                          std::to_string(steps)};
  worker_args.insert(worker_args.end(), args.begin(), args.end());
  auto result = launch_workers(kWorld, worker_args, 300, "engine_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  if (result.exit_code != 0) return {};
  const auto params = nlohmann::json::parse(std::ifstream(dir + "/params.json"));
  const int units = static_cast<int>(unit_prefixes.size()) + 1;
  const auto widths = reduce_scatter_widths(params, unit_prefixes, kWorld);
  std::set<int> reducing;
  for (int unit = 0; unit < units; ++unit) {
    if (!lora || (unit > 0 && unit_prefixes[unit - 1].rfind(lora_units, 0) == 0)) {
      reducing.insert(unit);
    }
  }
  std::set<int> widths_units;
  for (const auto& [unit, width] : widths) widths_units.insert(unit);
  EXPECT_EQ(widths_units, reducing);
  std::vector<uint64_t> rank0;
  for (int rank = 0; rank < kWorld; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const auto steps_traced =
        nlohmann::json::parse(std::ifstream(dir + "/trace." + std::to_string(rank) + ".json"));
    EXPECT_EQ(steps_traced.size(), static_cast<size_t>(steps));
    auto bytes =
        expect_one_reduce_scatter_per_unit(steps_traced, widths, units, kWorld, micro_batches);
    if (rank == 0) rank0 = bytes;
  }
  return rank0;
}

// The engine's gradient accumulation (no_sync on every micro-batch but the last) reduces each
// unit's grads once per optimizer step: 3 micro-batches per rank move as many reduce-scatter
// bytes as one. With LoRA only the adapters' grads travel.
TEST(Engine, GradientSyncIsOneReduceScatterPerUnitPerStep) {
  // The GPT's units but the root, in module order: the token embedding, 2 blocks, the head.
  const std::vector<std::string> units = {"tok_emb.", "blocks.0.", "blocks.1.", "head."};
  for (const bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA" : "full fine-tuning");
    std::map<int64_t, std::vector<uint64_t>> bytes;
    // 12 samples, 6 per rank: micro-batches of 2 (3 per rank) and of 6 (1 per rank).
    for (const int64_t micro_batches : {3, 1}) {
      SCOPED_TRACE(std::to_string(micro_batches) + " micro-batches");
      std::vector<std::string> args = {"--batch", "12", "--micro-batch",
                                       std::to_string(6 / micro_batches)};
      if (lora) args.push_back("--lora");
      bytes[micro_batches] =
          expect_engine_syncs_once_per_step(args, units, "blocks.", 2, micro_batches, lora);
    }
    EXPECT_EQ(bytes[3], bytes[1]);
    ASSERT_EQ(bytes[3].size(), 2u);
    EXPECT_GT(bytes[3][0], 0u);
  }
}

// verl-omni's three diffusion engines (Flow-GRPO, DiffusionNFT, Diffusion-DPO: the registered
// loss of each model_type) update through the Engine on an SD3 transformer: 3 micro-batches of
// a rank's rows reduce each unit's trainable params once per optimizer step, as many bytes as one
// micro-batch of them does. With LoRA only the adapters travel (NFT's frozen "old" copy does not);
// with full fine-tuning every param.
TEST(Engine, DiffusionUpdatesReduceEachUnitOncePerStep) {
  const std::vector<std::string> units = {"transformer_blocks.0.", "transformer_blocks.1."};
  // engine_worker's rows per rank: 12 for Flow-GRPO, 18 for NFT, 3 DPO pairs.
  const std::vector<std::pair<std::string, int64_t>> types = {
      {"diffusion_model", 4}, {"diffusion_nft_model", 6}, {"diffusion_dpo_model", 1}};
  for (const auto& [model_type, micro_batch] : types) {
    for (const int64_t lora_rank : {4, 0}) {
      SCOPED_TRACE(model_type + ", lora_rank " + std::to_string(lora_rank));
      std::map<int64_t, std::vector<uint64_t>> bytes;
      for (const int64_t micro_batches : {3, 1}) {
        SCOPED_TRACE(std::to_string(micro_batches) + " micro-batches");
        const std::vector<std::string> args = {
            "--mode",        "diffusion",
            "--model-type",  model_type,
            "--lora-rank",   std::to_string(lora_rank),
            "--micro-batch", micro_batches == 1 ? "0" : std::to_string(micro_batch)};
        bytes[micro_batches] = expect_engine_syncs_once_per_step(args, units, "transformer_blocks.",
                                                                 micro_batches == 1 ? 1 : 2,
                                                                 micro_batches, lora_rank > 0);
      }
      ASSERT_EQ(bytes[3].size(), 2u);
      ASSERT_EQ(bytes[1].size(), 1u);
      EXPECT_GT(bytes[1][0], 0u);
      EXPECT_EQ(bytes[3][0], bytes[1][0]);
      EXPECT_EQ(bytes[3][1], bytes[1][0]);
    }
  }
}

TEST(EngineBatch, SplitsIntoNearlyEqualMicroBatchesAndNamesBadTensors) {
  engine::Batch batch{{"x", torch::arange(7)}, {"y", torch::arange(14).reshape({7, 2})}};
  auto parts = engine::split_batch(batch, 3);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].at("x").size(0), 3);
  EXPECT_EQ(parts[2].at("y").size(0), 2);
  EXPECT_TRUE(torch::equal(engine::concat_batches(parts).at("y"), batch.at("y")));
  batch["z"] = torch::zeros({6});
  try {
    engine::batch_size(batch);
    FAIL() << "mismatched sample counts were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'z'"), std::string::npos) << e.what();
  }
}

TEST(EngineRegistry, UnknownModelTypeNamesTheKeyAndTheRegisteredOnes) {
  engine::EngineConfig config;
  config.model_type = "video_model";
  try {
    engine::EngineRegistry::create(config, dist::World::init_from_env());
    FAIL() << "an unknown model type was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("video_model/fsdp"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("diffusion_model/fsdp"), std::string::npos) << e.what();
  }
}

TEST(Transformer, ActivationCheckpointingKeepsLossAndGradients) {
  models::TransformerConfig c;
  torch::manual_seed(5);
  models::Transformer plain(c);
  torch::manual_seed(5);
  models::Transformer recomputed(c);
  recomputed->set_activation_checkpointing(true);
  expect_checkpointing_changes_nothing(plain, recomputed,
                                       torch::randint(c.vocab_size, {3, 12}, torch::kLong));
}

// verl's actor_rollout_ref.model.enable_gradient_checkpointing reaches every block of both
// language model families (the GPT's once went unread).
TEST(EngineRegistry, LanguageModelsTakeEnableGradientCheckpointing) {
  for (const bool enabled : {true, false}) {
    engine::EngineConfig gpt;
    gpt.model = {{"family", "gpt"},
                 {"config",
                  {{"vocab_size", 97},
                   {"max_seq_len", 16},
                   {"d_model", 32},
                   {"n_heads", 4},
                   {"n_layers", 2}}},
                 {"enable_gradient_checkpointing", enabled}};
    auto engine = engine::EngineRegistry::create(gpt, dist::World::init_from_env());
    auto& blocks = engine->model<models::Transformer>()->blocks();
    ASSERT_EQ(blocks.size(), 2u);
    for (auto& block : blocks) EXPECT_EQ(block->checkpoint_activations, enabled);

    engine::EngineConfig llama;
    llama.model = {{"family", "llama"},
                   {"config", llama_test_config().to_json()},
                   {"enable_gradient_checkpointing", enabled}};
    engine = engine::EngineRegistry::create(llama, dist::World::init_from_env());
    auto& layers = engine->model<models::LlamaForCausalLM>()->model->layers;
    ASSERT_EQ(layers.size(), 2u);
    for (auto& layer : layers) EXPECT_EQ(layer->checkpoint_activations, enabled);
  }
}

// Two ranks with half the global batch each, in fewer micro-batches, take the same steps as one
// rank with all of it: micro-batch losses are divided by their count and FSDP averages ranks.
TEST(Engine, TrainBatchAtTwoRanksEqualsOneRank) {
  std::map<int, std::map<std::string, torch::Tensor>> params;
  std::map<int, std::vector<std::string>> metrics;
  for (int n : {1, 2}) {
    const auto dir = make_temp_dir("engine_n" + std::to_string(n));
    auto result = launch_workers(n, {"--out", dir, "--steps", "3"}, 300, "engine_worker");
    ASSERT_EQ(result.exit_code, 0) << result.output;
    params[n] = read_params(dir + "/final");
    metrics[n] = metric_lines(dir + "/metrics.0.txt");
  }
  ASSERT_EQ(params[1].size(), params[2].size());
  for (const auto& [name, tensor] : params[1]) {
    EXPECT_LT(relative_error(params[2].at(name), tensor), 1e-5) << name;
  }
  ASSERT_EQ(metrics[1].size(), 3u);
  ASSERT_EQ(metrics[2].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    std::istringstream a(metrics[1][i]), b(metrics[2][i]);
    double loss1, norm1, lr1, loss2, norm2, lr2;
    a >> loss1 >> norm1 >> lr1;
    b >> loss2 >> norm2 >> lr2;
    EXPECT_NEAR(loss1, loss2, 1e-5 * loss1) << "step " << i;
    EXPECT_NEAR(norm1, norm2, 1e-4 * norm1) << "step " << i;
    EXPECT_DOUBLE_EQ(lr1, lr2) << "step " << i;
  }
}

// LoRA+ (optim.loraplus_lr_ratio): a GroupedOptimizer of two AdamWs, the adapters' B matrices
// at lr * ratio. The first step's lr is 0 (warmup), so at step 2 both runs below take the same
// gradients from the same weights, and each B moves exactly `ratio` times as far as under one
// AdamW at lr while A moves the same: the reference is the plain AdamW path, not the grouping.
// Offload between phases changes nothing. Saved after step 2 and resumed, at 2 ranks and at 1,
// the run equals the uninterrupted one; the checkpoint holds both parts' state.
TEST(Engine, LoraPlusGroupedOptimizerStepsBFasterAndResumesAtAnyWorldSize) {
  const auto dir = make_temp_dir("engine_loraplus");
  const auto run = [&](int n, const std::string& name, std::vector<std::string> args) {
    args.insert(args.end(), {"--lora", "--out", dir + "/" + name});
    std::filesystem::create_directories(dir + "/" + name);
    auto result = launch_workers(n, args, 300, "engine_worker");
    EXPECT_EQ(result.exit_code, 0) << result.output;
    return read_params(dir + "/" + name + "/final");
  };
  const std::vector<std::string> plus = {"--loraplus-lr-ratio", "4"};
  const auto with = [&](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const auto initial = run(1, "initial", {"--steps", "0"});
  const auto plain = run(2, "plain", {"--steps", "2"});
  const auto first_part = run(2, "first_part", with(plus, {"--steps", "2", "--save-at", "2"}));
  ASSERT_FALSE(initial.empty());
  size_t b_matrices = 0;
  for (const auto& [name, before] : initial) {
    const auto plain_step = plain.at(name) - before, plus_step = first_part.at(name) - before;
    if (models::lora::is_lora_b_tensor(name)) {
      ++b_matrices;
      ASSERT_GT(plain_step.abs().max().item<float>(), 0) << name;
      EXPECT_LT(relative_error(plus_step, 4 * plain_step), 1e-5) << name;
    } else {
      EXPECT_TRUE(torch::equal(plus_step, plain_step)) << name;
    }
  }
  EXPECT_GT(b_matrices, 0u);
  // Offloaded between phases, both parts' state comes back in for the step.
  const auto offloaded = run(2, "offloaded", with(plus, {"--steps", "2", "--offload"}));
  for (const auto& [name, tensor] : first_part) {
    EXPECT_TRUE(torch::equal(offloaded.at(name), tensor)) << name;
  }

  const std::string checkpoint = dir + "/first_part/checkpoints/global_step_2";
  std::ifstream index_file(checkpoint + "/index.json");
  const auto state = nlohmann::json::parse(index_file).at("optimizer").at("state");
  size_t a_states = 0, b_states = 0;
  for (const auto& [name, entry] : state.items()) {
    EXPECT_TRUE(entry.contains("exp_avg") && entry.contains("exp_avg_sq")) << name;
    EXPECT_EQ(entry.value("step", int64_t{0}), 2) << name;
    (models::lora::is_lora_b_tensor(name) ? b_states : a_states)++;
  }
  EXPECT_EQ(b_states, b_matrices);
  EXPECT_EQ(a_states, b_matrices);

  const auto straight = run(2, "straight", with(plus, {"--steps", "4"}));
  const auto resumed = run(2, "resumed", with(plus, {"--steps", "4", "--resume", checkpoint}));
  const auto resumed_alone = run(1, "alone", with(plus, {"--steps", "4", "--resume", checkpoint}));
  const auto straight_metrics = metric_lines(dir + "/straight/metrics.0.txt");
  ASSERT_EQ(straight_metrics.size(), 4u);
  EXPECT_EQ(metric_lines(dir + "/resumed/metrics.0.txt"),
            std::vector<std::string>(straight_metrics.begin() + 2, straight_metrics.end()));
  for (const auto& [name, tensor] : straight) {
    EXPECT_TRUE(torch::equal(resumed.at(name), tensor)) << name;
    EXPECT_LT(relative_error(resumed_alone.at(name), tensor), 1e-5) << name;
  }
}

// param_offload + optimizer_offload: state waits in the file tier between steps and train_mode
// brings it in; the trained weights are bit for bit those of an engine that never offloads.
TEST(Engine, OffloadScopesLeaveTrainingResultsUnchanged) {
  std::map<bool, std::map<std::string, torch::Tensor>> params;
  for (bool offload : {false, true}) {
    const auto dir = make_temp_dir(offload ? "engine_offload" : "engine_resident");
    std::vector<std::string> args = {"--out", dir, "--steps", "3"};
    if (offload) args.push_back("--offload");
    auto result = launch_workers(2, args, 300, "engine_worker");
    ASSERT_EQ(result.exit_code, 0) << result.output;
    params[offload] = read_params(dir + "/final");
  }
  for (const auto& [name, tensor] : params[false]) {
    EXPECT_TRUE(torch::equal(params[true].at(name), tensor)) << name;
  }
}

TEST(Engine, ForwardOnlyLeavesTheWeightsUntouched) {
  const auto dir = make_temp_dir("engine_forward_only");
  auto result = launch_workers(2, {"--mode", "forward_only", "--out", dir}, 300, "engine_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto before = read_params(dir + "/before"), after = read_params(dir + "/after");
  ASSERT_FALSE(before.empty());
  for (const auto& [name, tensor] : before)
    EXPECT_TRUE(torch::equal(after.at(name), tensor)) << name;
}

// model.path for a language model: every rank builds the model empty (fsdp::EmptyInit), rank 0
// reads the file and sends each rank its rows; the LoRA adapters are created as usual and train.
TEST(Engine, PretrainedLanguageModelIsReadByRankZeroIntoAnEmptyBuild) {
  const auto dir = make_temp_dir("engine_pretrained");
  torch::manual_seed(7);
  models::Transformer source(models::TransformerConfig{97, 16, 32, 4, 2, 4});
  const auto weights = models::state_dict(*source);
  models::save_weights(weights, dir + "/model.safetensors", torch::kFloat);
  auto result =
      launch_workers(3, {"--mode", "pretrained", "--pretrained", dir, "--batch", "6", "--out", dir},
                     300, "engine_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto loaded = read_params(dir + "/loaded"), trained = read_params(dir + "/trained");
  int adapters = 0;
  for (const auto& [name, tensor] : loaded) {
    if (models::lora::is_adapter_tensor(name)) {
      ++adapters;
      // B starts at zero and A is drawn (kaiming uniform), so the model starts as the file; B is
      // what the first step with a non-zero lr moves (A's gradient is B^T times something).
      if (name.find("lora_B") != std::string::npos) {
        EXPECT_EQ(tensor.abs().max().item<float>(), 0) << name;
        EXPECT_FALSE(torch::equal(trained.at(name), tensor)) << name << " did not train";
      } else {
        EXPECT_GT(tensor.abs().max().item<float>(), 0) << name;
      }
    } else {
      EXPECT_TRUE(torch::equal(tensor, weights.at(name))) << name;
      EXPECT_TRUE(torch::equal(trained.at(name), tensor)) << name << " is frozen";
    }
  }
  EXPECT_EQ(adapters, 2 * 2 * 2);  // q_proj and v_proj of 2 blocks, A and B each
  EXPECT_EQ(loaded.size() - adapters, weights.size());

  // A file that lacks a tensor is an error naming the file and the tensor, on every rank.
  const auto partial = make_temp_dir("engine_pretrained_partial");
  auto missing = weights;
  missing.erase("head.weight");
  models::save_weights(missing, partial + "/model.safetensors", torch::kFloat);
  auto bad = launch_workers(2, {"--mode", "pretrained", "--pretrained", partial, "--out", partial},
                            300, "engine_worker");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("head.weight"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find(partial), std::string::npos) << bad.output;
}

// The weight sync a rollout engine loads from: every full tensor as training holds it, or with the
// LoRA adapter merged (W + 16/4 * B A, no adapter tensors), or in bf16 under a name prefix, or the
// trainable tensors alone (the adapters: what a replica holding the base needs each step); with
// the state offloaded between phases or by the training policy, the sync brings the params in
// and puts them back, and changes no bit.
TEST(Engine, WeightSyncStreamsFullMergedAndBf16TensorsAndKeepsTheState) {
  for (const std::string offload : {"", "--offload", "--offload-policy"}) {
    const auto dir = make_temp_dir("engine_sync" + offload);
    std::vector<std::string> args = {"--mode", "weight_sync", "--out", dir};
    if (!offload.empty()) args.push_back(offload);
    auto result = launch_workers(2, args, 300, "engine_worker");
    ASSERT_EQ(result.exit_code, 0) << result.output;
    const auto before = read_params(dir + "/before"), after = read_params(dir + "/after");
    const auto plain = read_params(dir + "/plain"), merged = read_params(dir + "/merged");
    const auto bf16 = read_params(dir + "/bf16"), trainable = read_params(dir + "/trainable");
    ASSERT_EQ(plain.size(), before.size());
    ASSERT_EQ(bf16.size(), before.size());
    int adapters = 0, merged_targets = 0;
    for (const auto& [name, tensor] : before) {
      EXPECT_TRUE(torch::equal(after.at(name), tensor)) << name;
      EXPECT_TRUE(torch::equal(plain.at(name), tensor)) << name;
      EXPECT_TRUE(
          torch::equal(bf16.at("model." + name), tensor.to(torch::kBFloat16).to(torch::kFloat)))
          << name;
      const auto lora_a = name.find(".lora_A.default.weight");
      if (lora_a != std::string::npos) {
        ++adapters;
        const std::string module = name.substr(0, lora_a);
        const auto& b = before.at(module + ".lora_B.default.weight");
        EXPECT_GT(b.abs().max().item<float>(), 0.0f) << "the step left B at zero: " << module;
        const auto expected = before.at(module + ".weight") + 4.0 * b.matmul(tensor);
        EXPECT_LT(relative_error(merged.at(module + ".weight"), expected), 1e-6) << module;
        ++merged_targets;
      }
      if (name.find(".lora_") != std::string::npos) {
        EXPECT_EQ(merged.count(name), 0u) << name;
        ASSERT_EQ(trainable.count(name), 1u) << name;
        EXPECT_TRUE(torch::equal(trainable.at(name), tensor)) << name;
      } else if (merged.count(name) && name.find("q_proj") == std::string::npos &&
                 name.find("v_proj") == std::string::npos) {
        EXPECT_TRUE(torch::equal(merged.at(name), tensor)) << name;
      }
    }
    EXPECT_EQ(adapters, 4);  // q_proj and v_proj of 2 layers
    EXPECT_EQ(merged_targets, 4);
    EXPECT_EQ(merged.size(), before.size() - 2 * 4);
    EXPECT_EQ(trainable.size(), 2u * 4);
  }
}

// Rank 0 holds 4 samples (2 micro-batches of 2), rank 1 holds 2 (1 micro-batch): run as is,
// rank 0's second backward would wait forever for rank 1. The engine splits rank 1 finer.
TEST(Engine, EveryRankRunsTheSameNumberOfMicroBatches) {
  const auto dir = make_temp_dir("engine_uneven");
  auto result = launch_workers(
      2, {"--out", dir, "--steps", "2", "--batch", "6", "--micro-batch", "2", "--uneven"}, 120,
      "engine_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(metric_lines(dir + "/metrics.0.txt").size(), 2u);
  EXPECT_EQ(metric_lines(dir + "/metrics.1.txt").size(), 2u);
}

}  // namespace
}  // namespace shardrl::testing
