#include <spdlog/spdlog.h>

#include <map>
#include <string>
#include <unordered_set>
#include <utility>

#include "shardrl/optim.h"

#include "fsdp/grads.h"

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

namespace {

// torch::optim::AdamW with its update in ATen's fused kernel, as PyTorch's AdamW(fused=True):
// one pass over each param, grad and moment per step, where LibTorch's loop makes about ten
// (on a GPU, ten kernel launches a param; on the CPU, ten trips through memory). The state is
// LibTorch's AdamWParamState, so checkpoints, offload and step_only see no difference, and the
// update is LibTorch's up to rounding (the tests hold it to LibTorch's own loop).
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups()) {
      const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
      // One kernel call per device and dtype: the fused kernel takes lists that share both.
      std::map<std::pair<std::string, c10::ScalarType>, Bucket> buckets;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
        // The kernel walks each tensor as flat memory; the grad is only read, so a strided one
        // is copied, while the param it updates in place must already be dense.
        TORCH_CHECK(p.is_contiguous(), "AdamW: a parameter of shape ", p.sizes(),
                    " is not contiguous; the fused step updates params in place as flat memory");
        auto& state = state_for(p, options.amsgrad());
        state.step(state.step() + 1);
        auto& bucket = buckets[{p.device().str(), p.scalar_type()}];
        bucket.params.push_back(p);
        bucket.grads.push_back(p.grad().contiguous());
        bucket.exp_avgs.push_back(state.exp_avg());
        bucket.exp_avg_sqs.push_back(state.exp_avg_sq());
        if (options.amsgrad()) bucket.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
        bucket.steps.push_back(static_cast<float>(state.step()));
      }
      for (auto& [key, bucket] : buckets) {
        // The kernel reads each param's step count from a float tensor on the param's device: one
        // small copy for the whole bucket.
        const auto device = bucket.params.front().device();
        auto steps = torch::tensor(bucket.steps, torch::kFloat).to(device).unbind();
        at::_fused_adamw_(bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs,
                          bucket.max_exp_avg_sqs, steps, options.lr(), std::get<0>(options.betas()),
                          std::get<1>(options.betas()), options.weight_decay(), options.eps(),
                          options.amsgrad(),
                          /*maximize=*/false);
      }
    }
    return loss;
  }

 private:
  struct Bucket {
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
    std::vector<float> steps;
  };

  // The param's state, created at its first step as LibTorch's AdamW creates it.
  torch::optim::AdamWParamState& state_for(const torch::Tensor& p, bool amsgrad) {
    auto& slot = state_[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(0);
      state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      state->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      if (amsgrad) state->max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      slot = std::move(state);
    }
    return static_cast<torch::optim::AdamWParamState&>(*slot);
  }
};

}  // namespace

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
  return std::make_unique<FusedAdamW>(std::move(groups), options);
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
    if (coef < 1.0) fsdp::scale_grads(shards, coef);
    std::vector<torch::Tensor> params;
    for (auto& p : shards) {
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
