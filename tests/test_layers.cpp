// models/layers.h: torch::nn's Linear, Embedding, LayerNorm and Conv2d, buildable under
// fsdp::EmptyInit.
#include <gtest/gtest.h>

#include "shardrl/fsdp.h"
#include "shardrl/models/layers.h"
#include "shardrl/models/lora.h"

namespace shardrl::testing {
namespace {

// The same seed gives torch::nn's values: models built from these layers keep their initial
// weights (and every figure measured from them) from before the switch.
TEST(Layers, InitialiseAndComputeAsTorchNn) {
  auto x = torch::randn({4, 6});
  for (bool bias : {true, false}) {
    torch::manual_seed(3);
    torch::nn::Linear theirs(torch::nn::LinearOptions(6, 5).bias(bias));
    torch::manual_seed(3);
    models::Linear ours(torch::nn::LinearOptions(6, 5).bias(bias));
    EXPECT_TRUE(torch::equal(ours->weight, theirs->weight));
    EXPECT_EQ(ours->bias.defined(), bias);
    if (bias) {
      EXPECT_TRUE(torch::equal(ours->bias, theirs->bias));
    }
    EXPECT_EQ(ours->named_parameters().size(), theirs->named_parameters().size());
    EXPECT_TRUE(torch::equal(ours(x), theirs(x)));
  }
  torch::manual_seed(4);
  torch::nn::Embedding their_table(10, 6);
  torch::manual_seed(4);
  models::Embedding our_table(10, 6);
  EXPECT_TRUE(torch::equal(our_table->weight, their_table->weight));
  auto ids = torch::tensor({{1, 9}, {0, 3}}, torch::kLong);
  EXPECT_TRUE(torch::equal(our_table(ids), their_table(ids)));

  torch::nn::LayerNorm their_norm(torch::nn::LayerNormOptions({6}));
  models::LayerNorm our_norm(6);
  {
    torch::NoGradGuard no_grad;  // non-trivial affine params on both
    for (auto* norm : {&their_norm->weight, &their_norm->bias}) norm->uniform_(-1, 1);
    our_norm->weight.copy_(their_norm->weight);
    our_norm->bias.copy_(their_norm->bias);
  }
  EXPECT_TRUE(torch::allclose(our_norm(x), their_norm(x), 0, 1e-6));

  torch::manual_seed(5);
  torch::nn::Conv2d their_conv(torch::nn::Conv2dOptions(3, 8, 2).stride(2));
  torch::manual_seed(5);
  models::Conv2d our_conv(3, 8, 2, 2);
  EXPECT_TRUE(torch::equal(our_conv->weight, their_conv->weight));
  EXPECT_TRUE(torch::equal(our_conv->bias, their_conv->bias));
  auto images = torch::randn({2, 3, 6, 6});
  EXPECT_TRUE(torch::allclose(our_conv(images), their_conv(images), 0, 1e-6));
}

// Under EmptyInit a param has its shape and no bytes, its initialiser does not run (no random
// numbers are drawn), and using it unsharded is an error rather than a read of garbage.
TEST(Layers, EmptyInitGivesShapesWithoutBytesOrRandomDraws) {
  torch::manual_seed(11);
  const auto first_draw = torch::rand({1});
  torch::manual_seed(11);
  models::lora::LoraLinear layer{nullptr};
  {
    fsdp::EmptyInit empty;
    {
      fsdp::EmptyInit nested;  // leaving an inner scope keeps the outer one
    }
    layer = models::lora::LoraLinear(torch::nn::LinearOptions(64, 32));
  }
  EXPECT_TRUE(torch::equal(torch::rand({1}), first_draw));
  for (const auto& item : layer->named_parameters()) {
    EXPECT_EQ(item.value().storage().nbytes(), 0u) << item.key();
  }
  EXPECT_EQ(layer->weight.sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(layer->bias.sizes(), (std::vector<int64_t>{32}));
  EXPECT_THROW(layer(torch::ones({2, 64})), c10::Error);

  // Adapters are allocated and drawn as usual on an empty base; outside the scope, so is the base.
  models::lora::LoraConfig config;
  config.r = 4;
  layer->add_adapter("default", config);
  EXPECT_GT(layer->lora_A("default").storage().nbytes(), 0u);
  EXPECT_GT(layer->lora_A("default").abs().max().item<float>(), 0);
  models::Linear eager(8, 4);
  EXPECT_GT(eager->weight.storage().nbytes(), 0u);
  models::zero_unless_empty(eager->weight);
  EXPECT_EQ(eager->weight.abs().max().item<float>(), 0);
  models::zero_unless_empty(layer->weight);  // nothing to zero, and no error
}

}  // namespace
}  // namespace shardrl::testing
