#include "shardrl/models/classifier.h"

#include <fmt/format.h>

#include "models/json_fields.h"
#include "shardrl/data.h"
#include "shardrl/lr_schedule.h"
#include "shardrl/optim.h"

namespace shardrl::models {

namespace nn = torch::nn;

void ClassifierConfig::validate() const {
  detail::require_positive(input_size, "input_size");
  detail::require_positive(in_channels, "in_channels");
  detail::require_positive(channels, "channels");
  detail::require_positive(hidden, "hidden");
  detail::require_positive(num_classes, "num_classes");
  if (input_size < 4) {
    throw std::invalid_argument(
        fmt::format("config: input_size {} must be >= 4 (two 2x2 poolings)", input_size));
  }
}

nlohmann::json ClassifierConfig::to_json() const {
  return {{"model_type", "image_classifier"},
          {"input_size", input_size},
          {"in_channels", in_channels},
          {"channels", channels},
          {"hidden", hidden},
          {"num_classes", num_classes}};
}

ClassifierConfig ClassifierConfig::from_json(const nlohmann::json& j) {
  ClassifierConfig c;
  detail::read_field(j, "input_size", c.input_size, true);
  detail::read_field(j, "in_channels", c.in_channels, true);
  detail::read_field(j, "channels", c.channels, true);
  detail::read_field(j, "hidden", c.hidden, true);
  detail::read_field(j, "num_classes", c.num_classes, true);
  c.validate();
  return c;
}

ImageClassifierImpl::ImageClassifierImpl(const ClassifierConfig& c) : config_(c) {
  c.validate();
  conv1_ = register_module("conv1",
                           nn::Conv2d(nn::Conv2dOptions(c.in_channels, c.channels, 3).padding(1)));
  conv2_ = register_module("conv2",
                           nn::Conv2d(nn::Conv2dOptions(c.channels, 2 * c.channels, 3).padding(1)));
  const int64_t pooled = c.input_size / 4;
  fc1_ = register_module("fc1", nn::Linear(2 * c.channels * pooled * pooled, c.hidden));
  fc2_ = register_module("fc2", nn::Linear(c.hidden, c.num_classes));
}

torch::Tensor ImageClassifierImpl::forward(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == config_.in_channels && x.size(2) == config_.input_size &&
                  x.size(3) == config_.input_size,
              "ImageClassifier: x must be [N, ", config_.in_channels, ", ", config_.input_size,
              ", ", config_.input_size, "], got ", x.sizes());
  x = torch::max_pool2d(torch::relu(conv1_(x)), 2);
  x = torch::max_pool2d(torch::relu(conv2_(x)), 2);
  return fc2_(torch::relu(fc1_(x.flatten(1))));
}

ClassifierLoss classifier_loss(ImageClassifier& model, const torch::Tensor& images,
                               const torch::Tensor& labels) {
  auto logits = model(images);
  auto accuracy = (logits.detach().argmax(1) == labels).to(torch::kFloat).mean();
  return {torch::cross_entropy_loss(logits.to(torch::kFloat), labels), accuracy};
}

double classifier_accuracy(ImageClassifier& model, const torch::Tensor& images,
                           const torch::Tensor& labels, int64_t batch) {
  torch::NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t i = 0; i < images.size(0); i += batch) {
    const int64_t n = std::min(batch, images.size(0) - i);
    auto pred = model(images.narrow(0, i, n)).argmax(1);
    correct += (pred == labels.narrow(0, i, n)).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(images.size(0), 1));
}

torch::Tensor classifier_reward(ImageClassifier& model, const torch::Tensor& images,
                                const torch::Tensor& labels, const std::string& mode) {
  if (mode != "prob" && mode != "log_prob") {
    throw std::invalid_argument(
        fmt::format("reward_mode: unknown value \"{}\" (expected one of: prob log_prob)", mode));
  }
  torch::NoGradGuard no_grad;
  auto logp = torch::log_softmax(model(images).to(torch::kFloat), 1)
                  .gather(1, labels.to(torch::kLong).unsqueeze(1))
                  .squeeze(1);
  return mode == "prob" ? logp.exp() : logp;
}

