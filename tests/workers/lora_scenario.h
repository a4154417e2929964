// The LoRA training scenario shared by lora_worker and the in-process reference in
// tests/test_lora.cpp: a residual MLP whose blocks are FSDP units, with LoRA on every projection.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/fsdp.h"
#include "shardrl/models/lora.h"

namespace shardrl::testing {

struct LoraScenario {
  int64_t steps = 3;
  int64_t batch = 8;  // global batch, split evenly over the ranks
  int64_t d_model = 12, hidden = 20, out = 7, blocks = 2;
  double lr = 1e-2, ema_decay = 0.9;
  uint64_t seed = 77;
};

class LoraBlockImpl : public torch::nn::Module {
 public:
  explicit LoraBlockImpl(const LoraScenario& s) {
    fc1 = register_module("fc1", models::lora::LoraLinear(s.d_model, s.hidden));
    fc2 = register_module("fc2", models::lora::LoraLinear(s.hidden, s.d_model));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  models::lora::LoraLinear fc1{nullptr}, fc2{nullptr};
};

class LoraNetImpl : public torch::nn::Module {
 public:
  explicit LoraNetImpl(const LoraScenario& s) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.blocks; ++i) {
      blocks.emplace_back(s);
      list->push_back(blocks.back().ptr());
    }
    head = register_module("head", models::lora::LoraLinear(s.d_model, s.out));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  std::vector<fsdp::Unit<LoraBlockImpl>> blocks;
  models::lora::LoraLinear head{nullptr};
};

inline models::lora::LoraConfig lora_config() {
  models::lora::LoraConfig c;
  c.r = 4;
  c.alpha = 8;
  c.target_modules = {"fc1", "fc2", "head"};
  return c;
}

// "default" trains; "old" is a frozen copy that follows it by EMA after each step.
inline fsdp::Unit<LoraNetImpl> build_lora_net(const LoraScenario& s) {
  torch::manual_seed(s.seed);
  fsdp::Unit<LoraNetImpl> net(s);
  models::lora::apply_lora(*net, lora_config(), "default");
  models::lora::apply_lora(*net, lora_config(), "old", /*trainable=*/false);
  return net;
}

// Inputs and targets of one global step.
inline std::pair<torch::Tensor, torch::Tensor> lora_batch(const LoraScenario& s, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 1000 + step);
  auto x = torch::randn({s.batch, s.d_model}, gen);
  auto y = torch::randn({s.batch, s.out}, gen);
  return {x, y};
}

}  // namespace shardrl::testing
