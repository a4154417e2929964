#include <spdlog/spdlog.h>

#include <unordered_set>

#include "shardrl/optim.h"

namespace shardrl::optim {

std::vector<NamedParameter> from_sharded(const std::vector<fsdp::ShardedParameter>& params) {
  std::vector<NamedParameter> out;
  for (const auto& p : params) out.push_back({p.name, p.shard, p.global_shape});
  return out;
}

std::vector<NamedParameter> from_module(const torch::nn::Module& module) {
  std::vector<NamedParameter> out;
  for (const auto& item : module.named_parameters(true)) {
    out.push_back({item.key(), item.value(), item.value().sizes().vec()});
  }
  return out;
}

bool exempt_from_weight_decay(const NamedParameter& param, const AdamWConfig& config) {
  if (config.no_decay_1d && param.global_shape.size() <= 1) return true;
  for (const auto& pattern : config.no_decay_name_patterns) {
    if (param.name.find(pattern) != std::string::npos) return true;
  }
  return false;
}

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<NamedParameter>& params,
                                                const AdamWConfig& config) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : params) {
    if (!p.tensor.requires_grad()) continue;
    (exempt_from_weight_decay(p, config) ? no_decay : decay).push_back(p.tensor);
  }
  auto options = torch::optim::AdamWOptions(config.lr)
                     .betas({config.beta1, config.beta2})
                     .eps(config.eps)
                     .weight_decay(config.weight_decay);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(options));
  auto no_decay_options = options;
  no_decay_options.weight_decay(0.0);
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(no_decay_options));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
}

StepResult clip_and_step(fsdp::FSDPModule& model, torch::optim::Optimizer& optimizer,
                         double max_norm) {
  StepResult result;
  result.grad_norm = model.grad_norm();
  if (!std::isfinite(result.grad_norm)) {
    result.skipped = true;
    spdlog::warn("grad norm is {}: skipping this optimizer step", result.grad_norm);
    model.zero_grad();
    return result;
  }
  const double coef = max_norm > 0 ? fsdp::clip_coefficient(result.grad_norm, max_norm) : 1.0;
  // Scaling and stepping in one pass: under offload each unit's state comes in once.
  std::unordered_set<const c10::TensorImpl*> stepped;
  model.for_each_resident(fsdp::ShardUse::kStep, [&](std::vector<fsdp::ShardedParameter>& shards) {
    std::vector<torch::Tensor> params;
    for (auto& p : shards) {
      if (coef < 1.0 && p.shard.grad().defined()) {
        torch::NoGradGuard no_grad;
        p.shard.mutable_grad().mul_(coef);
      }
      params.push_back(p.shard);
      stepped.insert(p.shard.unsafeGetTensorImpl());
    }
    step_only(optimizer, params);
  });
  // Params the optimizer holds beyond the model's shards step as before, unclipped.
  std::vector<torch::Tensor> others;
  for (auto* leaf : leaf_optimizers(optimizer)) {
    for (const auto& group : leaf->param_groups()) {
      for (const auto& p : group.params()) {
        if (!stepped.count(p.unsafeGetTensorImpl())) others.push_back(p);
      }
    }
  }
  if (!others.empty()) step_only(optimizer, others);
  return result;
}

}  // namespace shardrl::optim