namespace {
// Rows [N, ...] flattened, centred and scaled to unit norm: their dot products are correlations.
// A constant image (norm 0) stays 0 and correlates with nothing.
torch::Tensor standardized(const torch::Tensor& images) {
  auto x = images.detach().to(torch::kFloat).flatten(1);
  x = x - x.mean(1, /*keepdim=*/true);
  return x / x.norm(2, 1, /*keepdim=*/true).clamp_min(1e-8);
}
}  // namespace

NearestExampleScorer::NearestExampleScorer(const torch::Tensor& images, const torch::Tensor& labels,
                                           int64_t num_classes, int64_t per_class) {
  if (per_class < 1) {
    throw std::invalid_argument(fmt::format("bank_per_class: must be >= 1, got {}", per_class));
  }
  torch::NoGradGuard no_grad;
  const auto y = labels.to(torch::kLong);
  std::vector<torch::Tensor> banks;
  for (int64_t c = 0; c < num_classes; ++c) {
    auto idx = (y == c).nonzero().reshape({-1});
    if (idx.size(0) < per_class) {
      throw std::invalid_argument(fmt::format(
          "bank_per_class: class {} has {} images, fewer than {}", c, idx.size(0), per_class));
    }
    banks.push_back(standardized(images.index_select(0, idx.narrow(0, 0, per_class))));
  }
  bank_ = torch::stack(banks);
}

torch::Tensor NearestExampleScorer::score(const torch::Tensor& images,
                                          const torch::Tensor& labels) const {
  torch::NoGradGuard no_grad;
  auto x = standardized(images.to(bank_.device()));
  if (x.size(1) != bank_.size(2)) {
    throw std::invalid_argument(
        fmt::format("images: {} pixels each, the bank's have {}", x.size(1), bank_.size(2)));
  }
  auto bank = bank_.index_select(0, labels.to(bank_.device(), torch::kLong));  // [N, K, D]
  auto corr = torch::bmm(bank, x.unsqueeze(2)).squeeze(2);                     // [N, K]
  return std::get<0>(corr.max(1)).clamp_min(0.0);
}

void fit_classifier(ImageClassifier& model, const torch::Tensor& images,
                    const torch::Tensor& labels, const ClassifierFitOptions& options) {
  const bool sharded = model.is_sharded();
  int64_t rank = 0, world = 1;
  if (sharded) {
    rank = model.fsdp().mesh().data_parallel_rank();
    world = model.fsdp().mesh().data_parallel_size();
  }
  data::DistributedSampler sampler(images.size(0), options.global_batch, rank, world, options.seed);
  optim::AdamWConfig adam;
  adam.lr = options.lr;
  adam.weight_decay = options.weight_decay;
  auto optimizer = optim::make_adamw(
      sharded ? optim::from_sharded(model.fsdp().sharded_parameters()) : optim::from_module(*model),
      adam);
  optim::LRScheduleConfig schedule;
  schedule.warmup_style = "cosine";
  schedule.total_training_steps = options.steps;
  schedule.min_lr_ratio = 0.05;
  optim::LRScheduler lr(*optimizer, schedule);
  model->train();
  for (int64_t step = 0; step < options.steps; ++step) {
    auto idx = sampler.indices(step);
    auto out = classifier_loss(model, images.index_select(0, idx), labels.index_select(0, idx));
    optimizer->zero_grad();
    if (sharded) model.fsdp().zero_grad();
    out.loss.backward();
    if (sharded) {
      auto sharded_model = model.fsdp();
      optim::clip_and_step(sharded_model, *optimizer, 0.0);
    } else {
      optimizer->step();
    }
    lr.step();
    const bool last = step + 1 == options.steps;
    if (options.log && options.log_every > 0 && ((step + 1) % options.log_every == 0 || last)) {
      auto metrics = torch::stack({out.loss.detach(), out.accuracy}) / static_cast<double>(world);
      if (sharded) {
        const auto& mesh = model.fsdp().mesh();
        mesh.shard_group().all_reduce(metrics);
        if (mesh.replicate_group()) mesh.replicate_group()->all_reduce(metrics);
      }
      options.log(step + 1, metrics[0].item<double>(), metrics[1].item<double>());
    }
  }
  model->eval();
}

}  // namespace shardrl::models
