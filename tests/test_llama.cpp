// The LLaMA / Qwen2 / Qwen3 decoders: HF config and names (and the fields refused), an independent
// Python reference for each family, the KV cache, weights files with faults.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "model_test_util.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/transformer.h"
#include "shardrl/optim.h"
#include "shardrl/rollout/packed_linear.h"
#include "shardrl/rollout/sampling.h"
#include "workers/llama_scenario.h"

namespace shardrl::testing {
namespace {

using models::LlamaConfig;
using models::LlamaForCausalLM;

LlamaConfig tiny_config(bool qwen = false) {
  LlamaConfig c = llama_test_config();
  c.rope_parameters.rope_theta = qwen ? 1e6 : 1e4;
  c.tie_word_embeddings = qwen;
  c.attention_bias = qwen;
  c.model_type = qwen ? "qwen2" : "llama";
  return c;
}

// One tiny config per family, each with what sets it apart and a GQA ratio of its own:
//   llama   untied head, 4 heads over 2 key/value heads;
//   qwen2   tied head, q/k/v biases;
//   qwen3   q/k RMSNorm per head, head_dim 12 (not hidden 32 / 4 heads), 4 heads over 1, tied,
//           biases on q/k/v/o;
//   llama3  Llama 3.x RoPE scaling (head_dim 16 puts wavelengths in all three of its bands:
//           kept, blended and stretched), untied, 4 heads of their own (no GQA).
LlamaConfig family_config(const std::string& family) {
  if (family == "llama" || family == "qwen2") return tiny_config(family == "qwen2");
  LlamaConfig c = llama_test_config();
  if (family == "qwen3") {
    c.model_type = "qwen3";
    c.head_dim = 12;
    c.num_key_value_heads = 1;
    c.tie_word_embeddings = true;
    c.attention_bias = true;
    c.rope_parameters.rope_theta = 1e6;
    return c;
  }
  EXPECT_EQ(family, "llama3");
  c.head_dim = 16;
  c.num_key_value_heads = 4;
  auto& rope = c.rope_parameters;
  rope.rope_type = "llama3";
  rope.rope_theta = 5e5;
  rope.factor = 8;
  rope.low_freq_factor = 1;
  rope.high_freq_factor = 4;
  rope.original_max_position_embeddings = 1024;
  return c;
}

// Random weights everywhere, norms included, so no term of the architecture hides.
LlamaForCausalLM random_model(const LlamaConfig& c, uint64_t seed = 3) {
  torch::manual_seed(seed);
  LlamaForCausalLM model(c);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters())
    p.normal_(0, p.dim() == 1 ? 0.5 : 0.2).add_(p.dim() == 1 ? 1 : 0);
  return model;
}

torch::Tensor tokens_for(const LlamaConfig& c, int64_t rows, int64_t T) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return torch::randint(c.vocab_size, {rows, T}, gen, torch::kLong);
}

std::string expect_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

