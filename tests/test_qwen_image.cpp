// The Qwen-Image transformer against diffusers' QwenImageTransformer2DModel: its save_pretrained
// (one file and sharded) loads here with its output, rotary positions and the pipeline's latent
// packing included; what save_qwen_image / save_qwen_image_lora write loads in diffusers with ours;
// the text mask hides what diffusers hides; the engine's model trains on 2 ranks (sharded by
// block, with activation checkpointing, split by Ulysses) as on 1; its size for the memory plan
// is the sharded model's and the published count.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>

#include "expect_error.h"
#include "model_test_util.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/checkpoint.h"
#include "shardrl/engine.h"
#include "shardrl/memory_plan.h"
#include "workers/qwen_image_scenario.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using models::QwenImageConfig;
using models::QwenImageShape;
using nlohmann::json;

ProcessResult qwen_image_reference(const std::vector<std::string>& args) {
  return run_python_reference("qwen_image_reference.py", args);
}

// tests/python/qwen_image_reference.py's cases and rotary shapes.
const std::map<std::string, std::vector<QwenImageShape>> kCases = {
    {"square", {{1, 4, 4}}},
    {"wide", {{1, 4, 6}}},
    {"odd", {{1, 5, 3}}},
    {"two_images", {{1, 4, 6}, {1, 3, 3}}}};
const std::vector<QwenImageShape> kRopeShapes = {{1, 5, 3}, {2, 3, 4}, {1, 7, 2}};
constexpr int64_t kRopeText = 9;

torch::Tensor forward(models::QwenImageTransformer2DModel& model, const torch::Tensor& x,
                      const std::map<std::string, torch::Tensor>& io,
                      const std::vector<QwenImageShape>& shapes, bool mask = true) {
  torch::NoGradGuard no_grad;
  return model(x, io.at("prompt_embeds"), mask ? io.at("mask") : torch::Tensor(), io.at("t"),
               shapes);
}

torch::Tensor shapes_tensor(const std::vector<QwenImageShape>& shapes) {
  auto out = torch::empty({static_cast<int64_t>(shapes.size()), 3}, torch::kLong);
  for (size_t i = 0; i < shapes.size(); ++i) {
    for (int64_t k = 0; k < 3; ++k) out[i][k] = shapes[i][k];
  }
  return out;
}

