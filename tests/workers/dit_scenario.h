// The DiT flow-matching training scenario shared by model_worker and the in-process reference in
// tests/test_dit.cpp, so both build the same model and see the same data.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/models/dit.h"

namespace shardrl::testing {

struct DiTScenario {
  int64_t steps = 3;
  int64_t batch = 8;  // global batch, split evenly over the ranks
  double lr = 1e-3;
  uint64_t seed = 21;
};

inline models::DiTConfig dit_test_config() {
  models::DiTConfig c;
  c.input_size = 8;
  c.patch_size = 2;
  c.in_channels = 2;
  c.hidden_size = 32;
  c.depth = 2;
  c.num_heads = 4;
  c.num_classes = 5;
  c.frequency_embedding_size = 32;
  return c;
}

// adaLN-Zero starts every block as the identity; a small random start makes every param matter
// from the first step.
inline models::DiT build_dit(const DiTScenario& s) {
  torch::manual_seed(s.seed);
  models::DiT model(dit_test_config());
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    if (item.key().find("adaLN_modulation") != std::string::npos ||
        item.key().find("final_layer.linear") != std::string::npos) {
      item.value().normal_(0, 0.05);
    }
  }
  return model;
}

struct FlowBatch {
  torch::Tensor xt, t, y, target;
};

// Rectified flow: x_t = (1 - t) noise + t data, velocity target data - noise; a tenth of the
// labels are the null class, as in CFG training.
inline FlowBatch dit_batch(const DiTScenario& s, int64_t step) {
  const auto c = dit_test_config();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 1000 + step);
  auto data = torch::randn({s.batch, c.in_channels, c.input_size, c.input_size}, gen);
  auto noise = torch::randn(data.sizes(), gen);
  auto t = torch::rand({s.batch}, gen);
  auto y = torch::randint(c.num_classes, {s.batch}, gen, torch::kLong);
  y = models::drop_labels(y, c.num_classes, 0.1, gen);
  auto tt = t.view({-1, 1, 1, 1});
  return {(1 - tt) * noise + tt * data, t, y, data - noise};
}

}  // namespace shardrl::testing
