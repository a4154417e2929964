// verl's critic: the value model (engine model_type value_model) made from the actor's causal LM
// folder as transformers' save_pretrained wrote it, its values equal to transformers'
// AutoModelForTokenClassification (num_labels 1) reading ShardRL's export of its checkpoint
// (tests/python/value_model_reference.py), and its new head initialized as transformers does.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "expect_error.h"
#include "model_test_util.h"
#include "shardrl/engine.h"
#include "shardrl/models/llama.h"
#include "shardrl/rollout/sampling.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;

engine::EngineConfig value_config(const std::string& path) {
  engine::EngineConfig config;
  config.model_type = "value_model";
  config.model = {{"path", path}};
  return config;
}

std::unique_ptr<engine::Engine> value_engine(const std::string& path) {
  return engine::EngineRegistry::create(value_config(path), dist::World::init_from_env());
}

torch::Tensor values_of(engine::Engine& engine, const torch::Tensor& tokens,
                        const torch::Tensor& mask) {
  torch::NoGradGuard no_grad;
  return engine.model<models::LlamaForTokenClassification>()(tokens, mask);
}

std::string csv(const torch::Tensor& t) {
  std::string out;
  const auto flat = t.flatten().to(torch::kLong).contiguous();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    out += (i ? "," : "") + std::to_string(flat.data_ptr<int64_t>()[i]);
  }
  return out;
}

class ValueModel : public ::testing::TestWithParam<std::string> {};

TEST_P(ValueModel, MadeFromTheActorsFolderExportsAsTransformersTokenClassification) {
  const auto dir = make_temp_dir("value-model-" + GetParam());
  const auto actor = dir + "/actor";
  auto made = run_python_reference("value_model_reference.py", {"actor", actor, GetParam()});
  ASSERT_EQ(made.exit_code, 0) << made.output;

  auto engine = value_engine(actor);
  // The memory plan sizes the model FSDP built, unit by unit.
  EXPECT_EQ(sorted_units(engine::EngineRegistry::model_size(value_config(actor))),
            sharded_units(*engine));
  // transformers' init of the new head: N(0, initializer_range 0.02), bias 0; every rank (and
  // every build) draws the same.
  const auto params = engine->fsdp().full_parameters();
  const auto& weight = params.at("score.weight");
  EXPECT_EQ(weight.sizes(), torch::IntArrayRef({1, 64}));
  EXPECT_NEAR(weight.std().item<double>(), 0.02, 0.006);
  EXPECT_EQ(params.at("score.bias").abs().max().item<double>(), 0.0);
  EXPECT_TRUE(
      torch::equal(value_engine(actor)->fsdp().full_parameters().at("score.weight"), weight));
  // The decoder is the actor's; its lm_head is not read.
  for (const auto& [name, tensor] : read_safetensors(actor + "/model.safetensors")) {
    if (name == "lm_head.weight") continue;
    ASSERT_TRUE(params.count(name)) << name;
    EXPECT_TRUE(torch::equal(params.at(name), tensor)) << name;
  }
  EXPECT_EQ(params.count("lm_head.weight"), 0u);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto tokens = torch::randint(96, {2, 9}, gen, torch::kLong);
  auto mask = torch::ones({2, 9}, torch::kLong);
  mask[1].narrow(0, 0, 3).zero_();  // row 1 left-padded by 3
  const auto ours = values_of(*engine, tokens, mask);
  ASSERT_EQ(ours.sizes(), torch::IntArrayRef({2, 9}));

  const auto ckpt = engine->save_checkpoint(dir + "/ckpt", 1);
  const auto exported = dir + "/export";
  const auto done = shardrl_export({ckpt, exported, "--dtype", "fp32"});
  ASSERT_EQ(done.exit_code, 0) << done.output;
  const auto out = dir + "/values.safetensors";
  auto read = run_python_reference("value_model_reference.py",
                                   {"values", exported, actor, csv(tokens), csv(mask), "2", out});
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const auto theirs = read_safetensors(out).at("values");
  const auto real = mask.to(torch::kBool);
  EXPECT_LT(relative_error_max(ours.masked_select(real), theirs.masked_select(real)), 1e-5);

  // A critic resumed from its export reads the head it holds instead of drawing a new one.
  auto again = value_engine(exported);
  EXPECT_TRUE(torch::allclose(values_of(*again, tokens, mask), ours, 0, 1e-6));
}

