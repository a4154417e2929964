// AdamW's weight-decay grouping, checked against groups written out by name: every parity
// reference builds its optimizer with make_adamw too, so its no-decay rule (biases, norms, 1-D
// params) is checked here alone, independently of the rule's own code.
#include <gtest/gtest.h>

#include <set>
#include <unordered_map>

#include "shardrl/models/dit.h"
#include "shardrl/models/llama.h"
#include "shardrl/optim.h"
#include "workers/dit_scenario.h"
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

// The patch conv, the timestep MLP, the class table and every linear's weight decay; every bias
// does not (DiT's LayerNorms carry no params).
TEST(WeightDecay, DiTGroupsByName) {
  const auto config = dit_test_config();
  ASSERT_EQ(config.depth, 2);
  models::DiT model(config);
  const auto groups = groups_of(*model);
  EXPECT_EQ(groups.decay,
            joined({"x_embedder.proj.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight",
                    "y_embedder.embedding_table.weight", "final_layer.linear.weight",
                    "final_layer.adaLN_modulation.1.weight"},
                   per_layer(2, {"blocks.{}.attn.qkv.weight", "blocks.{}.attn.proj.weight",
                                 "blocks.{}.mlp.fc1.weight", "blocks.{}.mlp.fc2.weight",
                                 "blocks.{}.adaLN_modulation.1.weight"})));
  EXPECT_EQ(groups.no_decay,
            joined({"x_embedder.proj.bias", "t_embedder.mlp.0.bias", "t_embedder.mlp.2.bias",
                    "final_layer.linear.bias", "final_layer.adaLN_modulation.1.bias"},
                   per_layer(2, {"blocks.{}.attn.qkv.bias", "blocks.{}.attn.proj.bias",
                                 "blocks.{}.mlp.fc1.bias", "blocks.{}.mlp.fc2.bias",
                                 "blocks.{}.adaLN_modulation.1.bias"})));
}

}  // namespace
}  // namespace shardrl::testing
