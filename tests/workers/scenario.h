// The training scenario shared by the multi-rank worker and the in-process reference, so both
// build the same model and see the same data.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shardrl/models/transformer.h"

namespace shardrl::testing {

struct Scenario {
  int64_t steps = 3;
  int64_t batch = 12;  // global batch, divisible by every dp size x micro-batches used
  int64_t seq = 16;
  int64_t micro = 1;  // micro-batches per step (gradient accumulation)
  int64_t layers = 2;
  int64_t d_model = 48;
  double lr = 1e-2;
  double max_norm = 0.0;
  uint64_t seed = 1234;
  bool unused_params = false;  // add params that never get a grad (root and a block)
  std::string freeze;          // params whose name contains this are frozen
  int64_t nan_step = -1;       // this step's loss is NaN: its optimizer step must be skipped
};

inline models::TransformerConfig model_config(const Scenario& s) {
  models::TransformerConfig c;
  c.n_layers = s.layers;
  c.d_model = s.d_model;
  c.max_seq_len = s.seq;
  return c;
}

inline models::Transformer build_model(const Scenario& s) {
  torch::manual_seed(s.seed);
  models::Transformer model(model_config(s));
  if (s.unused_params) {
    // Through new_parameter, so they are built empty under fsdp::EmptyInit like the layers' own.
    auto randn = [](torch::Tensor& t) { t.normal_(); };
    model->register_parameter("unused_root", fsdp::new_parameter({5, 3}, randn));
    model->blocks()[0]->register_parameter("unused_in_block", fsdp::new_parameter({7}, randn));
  }
  if (!s.freeze.empty()) {
    for (auto& item : model->named_parameters()) {
      if (item.key().find(s.freeze) != std::string::npos) item.value().set_requires_grad(false);
    }
  }
  return model;
}

inline torch::Tensor global_batch(const Scenario& s, int64_t step, int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(s.seed * 1000 + step);
  return torch::randint(vocab, {s.batch, s.seq}, gen, torch::kLong);
}

}  // namespace shardrl::testing