TEST(Llama, ParameterNamesAreHuggingFaces) {
  LlamaForCausalLM model(tiny_config());
  auto names = models::state_dict(*model);
  for (const std::string name :
       {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight", "lm_head.weight"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  EXPECT_EQ(names.size(), 3u + 2 * 9);
  EXPECT_EQ(names.at("model.layers.0.self_attn.k_proj.weight").sizes(),
            (std::vector<int64_t>{16, 32}));
  LlamaForCausalLM qwen(tiny_config(true));
  auto qwen_names = models::state_dict(*qwen);
  EXPECT_FALSE(qwen_names.count("lm_head.weight"));  // tied
  EXPECT_TRUE(qwen_names.count("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_FALSE(qwen_names.count("model.layers.0.self_attn.o_proj.bias"));
  // Qwen3: per-head q/k norms of head_dim, projections of heads x head_dim, attention_bias on all
  // four.
  LlamaForCausalLM qwen3(family_config("qwen3"));
  auto qwen3_names = models::state_dict(*qwen3);
  EXPECT_EQ(qwen3_names.at("model.layers.1.self_attn.q_norm.weight").sizes(),
            (std::vector<int64_t>{12}));
  EXPECT_EQ(qwen3_names.at("model.layers.1.self_attn.k_norm.weight").sizes(),
            (std::vector<int64_t>{12}));
  EXPECT_EQ(qwen3_names.at("model.layers.0.self_attn.q_proj.weight").sizes(),
            (std::vector<int64_t>{48, 32}));
  EXPECT_EQ(qwen3_names.at("model.layers.0.self_attn.k_proj.weight").sizes(),
            (std::vector<int64_t>{12, 32}));
  EXPECT_EQ(qwen3_names.at("model.layers.0.self_attn.o_proj.weight").sizes(),
            (std::vector<int64_t>{32, 48}));
  EXPECT_TRUE(qwen3_names.count("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_EQ(qwen3_names.size(), 2u + 2 * (9 + 4 + 2));
}

TEST(Llama, ConfigJsonRoundTripsWithHfFieldsAndNamesBadFields) {
  auto c = tiny_config();
  auto j = c.to_json();
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["architectures"][0], "LlamaForCausalLM");
  auto back = LlamaConfig::from_json(j);
  EXPECT_EQ(back.to_json(), j);

  auto missing = j;
  missing.erase("hidden_size");
  EXPECT_NE(expect_error([&] { LlamaConfig::from_json(missing); }).find("hidden_size"),
            std::string::npos);
  auto wrong_type = j;
  wrong_type["rope_theta"] = "big";
  EXPECT_NE(expect_error([&] { LlamaConfig::from_json(wrong_type); }).find("rope_theta"),
            std::string::npos);
  auto bad_gqa = j;
  bad_gqa["num_key_value_heads"] = 3;
  EXPECT_NE(expect_error([&] { LlamaConfig::from_json(bad_gqa); }).find("num_key_value_heads"),
            std::string::npos);
  auto no_kv = j;
  no_kv.erase("num_key_value_heads");  // HF's default: as many as the attention heads
  EXPECT_EQ(LlamaConfig::from_json(no_kv).num_key_value_heads, 4);
}

// The published config.json files of Qwen3-1.7B and Llama-3.2-1B (published-configs.md) read as
// the models they are: head_dim apart from hidden / heads, Qwen3's q/k norms, Llama 3's RoPE
// scaling; and write back what transformers reads as the same model.
TEST(Llama, PublishedQwen3AndLlama32ConfigsReadAsTheirModels) {
  const auto qwen3 = LlamaConfig::from_json(nlohmann::json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})"));
  EXPECT_EQ(qwen3.model_type, "qwen3");
  EXPECT_TRUE(qwen3.qk_norm());
  EXPECT_EQ(qwen3.attention_head_dim(), 128);
  EXPECT_EQ(qwen3.num_key_value_heads, 8);
  EXPECT_EQ(qwen3.rope_parameters.rope_type, "default");
  EXPECT_EQ(qwen3.rope_parameters.rope_theta, 1e6);
  EXPECT_TRUE(qwen3.tie_word_embeddings);
  const auto llama = LlamaConfig::from_json(nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})"));
  const auto& rope = llama.rope_parameters;
  EXPECT_EQ(rope.rope_type, "llama3");
  EXPECT_EQ(rope.rope_theta, 5e5);
  EXPECT_EQ(rope.factor, 32);
  EXPECT_EQ(rope.low_freq_factor, 1);
  EXPECT_EQ(rope.high_freq_factor, 4);
  EXPECT_EQ(rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(llama.attention_head_dim(), 64);
  // Written as transformers 5 writes it (rope_parameters), with rope_scaling and rope_theta for
  // readers before it; read back, the same config.
  const auto j = llama.to_json();
  EXPECT_EQ(j["rope_parameters"]["rope_type"], "llama3");
  EXPECT_EQ(j["rope_parameters"]["rope_theta"], 5e5);
  EXPECT_EQ(j["rope_parameters"]["original_max_position_embeddings"], 8192);
  EXPECT_EQ(j["rope_scaling"]["factor"], 32.0);
  EXPECT_EQ(j["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(LlamaConfig::from_json(j).to_json(), j);
  EXPECT_EQ(qwen3.to_json()["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(qwen3.to_json()["head_dim"], 128);
  // transformers 5's own spelling reads alike; rope_scaling wins over rope_parameters, as there.
  auto v5 = j;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  EXPECT_EQ(LlamaConfig::from_json(v5).to_json(), j);
  auto both = j;
  both["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  EXPECT_EQ(LlamaConfig::from_json(both).rope_parameters.rope_type, "llama3");
  for (const auto& family : {"llama", "qwen2", "qwen3", "llama3"}) {
    const auto c = family_config(family);
    EXPECT_EQ(LlamaConfig::from_json(c.to_json()).to_json(), c.to_json()) << family;
  }
  // Absent fields take the model type's defaults in transformers: Qwen3's head_dim is 128 and
  // its key/value heads 32; Llama's are hidden / heads and the heads.
  nlohmann::json bare = {{"vocab_size", 64},
                         {"hidden_size", 64},
                         {"intermediate_size", 96},
                         {"num_hidden_layers", 1},
                         {"num_attention_heads", 32}};
  EXPECT_EQ(LlamaConfig::from_json(bare).attention_head_dim(), 2);
  EXPECT_EQ(LlamaConfig::from_json(bare).num_key_value_heads, 32);
  bare["model_type"] = "qwen3";
  bare["num_attention_heads"] = 64;
  EXPECT_EQ(LlamaConfig::from_json(bare).attention_head_dim(), 128);
  EXPECT_EQ(LlamaConfig::from_json(bare).num_key_value_heads, 32);
}

// A field that changes the math and is not implemented stops the load naming it; a field at the
// value that changes nothing passes.
TEST(Llama, UnimplementedConfigFieldsAreErrorsNamingThem) {
  const auto base = family_config("qwen3").to_json();
  struct Case {
    nlohmann::json change;
    std::string field;
  };
  const std::vector<Case> refused = {
      {{{"use_sliding_window", true}, {"sliding_window", 16}, {"max_window_layers", 1}},
       "use_sliding_window"},
      // sliding_window defaults to 4096 when use_sliding_window is on
      {{{"use_sliding_window", true}, {"max_window_layers", 0}}, "use_sliding_window"},
      {{{"layer_types", {"full_attention", "sliding_attention"}}}, "layer_types[1]"},
      {{{"rope_parameters", {{"rope_type", "yarn"}, {"factor", 4.0}}}},
       "rope_parameters.rope_type"},
      {{{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}}, "rope_scaling.rope_type"},
      {{{"rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}}}},
       "rope_parameters.partial_rotary_factor"},
      {{{"rope_parameters",
         {{"full_attention", {{"rope_type", "default"}}}, {"rope_type", "default"}}}},
       "rope_parameters.full_attention"},
      {{{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}}}},
       "rope_scaling.high_freq_factor"},
      {{{"partial_rotary_factor", 0.5}}, "partial_rotary_factor"},
      {{{"num_experts", 8}}, "num_experts"},
      {{{"num_local_experts", 8}}, "num_local_experts"},
      {{{"moe_intermediate_size", 64}}, "moe_intermediate_size"},
      {{{"quantization_config", {{"quant_method", "gptq"}}}}, "quantization_config"},
      {{{"attention_dropout", 0.1}}, "attention_dropout"},
      {{{"mlp_bias", true}}, "mlp_bias"},
      {{{"hidden_act", "gelu"}}, "hidden_act"},
      {{{"model_type", "qwen3_moe"}}, "model_type"},
      {{{"head_dim", 7}}, "head_dim"},
  };
  for (const auto& [change, field] : refused) {
    auto j = base;
    j.update(change);
    expect_invalid_argument_naming([&] { LlamaConfig::from_json(j); }, field);
  }
  const std::vector<nlohmann::json> harmless = {
      {{"use_sliding_window", false}, {"sliding_window", 4096}, {"max_window_layers", 0}},
      {{"use_sliding_window", true}, {"sliding_window", nullptr}, {"max_window_layers", 0}},
      {{"use_sliding_window", true}, {"max_window_layers", 2}},  // no layer at or past 2
      {{"layer_types", {"full_attention", "full_attention"}}},
      {{"rope_scaling", nullptr}, {"attention_dropout", 0.0}, {"mlp_bias", false}},
      {{"num_experts", 0}, {"partial_rotary_factor", 1.0}, {"pretraining_tp", 1}}};
  for (const auto& change : harmless) {
    auto j = base;
    j.update(change);
    EXPECT_NO_THROW(LlamaConfig::from_json(j)) << change.dump();
  }
  // The Llama model has no sliding window: transformers ignores the field there, and so do we.
  auto llama = family_config("llama").to_json();
  llama["sliding_window"] = 16;
  EXPECT_NO_THROW(LlamaConfig::from_json(llama));
}

std::string csv_of(const torch::Tensor& t) {
  std::string csv;
  auto flat = t.reshape(-1).to(torch::kLong);
  for (int64_t i = 0; i < flat.numel(); ++i)
    csv += (i ? "," : "") + std::to_string(flat[i].item<int64_t>());
  return csv;
}

// The independent Python reference's logits of `tokens` [B, T] (with HF's attention_mask when
// given) for `model` saved as an HF directory.
torch::Tensor reference_logits(LlamaForCausalLM& model, const torch::Tensor& tokens,
                               const torch::Tensor& mask = {}) {
  const std::string dir = make_temp_dir("llama");
  models::save_llama(models::state_dict(*model), model->config(), dir);
  std::vector<std::string> args = {dir, csv_of(tokens), std::to_string(tokens.size(0)),
                                   dir + "/logits.bin"};
  if (mask.defined()) args.push_back(csv_of(mask));
  auto result = run_python_reference("llama_reference.py", args);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  auto expected = torch::zeros({tokens.size(0), tokens.size(1), model->config().vocab_size});
  std::ifstream in(dir + "/logits.bin", std::ios::binary);
  in.read(reinterpret_cast<char*>(expected.data_ptr<float>()), expected.numel() * 4);
  EXPECT_TRUE(in) << "reference logits file too short";
  return expected;
}

class LlamaReference : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaReference, LogitsMatchIndependentPythonReference) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch", "numpy"}));
  const auto c = family_config(GetParam());
  auto model = random_model(c);
  auto tokens = tokens_for(c, 2, 9);
  const auto expected = reference_logits(model, tokens);
  auto logits = model(tokens).detach();
  EXPECT_GT(expected.abs().max().item<double>(), 0.5);  // not trivially small
  EXPECT_LE((logits - expected).abs().max().item<double>(), 1e-5);

  // Left-padded rows (HF's attention_mask): padding keys hidden, positions counting each row's
  // tokens only. The padding queries' logits are never used; the reference's are compared on
  // the real positions.
  auto mask = torch::ones({3, 9}, torch::kLong);
  mask[1].narrow(0, 0, 4).zero_();
  mask[2].narrow(0, 0, 1).zero_();
  auto padded = tokens_for(c, 3, 9);
  const auto expected_padded = reference_logits(model, padded, mask);
  const auto got = model(padded, nullptr, mask).detach();
  const auto real = mask.to(torch::kBool).unsqueeze(-1);
  EXPECT_LE(((got - expected_padded) * real).abs().max().item<double>(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Families, LlamaReference,
                         ::testing::Values("llama", "qwen2", "qwen3", "llama3"));

// One layer's attention (at::scaled_dot_product_attention) against the math written out here:
// projections, Qwen3's per-head RMSNorm, the rotation by the given cos / sin, each key/value head
// repeated for its query heads, softmax(q k^T / sqrt(head_dim)) over the keys a query may see,
// then o_proj. Output and gradients to 1e-5, for every family, for the causal kernel alone and a
// per-row mask (left padding; padding queries see themselves), given as bools and as the float
// scores' bias LlamaModel builds. (KvCacheGivesTheFullForwardsLogits covers a [T, past + T] mask.)
TEST(Llama, AttentionEqualsItsMathWrittenOutWithGradients) {
  namespace F = torch::nn::functional;
  for (const auto& family : {"llama", "qwen2", "qwen3", "llama3"}) {
    SCOPED_TRACE(family);
    const auto c = family_config(family);
    auto model = random_model(c);
    auto& attn = model->model->layers[1]->self_attn;
    const int64_t B = 3, T = 7, H = c.num_attention_heads, KV = c.num_key_value_heads;
    const int64_t hd = c.attention_head_dim();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const auto x = torch::randn({B, T, c.hidden_size}, gen);
    // Any rotation angles: the attention takes cos / sin as given, per row.
    const auto angles = torch::rand({B, 1, T, hd / 2}, gen) * 6.3;
    const auto cos = torch::cat({angles.cos(), angles.cos()}, -1);
    const auto sin = torch::cat({angles.sin(), angles.sin()}, -1);
    auto reference = [&](const torch::Tensor& xs, const torch::Tensor& allowed) {
      auto heads = [&](models::lora::LoraLinear& proj, int64_t n, const models::RMSNorm& norm) {
        auto h = F::linear(xs, proj->weight, proj->bias.defined() ? proj->bias : torch::Tensor())
                     .view({B, T, n, hd});
        if (norm) {
          h = norm->weight * (h * torch::rsqrt(h.pow(2).mean(-1, true) + c.rms_norm_eps));
        }
        return h.transpose(1, 2);
      };
      auto rotate = [&](const torch::Tensor& t) {
        auto half = t.chunk(2, -1);
        return t * cos + torch::cat({-half[1], half[0]}, -1) * sin;
      };
      auto q = rotate(heads(attn->q_proj, H, attn->q_norm));
      auto k = rotate(heads(attn->k_proj, KV, attn->k_norm)).repeat_interleave(H / KV, 1);
      auto v = heads(attn->v_proj, KV, models::RMSNorm(nullptr)).repeat_interleave(H / KV, 1);
      auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(hd));
      auto probs = torch::softmax(scores.masked_fill(~allowed, -INFINITY), -1);
      auto out = torch::matmul(probs, v).transpose(1, 2).reshape({B, T, H * hd});
      return F::linear(out, attn->o_proj->weight,
                       attn->o_proj->bias.defined() ? attn->o_proj->bias : torch::Tensor());
    };
    auto causal = torch::ones({T, T}, torch::kBool).tril();
    auto valid = torch::ones({B, T}, torch::kBool);
    valid[1].narrow(0, 0, 3).fill_(false);
    valid[2].narrow(0, 0, 1).fill_(false);
    auto padded =
        ((causal.unsqueeze(0) & valid.unsqueeze(1)) | torch::eye(T, torch::kBool).unsqueeze(0))
            .unsqueeze(1);
    models::AttentionMask causal_kernel, per_row, per_row_bias;
    per_row.allowed = padded;
    per_row_bias.allowed = torch::zeros({B, 1, T, T}).masked_fill(~padded, -INFINITY);
    for (const auto& [mask, allowed] : std::vector<std::pair<models::AttentionMask, torch::Tensor>>{
             {causal_kernel, causal.expand({B, 1, T, T})},
             {per_row, padded},
             {per_row_bias, padded}}) {
      auto params = std::vector<torch::Tensor>{attn->q_proj->weight, attn->v_proj->weight};
      if (attn->k_norm) params.push_back(attn->k_norm->weight);
      const auto xg = x.clone().requires_grad_(true);
      const auto out = attn(xg, cos, sin, mask, nullptr, 0);
      const auto w = torch::randn(out.sizes(), gen);
      auto grads = torch::autograd::grad({(out * w).sum()}, {xg, params[0], params[1]});
      const auto xr = x.clone().requires_grad_(true);
      const auto expected = reference(xr, allowed);
      auto expected_grads =
          torch::autograd::grad({(expected * w).sum()}, {xr, params[0], params[1]});
      EXPECT_GT(expected.abs().max().item<double>(), 0.1);
      EXPECT_LE((out - expected).abs().max().item<double>(), 1e-5);
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_LE(relative_error(grads[i], expected_grads[i]), 1e-5) << "grad " << i;
      }
    }
  }
}

TEST(Llama, KvCacheGivesTheFullForwardsLogits) {
  const auto c = tiny_config();
  auto model = random_model(c);
  torch::NoGradGuard no_grad;
  auto tokens = tokens_for(c, 3, 10);
  auto full = model(tokens);
  models::KVCache cache;
  // A prefill, several new tokens at once after it (each sees the cache and the new ones before
  // it), then one at a time (each sees every key).
  auto first = model(tokens.narrow(1, 0, 4), &cache);
  EXPECT_EQ(cache.length(), 4);
  std::vector<torch::Tensor> parts = {first, model(tokens.narrow(1, 4, 3), &cache)};
  for (int64_t t = 7; t < 10; ++t) parts.push_back(model(tokens.narrow(1, t, 1), &cache));
  EXPECT_EQ(cache.length(), 10);
  EXPECT_LE((torch::cat(parts, 1) - full).abs().max().item<double>(), 1e-5);

  rollout::SamplingOptions greedy;
  greedy.max_new_tokens = 5;
  auto out = rollout::generate(model, tokens.narrow(1, 0, 4), greedy);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 9}));
  // Greedy with the cache equals re-running the whole prefix each time.
  for (int64_t t = 4; t < 9; ++t) {
    auto expected = model(out.narrow(1, 0, t)).select(1, -1).argmax(-1);
    EXPECT_TRUE(torch::equal(out.select(1, t), expected)) << "position " << t;
  }
}

// A cache with room for every position (HF's StaticCache, what sampling uses) gives what the
// growing one gives, and refuses a position past its capacity.
TEST(Llama, StaticKvCacheGivesTheGrowingCachesLogits) {
  const auto c = tiny_config();
  auto model = random_model(c);
  torch::NoGradGuard no_grad;
  auto tokens = tokens_for(c, 3, 10);
  models::KVCache growing, fixed(10);
  std::vector<torch::Tensor> a = {model(tokens.narrow(1, 0, 6), &growing)};
  std::vector<torch::Tensor> b = {model(tokens.narrow(1, 0, 6), &fixed)};
  for (int64_t t = 6; t < 10; ++t) {
    a.push_back(model(tokens.narrow(1, t, 1), &growing));
    b.push_back(model(tokens.narrow(1, t, 1), &fixed));
  }
  EXPECT_EQ(fixed.length(), 10);
  EXPECT_LE((torch::cat(a, 1) - torch::cat(b, 1)).abs().max().item<double>(), 1e-5);
  EXPECT_NE(expect_error([&] { model(tokens.narrow(1, 0, 1), &fixed); }).find("capacity 10"),
            std::string::npos);
}

// Packed for inference (rollout.dtype float16): fbgemm's fp16-weight GEMM computes the model
// whose linear weights are rounded to fp16, in fp32 otherwise. The reference rounds a copy's
// projection weights and runs the plain fp32 decoder, then the head with F::linear on the rounded
// head weight (the tied embeddings stay fp32 as embeddings), for a tied head (Qwen2, with biases)
// and an untied one.
TEST(Llama, PackedFp16WeightsGiveTheFp16RoundedModelsLogits) {
  auto fp16 = [](const torch::Tensor& t) { return t.to(torch::kHalf).to(torch::kFloat); };
  for (const bool qwen : {false, true}) {
    const auto c = tiny_config(qwen);
    auto model = random_model(c);
    auto rounded = random_model(c);
    torch::NoGradGuard no_grad;
    for (auto& item : rounded->named_parameters()) {
      if (item.key().find("_proj.weight") != std::string::npos)
        item.value().copy_(fp16(item.value()));
    }
    auto tokens = tokens_for(c, 3, 7);
    const auto fp32 = model(tokens);
    const auto head_weight = qwen ? rounded->model->embed_tokens->weight : rounded->lm_head->weight;
    const torch::Tensor expected = torch::nn::functional::linear(
        rounded->model(tokens, nullptr, torch::Tensor()), fp16(head_weight));
    rollout::pack_for_inference(*model, torch::kHalf);
    const auto packed = model(tokens);
    const double scale = expected.abs().max().item<double>();
    EXPECT_LE((packed - expected).abs().max().item<double>(), 1e-5 * scale) << "qwen " << qwen;
    // The rounding is visible: the packed path is the one that ran.
    EXPECT_GT((packed - fp32).abs().max().item<double>(), 1e-4 * scale) << "qwen " << qwen;
    // With the cache too, and unpacked again it is the fp32 model.
    models::KVCache cache(7);
    auto first = model(tokens.narrow(1, 0, 5), &cache);
    auto rest = model(tokens.narrow(1, 5, 2), &cache);
    EXPECT_LE((torch::cat({first, rest}, 1) - expected).abs().max().item<double>(), 1e-5 * scale);
    rollout::pack_for_inference(*model, torch::kFloat);
    EXPECT_TRUE(torch::equal(model(tokens), fp32));
  }
  const auto c = tiny_config();
  auto model = random_model(c);
  rollout::pack_for_inference(*model, torch::kHalf);
  auto tokens = tokens_for(c, 1, 3);
  EXPECT_NE(expect_error([&] { model(tokens); }).find("without grad only"), std::string::npos);
  EXPECT_NE(
      expect_error([&] { rollout::pack_for_inference(*model, torch::kBFloat16); }).find("BFloat16"),
      std::string::npos);
}

// Sampling: tokens for rows that stop early, under a sampling distribution that is not peaked.
rollout::SamplingOptions sampling_options(uint64_t seed) {
  rollout::SamplingOptions o;
  o.max_new_tokens = 8;
  o.temperature = 0.7;
  o.top_p = 0.9;
  o.generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return o;
}

TEST(Llama, SampledLogProbsEqualTeacherForcedRecompute) {
  const auto c = tiny_config();
  auto model = random_model(c);
  auto prompts = tokens_for(c, 6, 4);
  auto options = sampling_options(5);
  // An eos that some rows emit: the second row's first sampled token.
  options.eos_token_id =
      rollout::sample(model, prompts, sampling_options(5)).responses[1][0].item<int64_t>();
  options.pad_token_id = 0;
  auto rollout = rollout::sample(model, prompts, options);
  const int64_t L = rollout.responses.size(1);
  ASSERT_GT(L, 1);
  EXPECT_TRUE(torch::equal(rollout.sequences, torch::cat({prompts, rollout.responses}, 1)));

  // verl's response mask: 1 up to and including the first eos, pad and 0 after it.
  int ended = 0;
  for (int64_t r = 0; r < prompts.size(0); ++r) {
    bool done = false;
    for (int64_t t = 0; t < L; ++t) {
      EXPECT_EQ(rollout.response_mask[r][t].item<float>(), done ? 0.0f : 1.0f) << r << "," << t;
      if (done) {
        EXPECT_EQ(rollout.responses[r][t].item<int64_t>(), 0);
        EXPECT_EQ(rollout.log_probs[r][t].item<float>(), 0.0f);
      }
      done = done || rollout.responses[r][t].item<int64_t>() == options.eos_token_id;
    }
    ended += done;
  }
  EXPECT_GE(ended, 1);

  auto recomputed =
      rollout::response_log_probs(model, rollout.sequences, prompts.size(1), options.temperature);
  ASSERT_EQ(recomputed.sizes(), rollout.log_probs.sizes());
  auto diff = ((recomputed - rollout.log_probs) * rollout.response_mask).abs().max();
  EXPECT_LE(diff.item<double>(), 1e-5);
  // Real probabilities, not all 1.
  EXPECT_LT(rollout.log_probs.masked_select(rollout.response_mask > 0).max().item<double>(), 0);
}

TEST(Llama, TinyTopPIsGreedyAndSeededSamplingRepeats) {
  const auto c = tiny_config();
  auto model = random_model(c);
  auto prompts = tokens_for(c, 4, 3);
  rollout::SamplingOptions greedy;
  greedy.max_new_tokens = 8;
  auto nucleus = sampling_options(1);
  nucleus.temperature = 1.0;
  nucleus.top_p = 1e-6;
  EXPECT_TRUE(torch::equal(rollout::generate(model, prompts, nucleus),
                           rollout::generate(model, prompts, greedy)));

  auto first = rollout::sample(model, prompts, sampling_options(9));
  auto again = rollout::sample(model, prompts, sampling_options(9));
  auto other = rollout::sample(model, prompts, sampling_options(10));
  EXPECT_TRUE(torch::equal(first.sequences, again.sequences));
  EXPECT_TRUE(torch::equal(first.log_probs, again.log_probs));
  EXPECT_FALSE(torch::equal(first.sequences, other.sequences));
  EXPECT_FALSE(torch::equal(first.sequences, rollout::generate(model, prompts, greedy)));

  auto bad = sampling_options(1);
  bad.top_p = 0;
  expect_invalid_argument_naming([&] { rollout::sample(model, prompts, bad); },
                                 "SamplingOptions.top_p", "0");
  expect_invalid_argument_naming([&] { rollout::response_log_probs(model, prompts, 3, 1.0); },
                                 "prompt_length", "3");
}

// Left padding, as batched rollouts of prompts of different lengths need it: every row's logits,
// greedy continuation and log-probs are those of the row run alone, unpadded.
TEST(Llama, LeftPaddedRowsContinueAsTheyWouldAlone) {
  const auto c = tiny_config();
  auto model = random_model(c);
  const std::vector<int64_t> lengths = {3, 6, 4};
  const int64_t P = 6, pad = 0;
  auto prompts = torch::full({3, P}, pad, torch::kLong);
  auto mask = torch::zeros({3, P}, torch::kLong);
  std::vector<torch::Tensor> alone;
  for (int64_t r = 0; r < 3; ++r) {
    alone.push_back(tokens_for(c, 1, lengths[r]) + r);
    alone.back().remainder_(c.vocab_size);
    prompts[r].narrow(0, P - lengths[r], lengths[r]).copy_(alone.back()[0]);
    mask[r].narrow(0, P - lengths[r], lengths[r]).fill_(1);
  }
  torch::NoGradGuard no_grad;
  auto batched = model(prompts, nullptr, mask);
  for (int64_t r = 0; r < 3; ++r) {
    auto expected = model(alone[r])[0];
    auto got = batched[r].narrow(0, P - lengths[r], lengths[r]);
    EXPECT_LE((got - expected).abs().max().item<double>(), 1e-5) << "row " << r;
  }

  rollout::SamplingOptions greedy;
  greedy.max_new_tokens = 6;
  auto rollout = rollout::sample(model, prompts, greedy, mask);
  EXPECT_TRUE(torch::equal(rollout.attention_mask.narrow(1, 0, P), mask));
  for (int64_t r = 0; r < 3; ++r) {
    auto expected = rollout::generate(model, alone[r], greedy).narrow(1, lengths[r], 6);
    EXPECT_TRUE(torch::equal(rollout.responses[r], expected[0]))
        << "row " << r << ": " << rollout.responses[r] << " alone: " << expected[0];
  }

  auto sampled = rollout::sample(model, prompts, sampling_options(3), mask);
  auto recomputed =
      rollout::response_log_probs(model, sampled.sequences, P, 0.7, sampled.attention_mask);
  EXPECT_LE(((recomputed - sampled.log_probs) * sampled.response_mask).abs().max().item<double>(),
            1e-5);
  for (int64_t r = 0; r < 3; ++r) {
    auto row = torch::cat({alone[r][0], sampled.responses[r]}).unsqueeze(0);
    auto expected = rollout::response_log_probs(model, row, lengths[r], 0.7)[0];
    EXPECT_LE((recomputed[r] - expected).abs().max().item<double>(), 1e-5) << "row " << r;
  }
  expect_invalid_argument_naming(
      [&] { rollout::sample(model, prompts, greedy, mask.narrow(1, 0, 5)); }, "prompt_mask");
}

// The log-probs, detached, and every param's gradient of their sum where response_mask is 1.
std::pair<torch::Tensor, std::vector<torch::Tensor>> masked_log_probs_and_grads(
    models::LlamaForCausalLM& model, const torch::Tensor& log_probs,
    const torch::Tensor& response_mask) {
  model->zero_grad();
  ((log_probs * response_mask).sum()).backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return {log_probs.detach(), grads};
}

// Each gradient within 1e-5 of its reference's largest element, which must be nonzero.
void expect_same_grads(const std::vector<torch::Tensor>& got,
                       const std::vector<torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double scale = want[i].abs().max().item<double>();
    ASSERT_GT(scale, 0) << "param " << i;
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-5 * scale) << "param " << i;
  }
}

// verl's use_remove_padding: the packed log-probs, and their gradients, are the padded rows' at
// every response token that counts, for each family (per-head q/k norms, head_dim apart, GQA,
// rope scaling), with activation checkpointing; responses ending early (EOS) leave padding that
// the packed pass never computes. Attention that crosses into the sequence before changes every
// row but the first. RoPE sees only the distance between a query and a key, so positions that
// do not restart at each sequence would pass here (up to rounding): pack_sequences' positions
// are checked as such below.
TEST(Llama, PackedLogProbsAndGradsEqualThePaddedRows) {
  for (const std::string family : {"llama", "qwen3", "llama3"}) {
    SCOPED_TRACE(family);
    const auto c = family_config(family);
    auto model = random_model(c);
    model->set_activation_checkpointing(true);
    const std::vector<int64_t> prompt_lengths = {3, 6, 1, 4}, response_lengths = {5, 2, 5, 1};
    const int64_t P = 6, L = 5, B = 4;
    auto sequences = tokens_for(c, B, P + L);
    auto attention_mask = torch::ones({B, P + L}, torch::kLong);
    auto response_mask = torch::zeros({B, L});
    for (int64_t r = 0; r < B; ++r) {
      attention_mask[r].narrow(0, 0, P - prompt_lengths[r]).zero_();
      sequences[r].narrow(0, 0, P - prompt_lengths[r]).fill_(0);  // the pad token
      response_mask[r].narrow(0, 0, response_lengths[r]).fill_(1);
    }
    const double temperature = 0.7;
    auto grads_of = [&](const torch::Tensor& log_probs) {
      return masked_log_probs_and_grads(model, log_probs, response_mask);
    };
    const auto [padded, padded_grads] =
        grads_of(rollout::response_log_probs(model, sequences, P, temperature, attention_mask));
    const auto [packed, packed_grads] = grads_of(rollout::packed_response_log_probs(
        model, sequences, P, temperature, attention_mask, response_mask));
    EXPECT_LE(((packed - padded) * response_mask).abs().max().item<double>(), 1e-5);
    EXPECT_TRUE(torch::equal(packed * (1 - response_mask), torch::zeros_like(packed)));
    EXPECT_LT(packed.masked_select(response_mask > 0).max().item<double>(), 0);
    expect_same_grads(packed_grads, padded_grads);
  }

  // The packed row holds the valid tokens only, each at its position within its sequence.
  const auto tokens = torch::arange(12, torch::kLong).view({3, 4});
  const auto valid = torch::tensor({0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 0}).view({3, 4});
  const auto packed = models::pack_sequences(tokens, valid);
  EXPECT_TRUE(torch::equal(packed.tokens, torch::tensor({1, 2, 4, 5, 6, 7, 10}).unsqueeze(0)));
  EXPECT_TRUE(torch::equal(packed.position_ids, torch::tensor({0, 1, 0, 1, 2, 3, 0}).unsqueeze(0)));
  EXPECT_EQ(packed.lengths, (std::vector<int64_t>{2, 4, 1}));
  expect_invalid_argument_naming(
      [&] {
        models::pack_sequences(tokens, valid * torch::tensor({1, 0, 1}).unsqueeze(1));
      },
      "row 1", "no valid token");
}

// verl's use_prefix_grouper: consecutive rows with one prompt (a GRPO group) pack it once and
// each answer attends to that copy. The log-probs and all gradients are the padded rows', for
// each family with activation checkpointing. The rows: a left-padded group of 4 (one answer of a
// single token, one with nothing after the prompt), a group of 2, the first prompt again though
// not adjacent (packed anew), and a row alone.
TEST(Llama, PackedLogProbsWithSharedPromptsEqualThePaddedRows) {
  const int64_t P = 6, L = 5, B = 8;
  const std::vector<int64_t> group = {0, 0, 0, 0, 1, 1, 0, 2};
  const std::vector<int64_t> prompt_lengths = {4, 6, 2},
                             response_lengths = {5, 1, 3, 0, 3, 4, 2, 5};
  for (const std::string family : {"llama", "qwen3", "llama3"}) {
    SCOPED_TRACE(family);
    const auto c = family_config(family);
    auto model = random_model(c);
    model->set_activation_checkpointing(true);
    auto sequences = tokens_for(c, B, P + L);
    auto attention_mask = torch::ones({B, P + L}, torch::kLong);
    auto response_mask = torch::zeros({B, L});
    const auto prompts = tokens_for(c, 3, P);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t g = group[r], pad = P - prompt_lengths[g];
      sequences[r].narrow(0, 0, P).copy_(prompts[g]);
      sequences[r].narrow(0, 0, pad).fill_(0);  // the pad token
      attention_mask[r].narrow(0, 0, pad).zero_();
      response_mask[r].narrow(0, 0, response_lengths[r]).fill_(1);
    }
    const double temperature = 0.7;
    auto grads_of = [&](const torch::Tensor& log_probs) {
      return masked_log_probs_and_grads(model, log_probs, response_mask);
    };
    const auto [padded, padded_grads] =
        grads_of(rollout::response_log_probs(model, sequences, P, temperature, attention_mask));
    const auto [shared, shared_grads] = grads_of(rollout::packed_response_log_probs(
        model, sequences, P, temperature, attention_mask, response_mask, /*share_prompts=*/true));
    EXPECT_LE(((shared - padded) * response_mask).abs().max().item<double>(), 1e-5);
    EXPECT_TRUE(torch::equal(shared * (1 - response_mask), torch::zeros_like(shared)));
    expect_same_grads(shared_grads, padded_grads);
  }

  // The layout: rows 1 and 2 repeat row 0's prompt (tokens and padding); row 2 then holds
  // nothing and packs no sequence; row 3 differs only in its padding, so it packs its own.
  const auto tokens = torch::tensor({0, 5, 6, 1, 0, 5, 6, 2, 0, 5, 6, 0, 0, 5, 6, 3}).view({4, 4});
  const auto valid = torch::tensor({0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1}).view({4, 4});
  const auto packed = models::pack_sequences(tokens, valid, /*shared_prefix_length=*/3);
  EXPECT_TRUE(torch::equal(packed.tokens, torch::tensor({5, 6, 1, 2, 0, 5, 6, 3}).unsqueeze(0)));
  EXPECT_TRUE(
      torch::equal(packed.position_ids, torch::tensor({0, 1, 2, 2, 0, 1, 2, 3}).unsqueeze(0)));
  EXPECT_EQ(packed.lengths, (std::vector<int64_t>{3, 1, 4}));
  EXPECT_EQ(packed.shared_prefix, (std::vector<int64_t>{0, 2, 0}));
  EXPECT_TRUE(torch::equal(packed.packed_index,
                           torch::tensor({-1, 0, 1, 2, -1, 0, 1, 3, -1, 0, 1, -1, 4, 5, 6, 7})));
  // Without sharing the same rows pack one sequence each.
  EXPECT_EQ(models::pack_sequences(tokens, valid).lengths, (std::vector<int64_t>{3, 3, 2, 4}));
  expect_invalid_argument_naming([&] { models::pack_sequences(tokens, valid, 5); },
                                 "shared_prefix_length", "[0, 4]");
}

// num_return_sequences (GRPO's rollout.n): each prompt is prefilled once and its rows continue
// from copies of its cache; they are what the prompt repeated n times gives. Rows that end leave
// the batch, and the rows still running continue as they would alone.
TEST(Llama, EachPromptSampledNTimesEqualsItsRowsRepeated) {
  const auto c = tiny_config();
  auto model = random_model(c);
  const int64_t P = 5, n = 3;
  auto prompts = tokens_for(c, 2, P);
  auto mask = torch::ones({2, P}, torch::kLong);
  mask[0].narrow(0, 0, 2).fill_(0);  // row 0 is left-padded
  prompts[0].narrow(0, 0, 2).fill_(0);
  auto options = sampling_options(4);
  options.max_new_tokens = 10;
  options.num_return_sequences = n;
  auto grouped = rollout::sample(model, prompts, options, mask);
  options.num_return_sequences = 1;
  options.generator = at::make_generator<at::CPUGeneratorImpl>(4);
  auto repeated = rollout::sample(model, prompts.repeat_interleave(n, 0), options,
                                  mask.repeat_interleave(n, 0));
  EXPECT_TRUE(torch::equal(grouped.sequences, repeated.sequences));
  EXPECT_TRUE(torch::equal(grouped.attention_mask, repeated.attention_mask));
  EXPECT_LE((grouped.log_probs - repeated.log_probs).abs().max().item<double>(), 1e-5);
  // The rows of a prompt are samples, not copies.
  EXPECT_FALSE(torch::equal(grouped.responses[0], grouped.responses[1]));

  // Greedy with an eos that ends some rows early: each row is its continuation alone, cut at its
  // eos and padded after it. The eos is the token most rows emit before their last step.
  auto rows = tokens_for(c, 12, P).remainder(c.vocab_size);
  rows.narrow(0, 0, 2).copy_(prompts);
  rollout::SamplingOptions greedy;
  greedy.max_new_tokens = 10;
  auto free_running = rollout::sample(model, rows, greedy);
  std::map<int64_t, int> rows_emitting;
  for (int64_t r = 0; r < rows.size(0); ++r) {
    std::set<int64_t> seen;
    for (int64_t t = 0; t + 1 < 10; ++t) seen.insert(free_running.responses[r][t].item<int64_t>());
    for (auto token : seen) ++rows_emitting[token];
  }
  greedy.eos_token_id =
      std::max_element(rows_emitting.begin(), rows_emitting.end(), [](auto& a, auto& b) {
        return a.second < b.second;
      })->first;
  greedy.pad_token_id = 0;
  auto stopped = rollout::sample(model, rows, greedy);
  int ended_early = 0;
  for (int64_t r = 0; r < rows.size(0); ++r) {
    bool done = false;
    for (int64_t t = 0; t < stopped.responses.size(1); ++t) {
      const auto got = stopped.responses[r][t].item<int64_t>();
      EXPECT_EQ(got, done ? 0 : free_running.responses[r][t].item<int64_t>()) << r << "," << t;
      EXPECT_EQ(stopped.response_mask[r][t].item<float>(), done ? 0.0f : 1.0f) << r << "," << t;
      if (!done && got == greedy.eos_token_id && t + 1 < stopped.responses.size(1)) ++ended_early;
      done = done || got == greedy.eos_token_id;
    }
  }
  EXPECT_GE(ended_early, 2);  // enough to take rows out of the batch (an eighth of it)
  auto bad = sampling_options(1);
  bad.num_return_sequences = 0;
  expect_invalid_argument_naming([&] { rollout::sample(model, prompts, bad); },
                                 "num_return_sequences");
}

TEST(Llama, SavedWeightsLoadBack) {
  const auto c = tiny_config(true);
  auto model = random_model(c);
  const std::string dir = make_temp_dir("llama-load");
  models::save_llama(models::state_dict(*model), c, dir);
  auto loaded_config = LlamaConfig::load(dir + "/config.json");
  LlamaForCausalLM fresh(loaded_config);
  models::load_llama_weights(*fresh, dir + "/model.safetensors");
  auto tokens = tokens_for(c, 2, 5);
  EXPECT_TRUE(torch::equal(fresh(tokens), model(tokens)));
}

// Writes `params` as a weights file and returns the error loading it into a tiny model gives.
std::string load_error(std::map<std::string, torch::Tensor> params,
                       const LlamaConfig& config = tiny_config()) {
  const std::string dir = make_temp_dir("llama-bad");
  models::save_llama(params, tiny_config(), dir);
  LlamaForCausalLM model(config);
  return expect_error([&] { models::load_llama_weights(*model, dir + "/model.safetensors"); });
}

TEST(Llama, BadWeightsFilesAreErrorsNamingTheTensorOrField) {
  auto good = models::state_dict(*random_model(tiny_config()));
  auto missing = good;
  missing.erase("model.layers.1.mlp.up_proj.weight");
  EXPECT_NE(load_error(missing).find("missing tensor model.layers.1.mlp.up_proj.weight"),
            std::string::npos);

  auto extra = good;
  extra["model.layers.0.self_attn.rotary.inv_freq"] = torch::ones({4});
  EXPECT_NE(load_error(extra).find("unexpected tensor model.layers.0.self_attn.rotary.inv_freq"),
            std::string::npos);

  auto wrong_shape = good;
  wrong_shape["model.norm.weight"] = torch::ones({31});
  auto error = load_error(wrong_shape);
  EXPECT_NE(error.find("model.norm.weight"), std::string::npos) << error;
  EXPECT_NE(error.find("[31]"), std::string::npos) << error;

  struct Case {
    const char* field;
    std::function<void(LlamaConfig&)> change;
  };
  for (const auto& [field, change] : std::vector<Case>{
           {"vocab_size", [](LlamaConfig& c) { c.vocab_size = 64; }},
           {"hidden_size", [](LlamaConfig& c) { c.hidden_size = 16; }},
           {"num_key_value_heads", [](LlamaConfig& c) { c.num_key_value_heads = 4; }},
           {"intermediate_size", [](LlamaConfig& c) { c.intermediate_size = 40; }},
           {"num_hidden_layers", [](LlamaConfig& c) { c.num_hidden_layers = 3; }},
           {"attention_bias", [](LlamaConfig& c) { c.attention_bias = true; }},
           {"tie_word_embeddings", [](LlamaConfig& c) { c.tie_word_embeddings = true; }}}) {
    auto config = tiny_config();
    change(config);
    error = load_error(good, config);
    EXPECT_NE(error.find("config field " + std::string(field)), std::string::npos)
        << field << ": " << error;
  }
}

TEST(Llama, LoraTargetsHfProjectionNames) {
  LlamaForCausalLM model(tiny_config());
  models::lora::LoraConfig lora;
  lora.target_modules = {"q_proj", "v_proj"};
  auto targeted = models::lora::apply_lora(*model, lora, "default");
  EXPECT_EQ(targeted.size(), 4u);
  auto names = models::state_dict(*model);
  EXPECT_TRUE(names.count("model.layers.1.self_attn.v_proj.lora_B.default.weight"));
  // Adapters stay out of the base export.
  const std::string dir = make_temp_dir("llama-lora");
  models::save_llama(names, tiny_config(), dir);
  checkpoint::SafetensorsReader reader(dir + "/model.safetensors");
  EXPECT_EQ(reader.names().size(), 3u + 2 * 9);
}

TEST(Llama, WrapPolicyRefusesBlocksItWasNotGiven) {
  LlamaForCausalLM model(tiny_config());
  std::unordered_set<const void*> first_only = {
      static_cast<const torch::nn::Module*>(model->model->layers[0].get())};
  try {
    models::detail::check_blocks_cover_type<models::LlamaDecoderLayerImpl>(*model, first_only);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'model.layers.1'"), std::string::npos) << e.what();
  }
}

TEST(Llama, ActivationCheckpointingKeepsLossAndGradients) {
  const LlamaScenario s;
  auto plain = build_llama(s), recomputed = build_llama(s);
  recomputed->set_activation_checkpointing(true);
  expect_checkpointing_changes_nothing(plain, recomputed, llama_batch(s, 0));
}

struct LlamaRun {
  std::vector<double> losses, bytes;
  int64_t unsharded_after_forward = -1;
  std::map<std::string, torch::Tensor> params;
};

LlamaRun train_llama_sharded(const LlamaScenario& s, const std::string& from_hf = "") {
  const std::string dir = make_temp_dir("llama-train");
  std::vector<std::string> args = {"--out", dir, "--steps", std::to_string(s.steps)};
  if (!from_hf.empty()) args.insert(args.end(), {"--from-hf", from_hf});
  if (s.lora) args.push_back("--lora");
  if (s.checkpoint) args.push_back("--checkpoint");
  auto result = launch_workers(2, args, 300, "llama_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  LlamaRun run;
  if (result.exit_code != 0) return run;
  auto summary = nlohmann::json::parse(std::ifstream(dir + "/losses.json"));
  run.losses = summary["loss"].get<std::vector<double>>();
  run.bytes = summary["bytes_sent"].get<std::vector<double>>();
  run.unsharded_after_forward = summary["unsharded_after_forward"].get<int64_t>();
  run.params = read_params(dir);
  return run;
}

LlamaRun train_llama_reference(const LlamaScenario& s) {
  auto model = build_llama(s);
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_module(*model), adam);
  LlamaRun run;
  for (int64_t step = 0; step < s.steps; ++step) {
    auto tokens = llama_batch(s, step);
    optimizer->zero_grad();
    auto loss = models::next_token_loss(model(tokens), tokens);
    loss.backward();
    optimizer->step();
    run.losses.push_back(loss.item<double>());
  }
  for (auto& [name, p] : models::state_dict(*model)) run.params[name] = p.detach();
  return run;
}

void expect_same_training(const LlamaRun& sharded, const LlamaRun& reference) {
  ASSERT_EQ(sharded.losses.size(), reference.losses.size());
  for (size_t i = 0; i < reference.losses.size(); ++i) {
    EXPECT_NEAR(sharded.losses[i], reference.losses[i], 1e-5 * reference.losses[i]) << i;
  }
  ASSERT_EQ(sharded.params.size(), reference.params.size());
  for (const auto& [name, expected] : reference.params) {
    ASSERT_TRUE(sharded.params.count(name)) << name;
    EXPECT_LE(relative_error(sharded.params.at(name), expected), 1e-5) << name;
  }
}

// Built under fsdp::EmptyInit on both ranks (no param allocated unsharded, nothing drawn), loaded
// by load_hf_from_rank0 from the reference model's weights: training is the reference's.
TEST(Llama, EmptyBuildLoadedFromRankZeroTrainsAsTheUnshardedModel) {
  const LlamaScenario s;
  const std::string hf = make_temp_dir("llama-hf");
  models::save_weights(models::state_dict(*build_llama(s)), hf + "/model.safetensors",
                       torch::kFloat);
  expect_same_training(train_llama_sharded(s, hf), train_llama_reference(s));
}

TEST(Llama, ShardedTrainingOnTwoRanksMatchesUnsharded) {
  LlamaScenario s;
  auto full = train_llama_sharded(s);
  expect_same_training(full, train_llama_reference(s));
  // The wrap policy made the embeddings and the head units of their own: between forward and
  // backward only the root's final norm and the head stay gathered (the head runs first in
  // backward; torchtitan keeps it too), not the embeddings or any decoder layer.
  const auto c = llama_test_config();
  EXPECT_EQ(full.unsharded_after_forward, (c.hidden_size + c.vocab_size * c.hidden_size) * 4);
  s.lora = true;
  auto lora = train_llama_sharded(s);
  expect_same_training(lora, train_llama_reference(s));
  // Each step's traffic on 2 ranks, from the unsharded model's shapes: a param's rows split into
  // ceil(rows / 2) per rank, sent to the one peer. Every fp32 param is gathered for forward; its
  // backward reads the same rows in the ranks' host-shared image (shared memory), so nothing is
  // gathered again. The
  // reduce-scatter sends only trainable grads, each with a 4-byte "had a grad" flag: the frozen
  // base sends none.
  for (const auto* run : {&full, &lora}) {
    s.lora = run == &lora;
    double expected = 0;
    for (const auto& item : build_llama(s)->named_parameters()) {
      const auto& p = item.value();
      const int64_t rows = p.size(0), row_numel = p.numel() / rows;
      const double shard = static_cast<double>((rows + 1) / 2 * row_numel);
      expected += shard * 4;
      if (p.requires_grad()) expected += (shard + 1) * 4;
    }
    ASSERT_EQ(run->bytes.size(), static_cast<size_t>(s.steps));
    for (size_t i = 0; i < run->bytes.size(); ++i) {
      EXPECT_EQ(run->bytes[i], expected) << (s.lora ? "LoRA" : "full") << ", step " << i;
    }
  }
}

TEST(Llama, ShardedTrainingWithActivationCheckpointingMatchesUnsharded) {
  LlamaScenario s;
  s.checkpoint = true;
  auto sharded = train_llama_sharded(s);
  s.checkpoint = false;
  expect_same_training(sharded, train_llama_reference(s));
}

}  // namespace
}  // namespace shardrl::testing
