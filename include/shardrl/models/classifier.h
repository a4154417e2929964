// A small CNN image classifier: the reward model of the diffusion RL demos ("make the sample an
// unmistakable X" = the classifier's probability of class X). It is an fsdp::Unit, so it trains
// data-parallel with the same sharding as the generator, and runs unsharded as a plain module.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <string>

#include "shardrl/fsdp.h"

namespace shardrl::models {

struct ClassifierConfig {
  int64_t input_size = 28;  // square images, >= 4 (two 2x2 poolings, rounding down)
  int64_t in_channels = 1;
  int64_t channels = 16;  // first conv; the second has twice as many
  int64_t hidden = 64;
  int64_t num_classes = 10;
  void validate() const;  // errors name the field
  nlohmann::json to_json() const;
  static ClassifierConfig from_json(const nlohmann::json& j);
};

// conv3x3 -> ReLU -> maxpool2 -> conv3x3 -> ReLU -> maxpool2 -> linear -> ReLU -> linear.
class ImageClassifierImpl : public torch::nn::Module {
 public:
  explicit ImageClassifierImpl(const ClassifierConfig& config);
  // x [N, C, H, W] in [-1, 1] -> logits [N, num_classes].
  torch::Tensor forward(torch::Tensor x);
  const ClassifierConfig& config() const { return config_; }

 private:
  ClassifierConfig config_;
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
using ImageClassifier = fsdp::Unit<ImageClassifierImpl>;

struct ClassifierLoss {
  torch::Tensor loss;      // cross entropy, with grad
  torch::Tensor accuracy;  // detached 0-dim
};
ClassifierLoss classifier_loss(ImageClassifier& model, const torch::Tensor& images,
                               const torch::Tensor& labels);

// Fraction of correct argmax predictions, in batches, without grad.
double classifier_accuracy(ImageClassifier& model, const torch::Tensor& images,
                           const torch::Tensor& labels, int64_t batch = 1000);

// The reward of generating `images` for classes `labels`: mode "prob" (softmax probability of
// the label, in [0, 1]) or "log_prob". No grad. [N] fp32.
torch::Tensor classifier_reward(ImageClassifier& model, const torch::Tensor& images,
                                const torch::Tensor& labels, const std::string& mode = "prob");

// A second reward model, one that no noise image satisfies: how closely an image matches a real
// image of its class, as the largest Pearson correlation between its pixels and those of a bank
// of real examples of that class (clamped at 0). A classifier can be fooled by texture (the demo's
// "sandal" noise scored 1.0); a correlation with a real sandal needs its shape. Used beside the
// classifier (verl-omni's reward.reward_functions, a weighted sum), it keeps RL from gaming the
// classifier.
class NearestExampleScorer {
 public:
  // The bank: the first `per_class` images [N, C, H, W] of each class in `labels` [N].
  NearestExampleScorer(const torch::Tensor& images, const torch::Tensor& labels,
                       int64_t num_classes, int64_t per_class);
  // [N] fp32 in [0, 1] for images [N, C, H, W] meant as classes `labels` [N]. No grad.
  torch::Tensor score(const torch::Tensor& images, const torch::Tensor& labels) const;
  int64_t per_class() const { return bank_.size(1); }

 private:
  torch::Tensor bank_;  // [classes, per_class, pixels]: centred, unit norm
};

struct ClassifierFitOptions {
  int64_t steps = 400;
  int64_t global_batch = 128;  // split over the ranks by data::DistributedSampler
  double lr = 2e-3;
  double weight_decay = 1e-4;
  uint64_t seed = 0;
  // Called every log_every steps (and at the last) with (step, loss, accuracy) of the batch,
  // averaged over the ranks.
  int64_t log_every = 100;
  std::function<void(int64_t, double, double)> log;
};

// Trains with AdamW and a cosine schedule. A sharded model (fully_shard on its root) trains
// data-parallel: every rank must call this with the same options and its own rank; an unsharded
// one trains on the whole batch locally (rank 0 of 1).
void fit_classifier(ImageClassifier& model, const torch::Tensor& images,
                    const torch::Tensor& labels, const ClassifierFitOptions& options);

}  // namespace shardrl::models
