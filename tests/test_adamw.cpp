// make_adamw's optimizer steps in ATen's fused kernel. Its reference here is LibTorch's own
// torch::optim::AdamW loop, built by hand with the same groups: the parity tests cannot check the
// update, since their unsharded reference builds its optimizer with make_adamw too.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "shardrl/optim.h"

namespace shardrl::testing {
namespace {

struct Params {
  std::vector<torch::Tensor> decayed, exempt, frozen;
};

// Two tensors that decay (2-D and 3-D), a bias that does not, and a frozen matrix, on `device`.
Params make_params(const torch::Device& device) {
  torch::manual_seed(7);
  auto leaf = [&](std::vector<int64_t> shape) {
    return torch::randn(shape, torch::dtype(torch::kFloat).device(device)).requires_grad_(true);
  };
  Params p;
  p.decayed = {leaf({33, 17}), leaf({5, 3, 4})};
  p.exempt = {leaf({17})};
  p.frozen = {leaf({4, 4}).requires_grad_(false)};
  return p;
}

std::vector<optim::NamedParameter> named(const Params& p) {
  return {{"w", p.decayed[0], p.decayed[0].sizes().vec()},
          {"conv", p.decayed[1], p.decayed[1].sizes().vec()},
          {"bias", p.exempt[0], p.exempt[0].sizes().vec()},
          {"frozen", p.frozen[0], p.frozen[0].sizes().vec()}};
}

// The same grads on both sides at every step; at step 2 the bias gets none (it must not move, and
// its step count must not advance).
void set_grads(const Params& p, int step) {
  torch::manual_seed(100 + step);
  for (const auto* list : {&p.decayed, &p.exempt}) {
    for (const auto& t : *list) {
      t.mutable_grad() = torch::randn_like(t);
    }
  }
  if (step == 2) p.exempt[0].mutable_grad() = torch::Tensor();
}

void expect_fused_matches_libtorch(const torch::Device& device) {
  optim::AdamWConfig config;
  config.lr = 0.05;
  config.weight_decay = 0.1;
  config.beta1 = 0.8;
  config.beta2 = 0.95;
  config.eps = 1e-6;
  Params fused = make_params(device), loop = make_params(device);
  auto optimizer = optim::make_adamw(named(fused), config);

  auto options = torch::optim::AdamWOptions(config.lr)
                     .betas({config.beta1, config.beta2})
                     .eps(config.eps)
                     .weight_decay(config.weight_decay);
  auto no_decay = options;
  no_decay.weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(loop.decayed, std::make_unique<torch::optim::AdamWOptions>(options));
  groups.emplace_back(loop.exempt, std::make_unique<torch::optim::AdamWOptions>(no_decay));
  torch::optim::AdamW reference(std::move(groups), options);

  for (int step = 0; step < 5; ++step) {
    if (step == 3) {
      // An LR scheduler writes the group's options; the next step must use the new lr.
      for (auto* opt : std::vector<torch::optim::Optimizer*>{optimizer.get(), &reference}) {
        for (auto& group : opt->param_groups()) {
          static_cast<torch::optim::AdamWOptions&>(group.options()).lr(0.01);
        }
      }
    }
    set_grads(fused, step);
    set_grads(loop, step);
    optimizer->step();
    reference.step();
  }
  const std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs = {
      {fused.decayed[0], loop.decayed[0]},
      {fused.decayed[1], loop.decayed[1]},
      {fused.exempt[0], loop.exempt[0]}};
  for (const auto& [got, want] : pairs) {
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6))
        << "max abs diff " << (got - want).abs().max().item<double>();
    auto* got_state = optim::find_state(*optimizer, got);
    auto* want_state = optim::find_state(reference, want);
    ASSERT_NE(got_state, nullptr);
    ASSERT_NE(want_state, nullptr);
    const auto& g = static_cast<const torch::optim::AdamWParamState&>(*got_state);
    const auto& w = static_cast<const torch::optim::AdamWParamState&>(*want_state);
    EXPECT_EQ(g.step(), w.step());
    EXPECT_TRUE(torch::allclose(g.exp_avg(), w.exp_avg(), 1e-5, 1e-7));
    EXPECT_TRUE(torch::allclose(g.exp_avg_sq(), w.exp_avg_sq(), 1e-5, 1e-9));
    EXPECT_EQ(g.exp_avg().device(), got.device());
  }
  EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(
                *optim::find_state(*optimizer, fused.exempt[0]))
                .step(),
            4);
  EXPECT_EQ(optim::find_state(*optimizer, fused.frozen[0]), nullptr);
}

TEST(AdamW, FusedStepMatchesLibTorchLoop) {
  expect_fused_matches_libtorch(torch::kCPU);
}

TEST(AdamW, FusedStepMatchesLibTorchLoopOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU visible";
  expect_fused_matches_libtorch(torch::Device(torch::kCUDA, 0));
}

}  // namespace
}  // namespace shardrl::testing
