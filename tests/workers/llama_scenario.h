// The LLaMA training scenario shared by llama_worker and the in-process reference in
// tests/test_llama.cpp.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/models/llama.h"

namespace shardrl::testing {

struct LlamaScenario {
  int64_t steps = 3;
  int64_t batch = 4, seq = 12;  // global batch, split evenly over the ranks
  double lr = 1e-2;
  uint64_t seed = 8;
  bool lora = false;        // train q/v adapters on a frozen base instead of the whole model
  bool checkpoint = false;  // activation checkpointing per decoder layer
};

inline models::LlamaConfig llama_test_config() {
  models::LlamaConfig c;
  c.vocab_size = 61;  // rows that do not split evenly over 2 ranks
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  return c;
}

inline models::LlamaForCausalLM build_llama(const LlamaScenario& s) {
  torch::manual_seed(s.seed);
  models::LlamaForCausalLM model(llama_test_config());
  model->set_activation_checkpointing(s.checkpoint);
  if (s.lora) {
    models::lora::LoraConfig lora;
    lora.r = 4;
    lora.target_modules = {"q_proj", "v_proj"};
    models::lora::apply_lora(*model, lora, "default");
    torch::NoGradGuard no_grad;  // a non-zero B, so the base output is not the adapter's
    for (auto& [name, layer] : models::lora::lora_linears(*model)) {
      if (layer->has_adapter("default")) layer->lora_B("default").normal_(0, 0.1);
    }
  }
  return model;
}

inline torch::Tensor llama_batch(const LlamaScenario& s, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 1000 + step);
  return torch::randint(llama_test_config().vocab_size, {s.batch, s.seq}, gen, torch::kLong);
}

}  // namespace shardrl::testing