TEST(QwenImage, ParameterNamesAreDiffusersAndLoraTargetsEveryProjection) {
  models::QwenImageTransformer2DModel model(qwen_image_test_config());
  auto names = models::state_dict(*model);
  for (const std::string name :
       {"time_text_embed.timestep_embedder.linear_1.weight",
        "time_text_embed.timestep_embedder.linear_2.bias", "txt_norm.weight", "img_in.weight",
        "txt_in.bias", "transformer_blocks.0.img_mod.1.weight",
        "transformer_blocks.0.txt_mod.1.bias", "transformer_blocks.0.attn.norm_q.weight",
        "transformer_blocks.0.attn.norm_added_k.weight", "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.0.attn.add_v_proj.bias", "transformer_blocks.0.attn.to_out.0.weight",
        "transformer_blocks.1.attn.to_add_out.bias",
        "transformer_blocks.1.img_mlp.net.0.proj.weight", "transformer_blocks.1.img_mlp.net.2.bias",
        "transformer_blocks.1.txt_mlp.net.0.proj.bias", "transformer_blocks.1.txt_mlp.net.2.weight",
        "norm_out.linear.weight", "proj_out.bias"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  const int64_t d = qwen_image_test_config().inner_dim();
  EXPECT_EQ(names.at("transformer_blocks.1.img_mod.1.weight").size(0), 6 * d);
  EXPECT_EQ(names.at("transformer_blocks.0.txt_mlp.net.0.proj.weight").size(0), 4 * d);
  EXPECT_EQ(names.at("proj_out.weight").size(0), 2 * 2 * 2);  // patch^2 x out_channels

  models::lora::LoraConfig lora;
  lora.target_modules = models::qwen_image_lora_targets();
  ASSERT_EQ(lora.target_modules.size(), 12u);  // verl-omni's list
  const auto targeted = models::lora::apply_lora(*model, lora, "default");
  EXPECT_EQ(targeted.size(), 12u * qwen_image_test_config().num_layers);
  for (const std::string module :
       {"transformer_blocks.0.attn.to_out.0", "transformer_blocks.1.txt_mlp.net.0.proj",
        "transformer_blocks.1.img_mlp.net.2"}) {
    EXPECT_NE(std::find(targeted.begin(), targeted.end(), module), targeted.end()) << module;
  }
}

TEST(QwenImage, ConfigJsonRoundTripsReadsThePublishedOneAndNamesBadFields) {
  auto j = qwen_image_test_config().to_json();
  EXPECT_EQ(QwenImageConfig::from_json(j).to_json(), j);
  // Qwen/Qwen-Image's transformer/config.json: diffusers' defaults, and a field its constructor
  // does not take (pooled_projection_dim), ignored.
  const json published = {{"_class_name", "QwenImageTransformer2DModel"},
                          {"_diffusers_version", "0.34.0.dev0"},
                          {"attention_head_dim", 128},
                          {"axes_dims_rope", {16, 56, 56}},
                          {"guidance_embeds", false},
                          {"in_channels", 64},
                          {"joint_attention_dim", 3584},
                          {"num_attention_heads", 24},
                          {"num_layers", 60},
                          {"out_channels", 16},
                          {"patch_size", 2},
                          {"pooled_projection_dim", 768}};
  EXPECT_EQ(QwenImageConfig::from_json(published).to_json(), QwenImageConfig().to_json());
  auto null_out = j;
  null_out["out_channels"] = nullptr;  // diffusers: in_channels
  EXPECT_EQ(QwenImageConfig::from_json(null_out).out_channels, j["in_channels"].get<int64_t>());
  const std::vector<std::pair<std::string, json>> bad = {
      {"axes_dims_rope", {2, 2, 2}},  // sums to 6, not attention_head_dim 8
      {"axes_dims_rope", {3, 1, 4}},  // odd dims
      {"axes_dims_rope", {4, 4}},
      {"zero_cond_t", true},
      {"use_additional_t_cond", true},
      {"use_layer3d_rope", true},
      {"num_layers", "three"},
      {"attention_head_dim", 0},
      {"_class_name", "SD3Transformer2DModel"}};
  for (const auto& [field, value] : bad) {
    auto broken = j;
    broken[field] = value;
    expect_invalid_argument_naming([&] { QwenImageConfig::from_json(broken); }, field);
  }
}

class QwenImageDiffusers : public ::testing::TestWithParam<std::string> {};

// diffusers' random-init save_pretrained (config.json + diffusion_pytorch_model.safetensors, or
// its sharded index) loads into ShardRL and gives diffusers' output on every case: square,
// non-square and odd-sided images, two images in one sequence, a text mask with padding and a
// hole, and no mask.
TEST_P(QwenImageDiffusers, SavePretrainedLoadsWithDiffusersOutput) {
  const std::string dir = make_temp_dir("qwen-image-pretrained") + "/model";
  const auto made = qwen_image_reference({"pretrained", dir, GetParam()});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto io = read_safetensors(dir + "/io.safetensors");
  ASSERT_TRUE(fs::exists(dir + "-sharded/diffusion_pytorch_model.safetensors.index.json"));
  for (const std::string& folder : {dir, dir + "-sharded"}) {
    auto model = models::load_qwen_image(folder);
    for (const auto& [name, shapes] : kCases) {
      const auto want = io.at("out_" + name);
      const auto got = forward(model, io.at("x_" + name), io, shapes);
      ASSERT_EQ(got.sizes(), want.sizes()) << folder << " " << name;
      EXPECT_GT(want.abs().max().item<double>(), 0.5) << name;
      EXPECT_LE(relative_error_max(got, want), 1e-5) << folder << " " << name;
    }
    const auto got = forward(model, io.at("x_wide"), io, kCases.at("wide"), /*mask=*/false);
    EXPECT_LE(relative_error_max(got, io.at("out_nomask")), 1e-5) << folder << " without mask";
    // The mask changes the output: the test above would see it ignored.
    EXPECT_GT(relative_error_max(io.at("out_nomask"), io.at("out_wide")), 1e-3);
  }
}

// The rotary angles of several images (frames, odd sides) and of the text that follows them are
// diffusers' QwenEmbedRope's, and the latents pack as QwenImagePipeline._pack_latents packs them.
TEST_P(QwenImageDiffusers, RotaryPositionsAndLatentPackingAreDiffusers) {
  const std::string dir = make_temp_dir("qwen-image-rotary") + "/model";
  const auto made = qwen_image_reference({"pretrained", dir, GetParam()});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto io = read_safetensors(dir + "/io.safetensors");
  const auto config = QwenImageConfig::load(dir + "/config.json");
  const auto rotary = models::qwen_image_rotary(config, kRopeShapes, kRopeText);
  for (const auto& [name, got] :
       std::vector<std::pair<std::string, torch::Tensor>>{{"rope_image_cos", rotary.image_cos},
                                                          {"rope_image_sin", rotary.image_sin},
                                                          {"rope_text_cos", rotary.text_cos},
                                                          {"rope_text_sin", rotary.text_sin}}) {
    ASSERT_EQ(got.sizes(), io.at(name).sizes()) << name;
    EXPECT_LE((got - io.at(name)).abs().max().item<double>(), 1e-6) << name;
  }
  const auto packed = models::qwen_image_pack_latents(io.at("latents"), 2);
  EXPECT_TRUE(torch::equal(packed, io.at("packed")));
  EXPECT_TRUE(torch::equal(models::qwen_image_unpack_latents(packed, 6, 10, 2), io.at("latents")));
}

// The diffusion algorithms' velocity of unpacked latents [B, C, H, W] through models::FlowModel
// is QwenImagePipeline's: packed 2x2 patches, img_shapes (1, H / 2, W / 2), timestep sigma, the
// prompt's mask, and true CFG rescaled to the conditional prediction's norm per token.
TEST(QwenImage, FlowVelocityIsThePipelinesWithAndWithoutTrueCfg) {
  const std::string dir = make_temp_dir("qwen-image-flow") + "/model";
  const auto made = qwen_image_reference({"pretrained", dir, "small"});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto io = read_safetensors(dir + "/io.safetensors");
  const models::FlowModel model = models::load_qwen_image(dir);
  EXPECT_EQ(model.latent_channels(), io.at("flow_latents").size(1));
  algos::Conditioning cond;
  cond.prompt_embeds = io.at("prompt_embeds");
  cond.prompt_embeds_mask = io.at("mask");
  cond.negative_prompt_embeds = io.at("flow_negative_embeds");
  cond.negative_prompt_embeds_mask = io.at("flow_negative_mask");
  torch::NoGradGuard no_grad;
  for (const auto& [scale, want] : {std::pair{1.0, io.at("flow_v")}, {3.0, io.at("flow_v_cfg")}}) {
    const auto got =
        algos::flow_velocity(model, io.at("flow_latents"), io.at("flow_sigma"), cond, scale);
    ASSERT_EQ(got.sizes(), want.sizes()) << scale;
    EXPECT_LE(relative_error_max(got, want), 1e-5) << "true_cfg_scale " << scale;
  }
  // The rescale acts: plain CFG is another velocity.
  EXPECT_GT(relative_error_max(
                io.at("flow_v_cfg"),
                algos::cfg_combine(model.velocity(io.at("flow_latents"), io.at("flow_sigma"),
                                                  cond.negative_text()),
                                   io.at("flow_v"), 3.0)),
            1e-3);
}

// ShardRL's save_qwen_image and save_qwen_image_lora (an adapter on all 12 targets) load in
// diffusers (from_pretrained, load_lora_adapter) with ShardRL's output, base and with the adapter.
TEST_P(QwenImageDiffusers, ExportLoadsInDiffusersWithOurOutput) {
  const std::string root = make_temp_dir("qwen-image-export");
  const std::string made_dir = root + "/made";
  const auto made = qwen_image_reference({"pretrained", made_dir, GetParam()});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto made_io = read_safetensors(made_dir + "/io.safetensors");
  // Our own weights, not diffusers': the config from its folder, params from our seed.
  torch::manual_seed(5);
  models::QwenImageTransformer2DModel model(QwenImageConfig::load(made_dir + "/config.json"));
  models::save_qwen_image(models::state_dict(*model), model->config(), root + "/base");
  const auto shapes = kCases.at("two_images");
  std::map<std::string, torch::Tensor> io = {{"x", made_io.at("x_two_images")},
                                             {"prompt_embeds", made_io.at("prompt_embeds")},
                                             {"mask", made_io.at("mask")},
                                             {"t", made_io.at("t")},
                                             {"img_shapes", shapes_tensor(shapes)}};
  io["out"] = forward(model, io["x"], io, shapes);

  models::lora::LoraConfig lora;
  lora.r = 4;
  lora.alpha = 8;
  lora.target_modules = models::qwen_image_lora_targets();
  models::lora::apply_lora(*model, lora, "default");
  {
    torch::NoGradGuard no_grad;  // B starts at zero: move it so the adapter shows
    for (auto& [name, p] : models::state_dict(*model)) {
      if (models::lora::is_lora_b_tensor(name)) p.normal_(0, 0.3);
    }
  }
  models::save_qwen_image_lora(models::state_dict(*model), lora, "default", root + "/lora");
  io["out_lora"] = forward(model, io["x"], io, shapes);
  models::save_weights(io, root + "/io.safetensors");
  expect_checks_pass(
      qwen_image_reference({"check", root + "/base", root + "/io.safetensors", root + "/lora"}), 3);
}

INSTANTIATE_TEST_SUITE_P(Variants, QwenImageDiffusers, ::testing::Values("small", "wide"));

TEST(QwenImage, LoadNamesMissingAndUnexpectedTensors) {
  const std::string dir = make_temp_dir("qwen-image-bad");
  models::QwenImageTransformer2DModel model(qwen_image_test_config());
  auto params = models::state_dict(*model);
  params.erase("transformer_blocks.1.txt_mlp.net.2.weight");
  models::save_qwen_image(params, model->config(), dir);
  expect_error_naming([&] { models::load_qwen_image(dir); },
                      {"transformer_blocks.1.txt_mlp.net.2.weight"});
  params = models::state_dict(*model);
  params["transformer_blocks.0.attn.to_k.weight"] = torch::zeros({3, 3});
  models::save_qwen_image(params, model->config(), dir);
  expect_error_naming([&] { models::load_qwen_image(dir); },
                      {"transformer_blocks.0.attn.to_k.weight"});
}

// encoder_hidden_states_mask hides the padding text tokens from every query, as diffusers' joint
// mask does: what they hold changes nothing, and a real token does.
TEST(QwenImage, TextMaskHidesMaskedTokens) {
  const QwenImageScenario s;
  torch::manual_seed(s.seed);
  models::QwenImageTransformer2DModel model(qwen_image_test_config());
  const auto b = qwen_image_batch(s, 0);  // row 1 masks its last token, row 2 its last 2
  const auto shapes = qwen_image_test_shapes(s);
  torch::NoGradGuard no_grad;
  const auto out = model(b.xt, b.prompt_embeds, b.prompt_mask, b.timestep, shapes);
  auto changed = b.prompt_embeds.clone();
  changed[2].narrow(0, s.text_tokens - 2, 2).normal_();
  changed[1][s.text_tokens - 1].normal_();
  EXPECT_TRUE(
      torch::allclose(model(b.xt, changed, b.prompt_mask, b.timestep, shapes), out, 0, 1e-6));
  changed[2][0].normal_();  // a real token of row 2
  const auto moved = model(b.xt, changed, b.prompt_mask, b.timestep, shapes);
  EXPECT_GT((moved[2] - out[2]).abs().max().item<double>(), 1e-4);
  EXPECT_TRUE(torch::allclose(moved[0], out[0], 0, 1e-6));
}

TEST(QwenImage, BadInputsAreErrorsNamingTheInput) {
  const QwenImageScenario s;
  models::QwenImageTransformer2DModel model(qwen_image_test_config());
  const auto b = qwen_image_batch(s, 0);
  const auto shapes = qwen_image_test_shapes(s);
  torch::NoGradGuard no_grad;
  expect_error_naming(
      [&] {
        model(b.xt, b.prompt_embeds, b.prompt_mask, b.timestep,
              std::vector<QwenImageShape>{{1, 3, 3}});
      },
      {"hidden_states"});
  expect_error_naming(
      [&] { model(b.xt, b.prompt_embeds, b.prompt_mask.narrow(1, 0, 2), b.timestep, shapes); },
      {"encoder_hidden_states_mask"});
  expect_error_naming(
      [&] { model(b.xt, b.prompt_embeds.narrow(2, 0, 5), b.prompt_mask, b.timestep, shapes); },
      {"encoder_hidden_states"});
  expect_error_naming(
      [&] { model(b.xt, b.prompt_embeds, b.prompt_mask, b.timestep.narrow(0, 0, 1), shapes); },
      {"timestep"});
  expect_error_naming(
      [&] {
        models::qwen_image_rotary(qwen_image_test_config(), {{1, 8, 8}}, 4093);
      },
      {"4096"});
}

TEST(QwenImage, ActivationCheckpointingKeepsLossAndGradients) {
  const QwenImageScenario s;
  torch::manual_seed(s.seed);
  models::QwenImageTransformer2DModel plain(qwen_image_test_config());
  torch::manual_seed(s.seed);
  models::QwenImageTransformer2DModel recomputed(qwen_image_test_config());
  recomputed->set_activation_checkpointing(true);
  const auto b = qwen_image_batch(s, 0);
  const auto shapes = qwen_image_test_shapes(s);
  auto loss =
      torch::mse_loss(plain(b.xt, b.prompt_embeds, b.prompt_mask, b.timestep, shapes), b.target);
  auto loss_ckpt = torch::mse_loss(
      recomputed(b.xt, b.prompt_embeds, b.prompt_mask, b.timestep, shapes), b.target);
  EXPECT_EQ(loss.item<double>(), loss_ckpt.item<double>());
  loss.backward();
  loss_ckpt.backward();
  auto want = models::state_dict(*plain), got = models::state_dict(*recomputed);
  for (const auto& [name, p] : want) {
    // The last block's text stream after its attention feeds nothing: no grad either way.
    if (!p.grad().defined()) {
      EXPECT_FALSE(got.at(name).grad().defined()) << name;
      continue;
    }
    ASSERT_TRUE(got.at(name).grad().defined()) << name;
    EXPECT_TRUE(torch::allclose(got.at(name).grad(), p.grad(), 1e-5, 1e-7)) << name;
  }
}

// ---- training on real ranks --------------------------------------------------------------------

struct Run {
  std::vector<std::pair<double, double>> metrics;  // loss, grad_norm per step
  std::map<std::string, torch::Tensor> params;
};

Run run_worker(int nproc, const std::string& dir, std::vector<std::string> args) {
  args.insert(args.end(), {"--out", dir});
  auto result = launch_workers(nproc, args, 300, "qwen_image_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  Run run;
  std::ifstream in(dir + "/metrics.txt");
  for (double loss, norm; in >> loss >> norm;) run.metrics.emplace_back(loss, norm);
  if (fs::exists(dir + "/final/names.txt")) run.params = read_params(dir + "/final");
  return run;
}

// `split` trained as `reference` did: every step's loss and grad norm, and every final param, to
// 1e-5 relative in fp32.
void expect_same_training(const Run& split, const Run& reference, size_t steps) {
  ASSERT_EQ(reference.metrics.size(), steps);
  ASSERT_EQ(split.metrics.size(), steps);
  for (size_t s = 0; s < steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const auto [loss, norm] = split.metrics[s];
    const auto [want_loss, want_norm] = reference.metrics[s];
    EXPECT_NEAR(loss, want_loss, 1e-5 * std::max(1.0, std::abs(want_loss)));
    EXPECT_NEAR(norm, want_norm, 1e-5 * std::max(1.0, std::abs(want_norm)));
  }
  ASSERT_FALSE(reference.params.empty());
  ASSERT_EQ(split.params.size(), reference.params.size());
  for (const auto& [name, want] : reference.params) {
    ASSERT_TRUE(split.params.count(name)) << name;
    EXPECT_LT(relative_error(split.params.at(name), want), 1e-5) << name;
  }
}

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

// 2 ranks, every block an FSDP unit: data-parallel (with and without activation checkpointing),
// and one Ulysses group splitting each sample's 5 text and 12 image tokens (both padded to even
// lengths, row-varying text masks, the recompute repeating the exchanges), train as 1 rank on the
// same global batch.
TEST(QwenImageSharded, TwoRanksTrainAsOne) {
  const QwenImageScenario s;
  const auto dir = make_temp_dir("qwen-image-train");
  const std::vector<std::string> args = {"--steps", std::to_string(s.steps)};
  const auto one = run_worker(1, dir + "/one", args);
  {
    SCOPED_TRACE("dp 2");
    expect_same_training(run_worker(2, dir + "/dp2", args), one, s.steps);
  }
  {
    SCOPED_TRACE("dp 2, activation checkpointing");
    expect_same_training(run_worker(2, dir + "/dp2_ckpt", with(args, {"--checkpointing"})), one,
                         s.steps);
  }
  {
    SCOPED_TRACE("Ulysses sp 2, activation checkpointing");
    expect_same_training(run_worker(2, dir + "/sp2", with(args, {"--sp", "2", "--checkpointing"})),
                         one, s.steps);
  }
}

// LoRA on verl-omni's 12 targets: only the adapters move, and 2 Ulysses ranks train them as 1.
TEST(QwenImageSharded, LoraAtSp2TrainsAsOneRankAndOnlyTheAdapters) {
  const QwenImageScenario s;
  const auto dir = make_temp_dir("qwen-image-lora");
  const std::vector<std::string> args = {
      "--steps", std::to_string(s.steps), "--lora-rank", "4", "--lr", "1e-2"};
  const auto one = run_worker(1, dir + "/one", args);
  expect_same_training(run_worker(2, dir + "/sp2", with(args, {"--sp", "2"})), one, s.steps);
  torch::manual_seed(s.seed);
  models::QwenImageTransformer2DModel initial(qwen_image_test_config());
  size_t adapters = 0;
  for (const auto& [name, p] : models::state_dict(*initial)) {
    ASSERT_TRUE(one.params.count(name)) << name;
    EXPECT_TRUE(torch::equal(one.params.at(name), p)) << name << " is frozen";
  }
  for (const auto& [name, p] : one.params) adapters += models::lora::is_adapter_tensor(name);
  EXPECT_EQ(adapters, 2u * 12 * qwen_image_test_config().num_layers);
}

// ---- the memory plan's model size --------------------------------------------------------------

TEST(QwenImage, ModelSizeIsTheShardedModelsAndThePublishedCount) {
  engine::EngineConfig config;
  config.model_type = "diffusion_model";
  config.model = {{"config", qwen_image_test_config().to_json()}, {"lora_rank", 2}};
  const auto planned = engine::EngineRegistry::model_size(config);
  auto engine = engine::EngineRegistry::create(config, dist::World::init_from_env());
  EXPECT_EQ(sorted_units(planned), sharded_units(*engine));
  EXPECT_EQ(planned.units.size(), 1u + qwen_image_test_config().num_layers);
  EXPECT_EQ(engine->export_info().at("family"), "qwen_image");
  EXPECT_EQ(engine->export_info().at("config"), qwen_image_test_config().to_json());

  // Adapters are allocated even without bytes for the base: a small rank keeps this test light.
  config.model = {{"config", QwenImageConfig().to_json()}, {"lora_rank", 4}};
  const auto published = engine::EngineRegistry::model_size(config);
  EXPECT_EQ(published.units.size(), 61u);
  // LoRA of rank r on a block: 8 attention projections of d x d (2 r d each) and 4 MLP
  // projections of d x 4d (5 r d each).
  const int64_t d = 3072;
  const int64_t adapters_per_block = 4 * (8 * 2 * d + 4 * 5 * d);
  // The published base (published-configs.md) and the adapters beside it.
  EXPECT_EQ(published.params(), int64_t{20'430'401'088} + 60 * adapters_per_block);
  EXPECT_EQ(published.trainable(), 60 * adapters_per_block);
  // A block: adaLN of both streams 12 d^2 + 12 d, 8 attention projections 8 (d^2 + d), the two
  // MLPs 16 d^2 + 10 d, 4 qk norms of 128.
  EXPECT_EQ(published.largest_unit().params, 36 * d * d + 30 * d + 4 * 128 + adapters_per_block);
  EXPECT_EQ(published.blocks, 60);
}

}  // namespace
}  // namespace shardrl::testing
