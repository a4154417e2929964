// AdamW's weight-decay grouping, checked against groups written out by name: every parity
// reference builds its optimizer with make_adamw too, so its no-decay rule (biases, norms, 1-D
// params) is checked here alone, independently of the rule's own code.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <set>
#include <unordered_map>

#include "shardrl/models/llama.h"
#include "shardrl/models/sd3.h"
#include "shardrl/optim.h"
#include "workers/llama_scenario.h"

namespace shardrl::testing {
namespace {

struct Groups {
  std::set<std::string> decay, no_decay;
};

// The parameter names in each of make_adamw's groups, told apart by the weight decay the group
// applies.
Groups groups_of(const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : model.named_parameters()) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  optim::AdamWConfig config;
  config.weight_decay = 0.1;
  auto adamw = optim::make_adamw(optim::from_module(model), config);
  Groups groups;
  for (const auto& group : adamw->param_groups()) {
    const double decay =
        static_cast<const torch::optim::AdamWOptions&>(group.options()).weight_decay();
    EXPECT_TRUE(decay == 0.1 || decay == 0.0) << decay;
    for (const auto& p : group.params()) {
      const std::string& name = names.at(p.unsafeGetTensorImpl());
      EXPECT_TRUE((decay > 0 ? groups.decay : groups.no_decay).insert(name).second)
          << name << " is in two groups";
    }
  }
  return groups;
}

// The same `names` for layers 0..layers-1: "model.layers.{}.x" -> model.layers.0.x, ...
std::set<std::string> per_layer(int layers, const std::vector<std::string>& names) {
  std::set<std::string> out;
  for (int i = 0; i < layers; ++i) {
    for (const auto& name : names) {
      const auto at = name.find("{}");
      out.insert(name.substr(0, at) + std::to_string(i) + name.substr(at + 2));
    }
  }
  return out;
}

std::set<std::string> joined(std::set<std::string> a, const std::set<std::string>& b) {
  a.insert(b.begin(), b.end());
  return a;
}

// Matrices and embeddings decay; RMSNorm weights do not, nor the attention biases (HF's
// LlamaAttention with attention_bias has them on q, k, v and o).
TEST(WeightDecay, LlamaGroupsByName) {
  for (const bool attention_bias : {false, true}) {
    SCOPED_TRACE(attention_bias ? "attention_bias" : "no bias");
    auto config = llama_test_config();
    config.attention_bias = attention_bias;
    ASSERT_EQ(config.num_hidden_layers, 2);
    models::LlamaForCausalLM model(config);
    const auto groups = groups_of(*model);
    EXPECT_EQ(groups.decay, joined({"model.embed_tokens.weight", "lm_head.weight"},
                                   per_layer(2, {"model.layers.{}.self_attn.q_proj.weight",
                                                 "model.layers.{}.self_attn.k_proj.weight",
                                                 "model.layers.{}.self_attn.v_proj.weight",
                                                 "model.layers.{}.self_attn.o_proj.weight",
                                                 "model.layers.{}.mlp.gate_proj.weight",
                                                 "model.layers.{}.mlp.up_proj.weight",
                                                 "model.layers.{}.mlp.down_proj.weight"})));
    std::set<std::string> no_decay = joined(
        {"model.norm.weight"}, per_layer(2, {"model.layers.{}.input_layernorm.weight",
                                             "model.layers.{}.post_attention_layernorm.weight"}));
    if (attention_bias) {
      no_decay = joined(no_decay, per_layer(2, {"model.layers.{}.self_attn.q_proj.bias",
                                                "model.layers.{}.self_attn.k_proj.bias",
                                                "model.layers.{}.self_attn.v_proj.bias",
                                                "model.layers.{}.self_attn.o_proj.bias"}));
    }
    EXPECT_EQ(groups.no_decay, no_decay);
  }
}

// LoRA on a frozen base: only the adapters are stepped, and their matrices decay.
TEST(WeightDecay, LlamaLoraGroupsByName) {
  LlamaScenario s;
  s.lora = true;
  auto model = build_llama(s);
  const auto groups = groups_of(*model);
  EXPECT_EQ(groups.decay, per_layer(2, {"model.layers.{}.self_attn.q_proj.lora_A.default.weight",
                                        "model.layers.{}.self_attn.q_proj.lora_B.default.weight",
                                        "model.layers.{}.self_attn.v_proj.lora_A.default.weight",
                                        "model.layers.{}.self_attn.v_proj.lora_B.default.weight"}));
  EXPECT_TRUE(groups.no_decay.empty()) << *groups.no_decay.begin();
}

// diffusers' SD3 transformer with SD3.5's qk_norm: every linear's and the patch conv's weight
// decays, adaLN's modulation matrices (`norm1.linear`, `norm_out.linear`) among them; biases and
// the RMSNorm scales do not (its LayerNorms carry no params). The last block is context_pre_only:
// no to_add_out and no ff_context.
TEST(WeightDecay, SD3GroupsByName) {
  models::SD3Config config;
  config.sample_size = 8;
  config.in_channels = config.out_channels = 1;
  config.num_layers = 2;
  config.attention_head_dim = 8;
  config.num_attention_heads = 2;
  config.joint_attention_dim = 12;
  config.caption_projection_dim = 16;
  config.pooled_projection_dim = 12;
  config.pos_embed_max_size = 4;
  config.qk_norm = "rms_norm";
  models::SD3Transformer2DModel model(config);
  const auto groups = groups_of(*model);
  const std::vector<std::string> root = {"pos_embed.proj.",
                                         "time_text_embed.timestep_embedder.linear_1.",
                                         "time_text_embed.timestep_embedder.linear_2.",
                                         "time_text_embed.text_embedder.linear_1.",
                                         "time_text_embed.text_embedder.linear_2.",
                                         "context_embedder.",
                                         "norm_out.linear.",
                                         "proj_out."};
  std::vector<std::string> both = {
      "transformer_blocks.{}.norm1.linear.",    "transformer_blocks.{}.norm1_context.linear.",
      "transformer_blocks.{}.attn.to_q.",       "transformer_blocks.{}.attn.to_k.",
      "transformer_blocks.{}.attn.to_v.",       "transformer_blocks.{}.attn.to_out.0.",
      "transformer_blocks.{}.attn.add_q_proj.", "transformer_blocks.{}.attn.add_k_proj.",
      "transformer_blocks.{}.attn.add_v_proj.", "transformer_blocks.{}.ff.net.0.proj.",
      "transformer_blocks.{}.ff.net.2."};
  const std::vector<std::string> first_only = {"transformer_blocks.0.attn.to_add_out.",
                                               "transformer_blocks.0.ff_context.net.0.proj.",
                                               "transformer_blocks.0.ff_context.net.2."};
  std::set<std::string> decay, no_decay;
  auto add = [&](const std::string& module) {
    decay.insert(module + "weight");
    no_decay.insert(module + "bias");
  };
  for (const auto& m : root) add(m);
  for (const auto& m : first_only) add(m);
  for (int layer = 0; layer < 2; ++layer) {
    for (auto m : both) add(m.replace(m.find("{}"), 2, std::to_string(layer)));
    for (const char* norm : {"norm_q", "norm_k", "norm_added_q", "norm_added_k"}) {
      no_decay.insert(fmt::format("transformer_blocks.{}.attn.{}.weight", layer, norm));
    }
  }
  EXPECT_EQ(groups.decay, decay);
  EXPECT_EQ(groups.no_decay, no_decay);
}

}  // namespace
}  // namespace shardrl::testing
