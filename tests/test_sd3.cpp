// The SD3 / SD3.5 transformer (MMDiT) against diffusers' SD3Transformer2DModel: its
// save_pretrained loads here with its output, what save_sd3 / save_sd3_lora write loads in
// diffusers with ours (tests/python/sd3_reference.py), and 2 sharded ranks train as 1.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "model_test_util.h"
#include "shardrl/checkpoint.h"
#include "shardrl/optim.h"
#include "workers/sd3_scenario.h"

namespace shardrl::testing {
namespace {

using models::SD3Config;

void write_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                       const std::string& path) {
  models::save_weights(tensors, path);
}

ProcessResult sd3_reference(const std::vector<std::string>& args) {
  return run_python_reference("sd3_reference.py", args);
}

torch::Tensor forward(models::SD3Transformer2DModel& model,
                      const std::map<std::string, torch::Tensor>& io, const std::string& x = "x") {
  torch::NoGradGuard no_grad;
  return model(io.at(x), io.at("prompt_embeds"), io.at("pooled"), io.at("t"));
}

TEST(SD3, ParameterNamesAreDiffusers) {
  models::SD3Transformer2DModel model(sd3_test_config());  // 3 layers, attn2 in layer 1
  auto names = models::state_dict(*model);
  for (const std::string name :
       {"pos_embed.proj.weight", "time_text_embed.timestep_embedder.linear_1.weight",
        "time_text_embed.text_embedder.linear_2.bias", "context_embedder.weight",
        "transformer_blocks.0.norm1.linear.weight",
        "transformer_blocks.0.norm1_context.linear.bias", "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.0.attn.add_q_proj.weight", "transformer_blocks.0.attn.to_out.0.weight",
        "transformer_blocks.0.attn.to_add_out.bias", "transformer_blocks.0.attn.norm_q.weight",
        "transformer_blocks.0.attn.norm_added_k.weight",
        "transformer_blocks.0.ff.net.0.proj.weight", "transformer_blocks.0.ff_context.net.2.bias",
        "transformer_blocks.1.attn2.to_k.weight", "transformer_blocks.1.attn2.norm_k.weight",
        "transformer_blocks.2.attn.add_k_proj.weight", "norm_out.linear.weight", "proj_out.bias"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  // The last block is context_pre_only; only dual-attention blocks have attn2 and 9 D chunks.
  for (const std::string name :
       {"transformer_blocks.2.attn.to_add_out.weight",
        "transformer_blocks.2.ff_context.net.2.weight", "transformer_blocks.0.attn2.to_q.weight",
        "transformer_blocks.1.attn2.add_q_proj.weight",
        "transformer_blocks.1.attn2.norm_added_q.weight"}) {
    EXPECT_FALSE(names.count(name)) << name;
  }
  const int64_t d = sd3_test_config().inner_dim();
  EXPECT_EQ(names.at("transformer_blocks.1.norm1.linear.weight").size(0), 9 * d);
  EXPECT_EQ(names.at("transformer_blocks.0.norm1.linear.weight").size(0), 6 * d);
  EXPECT_EQ(names.at("transformer_blocks.2.norm1_context.linear.weight").size(0), 2 * d);
}

TEST(SD3, ConfigJsonRoundTripsAndNamesBadFields) {
  auto j = sd3_test_config().to_json();
  EXPECT_EQ(SD3Config::from_json(j).to_json(), j);
  auto plain = j;
  plain["qk_norm"] = nullptr;
  plain["dual_attention_layers"] = nlohmann::json::array();
  EXPECT_EQ(SD3Config::from_json(plain).qk_norm, "");
  const std::vector<std::pair<std::string, nlohmann::json>> bad = {
      {"qk_norm", "layer_norm"},         {"caption_projection_dim", 12},
      {"dual_attention_layers", {0, 3}}, {"pos_embed_max_size", 3},
      {"num_layers", "three"},           {"_class_name", "FluxTransformer2DModel"}};
  for (const auto& [field, value] : bad) {
    auto broken = j;
    broken[field] = value;
    expect_invalid_argument_naming([&] { SD3Config::from_json(broken); }, field);
  }
}

class SD3Diffusers : public ::testing::TestWithParam<std::string> {};

// diffusers' random-init save_pretrained (config.json + diffusion_pytorch_model.safetensors, or
// its sharded index) loads into ShardRL and gives diffusers' output, on square and non-square
// latents.
TEST_P(SD3Diffusers, SavePretrainedLoadsWithDiffusersOutput) {
  const std::string dir = make_temp_dir("sd3-pretrained") + "/model";
  const auto made = sd3_reference({"pretrained", dir, GetParam()});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto io = read_safetensors(dir + "/io.safetensors");
  // One file, and the same weights in several files with diffusers' sharded index.
  ASSERT_TRUE(
      std::filesystem::exists(dir + "-sharded/diffusion_pytorch_model.safetensors.index.json"));
  for (const std::string& folder : {dir, dir + "-sharded"}) {
    auto model = models::load_sd3(folder);
    for (const std::string x : {"x", "x_wide"}) {
      const auto want = io.at(x == "x" ? "out" : "out_wide");
      const auto got = forward(model, io, x);
      ASSERT_EQ(got.sizes(), want.sizes()) << folder << " " << x;
      EXPECT_GT(want.abs().max().item<double>(), 0.5) << x;
      EXPECT_LE(relative_error_max(got, want), 1e-5) << folder << " " << x;
    }
  }
}

// ShardRL's export (save_sd3, save_sd3_lora) loads in diffusers (from_pretrained,
// load_lora_adapter) with ShardRL's output, base and with the adapter.
TEST_P(SD3Diffusers, ExportLoadsInDiffusersWithOurOutput) {
  const std::string root = make_temp_dir("sd3-export");
  const std::string made_dir = root + "/made";
  const auto made = sd3_reference({"pretrained", made_dir, GetParam()});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto io = read_safetensors(made_dir + "/io.safetensors");
  // Our own weights, not diffusers': the config from its folder, params from our seed.
  torch::manual_seed(5);
  models::SD3Transformer2DModel model(SD3Config::load(made_dir + "/config.json"));
  models::save_sd3(models::state_dict(*model), model->config(), root + "/base");
  io["out"] = forward(model, io);

  models::lora::LoraConfig lora;
  lora.r = 4;
  lora.alpha = 8;
  lora.target_modules = {"to_q",       "to_k",       "to_v",       "to_out.0",
                         "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"};
  models::lora::apply_lora(*model, lora, "default");
  {
    torch::NoGradGuard no_grad;  // B starts at zero: move it so the adapter shows
    for (auto& [name, p] : models::state_dict(*model)) {
      if (models::lora::is_lora_b_tensor(name)) p.normal_(0, 0.3);
    }
  }
  models::save_sd3_lora(models::state_dict(*model), lora, "default", root + "/lora");
  io["out_lora"] = forward(model, io);
  write_safetensors(io, root + "/io.safetensors");
  expect_checks_pass(
      sd3_reference({"check", root + "/base", root + "/io.safetensors", root + "/lora"}), 3);
}

INSTANTIATE_TEST_SUITE_P(Variants, SD3Diffusers, ::testing::Values("sd3", "sd35"));

TEST(SD3, LoadNamesMissingAndMisshapenTensors) {
  const std::string dir = make_temp_dir("sd3-bad");
  models::SD3Transformer2DModel model(sd3_test_config());
  auto params = models::state_dict(*model);
  params.erase("transformer_blocks.1.attn2.to_q.weight");
  models::save_sd3(params, model->config(), dir);
  try {
    models::load_sd3(dir);
    FAIL() << "loaded a folder without transformer_blocks.1.attn2.to_q.weight";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("transformer_blocks.1.attn2.to_q.weight"),
              std::string::npos)
        << e.what();
  }
  auto wrong = sd3_test_config();
  wrong.pos_embed_max_size = 5;  // the table in the folder is 6 x 6
  models::save_sd3(models::state_dict(*model), sd3_test_config(), dir);
  std::ofstream(dir + "/config.json") << wrong.to_json().dump();
  try {
    models::load_sd3(dir);
    FAIL() << "loaded a position table of the wrong size";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(models::kSD3PosEmbedName), std::string::npos) << e.what();
  }
}

TEST(SD3, ActivationCheckpointingKeepsLossAndGradients) {
  const SD3Scenario s;
  auto plain = build_sd3(s), recomputed = build_sd3(s);
  recomputed->set_activation_checkpointing(true);
  auto b = sd3_batch(s, 0);
  auto loss = torch::mse_loss(plain(b.xt, b.prompt_embeds, b.pooled, b.timestep), b.target);
  auto loss_ckpt =
      torch::mse_loss(recomputed(b.xt, b.prompt_embeds, b.pooled, b.timestep), b.target);
  EXPECT_EQ(loss.item<double>(), loss_ckpt.item<double>());
  loss.backward();
  loss_ckpt.backward();
  auto want = models::state_dict(*plain), got = models::state_dict(*recomputed);
  for (const auto& [name, p] : want) {
    // The last block's text queries are never computed: no grad either way.
    if (!p.grad().defined()) {
      EXPECT_FALSE(got.at(name).grad().defined()) << name;
      continue;
    }
    ASSERT_TRUE(got.at(name).grad().defined()) << name;
    EXPECT_TRUE(torch::allclose(got.at(name).grad(), p.grad(), 1e-5, 1e-7)) << name;
  }
}

class SD3Sharded : public ::testing::TestWithParam<bool> {};

// Every transformer block an FSDP unit on 2 ranks: the losses and trained params of 1 rank.
TEST_P(SD3Sharded, TrainingOnTwoRanksMatchesUnsharded) {
  const SD3Scenario s;
  const std::string dir = make_temp_dir("sd3-train");
  std::vector<std::string> args = {"--out", dir, "--steps", std::to_string(s.steps)};
  if (GetParam()) args.push_back("--checkpoint");
  auto result = launch_workers(2, args, 300, "sd3_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;

  auto model = build_sd3(s);
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_module(*model), adam);
  std::vector<double> losses;
  for (int64_t step = 0; step < s.steps; ++step) {
    auto b = sd3_batch(s, step);
    optimizer->zero_grad();
    auto loss = torch::mse_loss(model(b.xt, b.prompt_embeds, b.pooled, b.timestep), b.target);
    loss.backward();
    optimizer->step();
    losses.push_back(loss.item<double>());
  }
  auto summary = nlohmann::json::parse(std::ifstream(dir + "/losses.json"));
  auto sharded_losses = summary["loss"].get<std::vector<double>>();
  ASSERT_EQ(sharded_losses.size(), losses.size());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(sharded_losses[i], losses[i], 1e-5 * losses[i]) << "step " << i;
  }
  auto sharded = read_params(dir);
  auto reference = models::state_dict(*model);
  ASSERT_EQ(sharded.size(), reference.size());
  for (const auto& [name, expected] : reference) {
    ASSERT_TRUE(sharded.count(name)) << name;
    EXPECT_LE(relative_error(sharded.at(name), expected.detach()), 1e-5) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(ActivationCheckpointing, SD3Sharded, ::testing::Values(false, true));

}  // namespace
}  // namespace shardrl::testing
