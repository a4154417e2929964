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