// PPO with GAE through `shardrl train` on the arithmetic job (2 ranks), the actor waiting 5 steps
// for the critic: the critic learns (its value loss falls, its values reach the returns) while the
// actor's reward rises; the critic checkpoint the run wrote exports as
// a folder transformers' AutoModelForTokenClassification reads, whose values equal those of the
// checkpoint loaded into ShardRL's value model; and the run resumes on one rank from the two
// ranks' checkpoints, actor and critic, the critic's params and AdamW state offloaded to files.
TEST(ValueModel, PpoTrainsItAsTheCriticAndItsCheckpointExportsForTransformers) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "transformers", "safetensors"}));
  const auto dir = make_temp_dir("ppo-critic");
  const auto train = [&](int ranks, int steps, std::vector<std::string> more = {}) {
    std::vector<std::string> argv = {
        bin("shardrl"),
        "train",
        std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
        "trainer.default_local_dir=" + dir + "/run",
        "sft.cache_dir=" + dir + "/cache",
        "trainer.nproc_per_node=" + std::to_string(ranks),
        "trainer.total_training_steps=" + std::to_string(steps),
        "trainer.save_freq=-1",
        "algorithm.adv_estimator=gae",
        "trainer.critic_warmup=5",
        "critic.optim.lr=1e-3"};
    argv.insert(argv.end(), more.begin(), more.end());
    return run_process(argv, {}, 400);
  };
  const auto first = train(2, 30);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto metrics = read_jsonl(dir + "/run/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 30u);
  const auto mean = [&](const std::string& key, size_t from, size_t to) {
    double sum = 0;
    for (size_t i = from; i < to; ++i) sum += metrics[i][key].get<double>();
    return sum / static_cast<double>(to - from);
  };
  // The critic starts at values near 0 for returns near 0.5.
  EXPECT_LT(mean("critic/vf_loss", 20, 30), mean("critic/vf_loss", 0, 5));
  EXPECT_GT(mean("critic/values/mean", 20, 30), 0.4);
  EXPECT_GT(mean("reward_mean", 20, 30), mean("reward_mean", 0, 10) + 0.05);
  for (const auto& key :
       {"critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
        "critic/returns/mean", "time_values", "time_update_critic"}) {
    EXPECT_TRUE(metrics[0].contains(key)) << key << " missing in " << metrics[0].dump();
  }

  const auto ckpt = dir + "/run/checkpoints/critic/global_step_30";
  const auto exported = dir + "/critic_export";
  const auto done = shardrl_export({ckpt, exported, "--dtype", "fp32"});
  ASSERT_EQ(done.exit_code, 0) << done.output;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto tokens = torch::randint(15, {2, 7}, gen, torch::kLong);
  auto mask = torch::ones({2, 7}, torch::kLong);
  mask[0].narrow(0, 0, 2).zero_();
  const auto out = dir + "/values.safetensors";
  auto read = run_python_reference("value_model_reference.py",
                                   {"values", exported, "-", csv(tokens), csv(mask), "2", out});
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const auto theirs = read_safetensors(out).at("values");
  // The critic as it started (the supervised model's folder, a new head), then as it trained.
  std::string actor;
  for (const auto& entry : fs::directory_iterator(dir + "/cache")) {
    if (entry.path().filename().string().rfind("sft-", 0) == 0) actor = entry.path().string();
  }
  ASSERT_FALSE(actor.empty());
  auto critic = value_engine(actor);
  const auto untrained = values_of(*critic, tokens, mask);
  critic->load_checkpoint(ckpt);
  const auto ours = values_of(*critic, tokens, mask);
  const auto real = mask.to(torch::kBool);
  EXPECT_LT(relative_error_max(ours.masked_select(real), theirs.masked_select(real)), 1e-5);
  EXPECT_GT(relative_error_max(untrained.masked_select(real), theirs.masked_select(real)), 1e-2)
      << "the exported critic is the untrained one";

  // Two ranks' checkpoints, resumed on one, the critic's state offloaded to files between phases.
  const auto resumed =
      train(1, 32,
            {"critic.fsdp_config.param_offload=true", "critic.fsdp_config.optimizer_offload=true",
             "critic.fsdp_config.offload_dir=" + dir + "/offload"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("at step 30 (actor and critic)"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(read_jsonl(dir + "/run/metrics.jsonl").size(), 32u);
}

// The values PPO reads: response token j's is the critic's output at the state before it (the
// last prompt token for j = 0), as verl's critic slices values[:, -response_length - 1 : -1].
// Checked against each row run alone without padding; the packed pass (use_remove_padding) gives
// the same values and gradients, and 0 where the response mask is 0.
TEST(ValueModel, ResponseValuesAreTheStateBeforeEachTokenPackedOrPadded) {
  const auto c = models::LlamaConfig::from_json({{"model_type", "llama"},
                                                 {"vocab_size", 50},
                                                 {"hidden_size", 32},
                                                 {"intermediate_size", 64},
                                                 {"num_hidden_layers", 2},
                                                 {"num_attention_heads", 4},
                                                 {"num_key_value_heads", 2},
                                                 {"max_position_embeddings", 32}});
  torch::manual_seed(5);
  models::LlamaForTokenClassification model(c);
  models::init_value_head(*model->score, 0.5, 1);  // values far enough apart to tell positions
  const int64_t B = 3, P = 5, L = 4;
  const std::vector<int64_t> prompt_lengths = {2, 5, 3}, response_lengths = {4, 1, 3};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto sequences = torch::randint(1, 50, {B, P + L}, gen, torch::kLong);
  auto attention_mask = torch::ones({B, P + L}, torch::kLong);
  auto response_mask = torch::zeros({B, L});
  for (int64_t r = 0; r < B; ++r) {
    attention_mask[r].narrow(0, 0, P - prompt_lengths[r]).zero_();
    sequences[r].narrow(0, 0, P - prompt_lengths[r]).fill_(0);
    response_mask[r].narrow(0, 0, response_lengths[r]).fill_(1);
  }
  const auto grads_of = [&](const torch::Tensor& values) {
    model->zero_grad();
    (values * response_mask).sum().backward();
    std::vector<torch::Tensor> grads;
    for (auto& p : model->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(values.detach(), grads);
  };
  const auto [padded, padded_grads] =
      grads_of(rollout::response_values(model, sequences, P, attention_mask, response_mask));
  const auto [packed, packed_grads] =
      grads_of(rollout::packed_response_values(model, sequences, P, attention_mask, response_mask));
  torch::NoGradGuard no_grad;
  for (int64_t r = 0; r < B; ++r) {
    const auto alone = sequences[r].narrow(0, P - prompt_lengths[r], prompt_lengths[r] + L);
    const auto values = model(alone.unsqueeze(0))[0];
    for (int64_t j = 0; j < response_lengths[r]; ++j) {
      const double want = values[prompt_lengths[r] - 1 + j].item<double>();
      EXPECT_NEAR(padded[r][j].item<double>(), want, 1e-5) << "row " << r << " token " << j;
      EXPECT_NEAR(packed[r][j].item<double>(), want, 1e-5) << "row " << r << " token " << j;
    }
  }
  EXPECT_TRUE(torch::equal(packed * (1 - response_mask), torch::zeros_like(packed)));
  EXPECT_TRUE(torch::equal(padded * (1 - response_mask), torch::zeros_like(padded)));
  for (size_t i = 0; i < padded_grads.size(); ++i) {
    const double scale = padded_grads[i].abs().max().item<double>();
    EXPECT_LE((packed_grads[i] - padded_grads[i]).abs().max().item<double>(), 1e-5 * scale + 1e-7)
        << "param " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ValueModel, ::testing::Values("llama", "qwen2", "qwen3"),
                         [](const auto& info) { return info.param; });

TEST(ValueModel, LoraAndOtherFamiliesAreErrorsNamingTheKey) {
  engine::EngineConfig config;
  config.model_type = "value_model";
  const auto create = [&] { engine::EngineRegistry::create(config, dist::World::init_from_env()); };
  config.model = {{"family", "gpt"}};
  expect_error_naming<std::invalid_argument>(create, {"model.family", "gpt"});
  config.model = {{"lora_rank", 4}};
  expect_error_naming<std::invalid_argument>(create, {"model.lora_rank"});
}

}  // namespace
}  // namespace shardrl::testing
