// Diffusion RL over the DiT: rollouts, the per-micro-batch losses and one RL step.
#include "shardrl/algos/dit_rl.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "algos/internal.h"
#include "shardrl/models/lora.h"
#include "shardrl/optim.h"

namespace shardrl::algos::dit {

using internal::require;
namespace lora = models::lora;

namespace {

// [B] per-sample noise levels from a 0-dim or [B] tensor.
torch::Tensor per_sample_sigma(const torch::Tensor& sigma, int64_t batch,
                               const torch::Device& device) {
  auto s = sigma.to(device, torch::kFloat);
  return s.dim() == 0 ? s.expand({batch}).contiguous() : s;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void add_metric(Metrics& m, const std::string& name, const torch::Tensor& value) {
  auto v = value.detach().to(torch::kFloat);
  auto it = m.find(name);
  if (it == m.end()) {
    m.emplace(name, v.clone());
  } else {
    it->second = it->second + v;
  }
}

}  // namespace

void accumulate_metrics(Metrics& into, const Metrics& other) {
  for (const auto& [name, value] : other) add_metric(into, name, value);
}

torch::Tensor dit_velocity(models::DiT& model, const torch::Tensor& x, const torch::Tensor& sigma,
                           const torch::Tensor& labels, double guidance_scale) {
  auto t = per_sample_sigma(sigma, x.size(0), x.device());
  if (guidance_scale == 1.0) return model(x, t, labels);
  auto [cond, uncond] = models::cfg_branches(model, x, t, labels);
  return cfg_combine(uncond, cond, guidance_scale);
}

torch::Tensor flow_matching_loss(models::DiT& model, const torch::Tensor& x0,
                                 const torch::Tensor& labels, const FlowMatchingLossConfig& config,
                                 at::Generator generator) {
  const int64_t b = x0.size(0);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(x0.device());
  torch::Tensor sigma;
  if (config.timestep_sampling == "logit_normal") {
    sigma = torch::sigmoid(at::randn({b}, generator, f32));
  } else if (config.timestep_sampling == "uniform") {
    sigma = at::rand({b}, generator, f32);
  } else {
    internal::throw_unknown_value("timestep_sampling", config.timestep_sampling,
                                  {"logit_normal", "uniform"});
  }
  auto eps = at::randn(x0.sizes(), generator, f32);
  auto xt = flow_interpolate(x0, eps, sigma);
  auto y =
      models::drop_labels(labels, model->config().num_classes, config.label_dropout, generator);
  auto v = model(xt, sigma, y).to(torch::kFloat);
  return torch::mse_loss(v, diffusion_target(x0, eps, "flow_matching"));
}

// ---------------------------------------------------------------------------------------------
// Rollout

DiffusionRollout DiffusionRollout::rows(int64_t start, int64_t length) const {
  DiffusionRollout r{latents.narrow(0, start, length),
                     log_probs.narrow(0, start, length),
                     timesteps.narrow(0, start, length),
                     labels.narrow(0, start, length),
                     {}};
  if (ref_means.defined()) r.ref_means = ref_means.narrow(0, start, length);
  return r;
}

DiffusionRollout sample_with_logprob(models::DiT& model, const torch::Tensor& labels,
                                     const RolloutConfig& config, at::Generator generator) {
  require(labels.dim() == 1 && labels.size(0) > 0, "labels", "must be a non-empty [B] tensor");
  torch::NoGradGuard no_grad;
  const auto& c = model->config();
  const auto scheduler = config.scheduler();
  const int64_t b = labels.size(0), steps = scheduler.num_steps();
  auto x = at::randn({b, c.in_channels, c.input_size, c.input_size}, generator,
                     torch::TensorOptions().dtype(torch::kFloat).device(labels.device()));
  std::vector<torch::Tensor> latents{x}, log_probs;
  SdeStepOptions options;
  options.noise_level = config.noise_level;
  options.generator = generator;
  for (int64_t j = 0; j < steps; ++j) {
    auto v = dit_velocity(model, x, scheduler.sigmas[j], labels, config.guidance_scale);
    auto step = sde_step_with_logprob(scheduler, v, x, j, options);
    x = step.prev_sample;
    latents.push_back(x);
    log_probs.push_back(step.log_prob);
  }
  auto timesteps = scheduler.timesteps.to(labels.device()).unsqueeze(0).expand({b, steps});
  return {torch::stack(latents, 1),
          torch::stack(log_probs, 1),
          timesteps.contiguous(),
          labels.to(torch::kLong),
          {}};
}

SdeStepResult rollout_step(models::DiT& model, const DiffusionRollout& rollout, int64_t j,
                           const RolloutConfig& config) {
  require(j >= 0 && j < rollout.num_steps(), "step",
          fmt::format("{} is outside the rollout's {} steps", j, rollout.num_steps()));
  const auto scheduler = config.scheduler();
  require(scheduler.num_steps() == rollout.num_steps(), "rollout.num_steps",
          fmt::format("{} does not match the rollout's {} steps", config.num_steps,
                      rollout.num_steps()));
  auto x = rollout.latents.select(1, j);
  auto v = dit_velocity(model, x, scheduler.sigmas[j], rollout.labels, config.guidance_scale);
  SdeStepOptions options;
  options.noise_level = config.noise_level;
  options.prev_sample = rollout.latents.select(1, j + 1);
  return sde_step_with_logprob(scheduler, v, x, j, options);
}

// ---------------------------------------------------------------------------------------------
// Flow-GRPO

void compute_reference_means(models::DiT& model, DiffusionRollout& rollout,
                             const RolloutConfig& config, int64_t micro_batch_size) {
  torch::NoGradGuard no_grad;
  lora::DisableAdapters reference(*model);
  std::vector<torch::Tensor> chunks;
  for (int64_t start = 0; start < rollout.size(); start += micro_batch_size) {
    auto mb = rollout.rows(start, std::min(micro_batch_size, rollout.size() - start));
    std::vector<torch::Tensor> steps;
    for (int64_t j = 0; j < rollout.num_steps(); ++j) {
      steps.push_back(rollout_step(model, mb, j, config).prev_sample_mean);
    }
    chunks.push_back(torch::stack(steps, 1));
  }
  rollout.ref_means = torch::cat(chunks);
}

MicroBatchLoss flow_grpo_timestep_loss(models::DiT& model, const DiffusionRollout& micro_batch,
                                       const torch::Tensor& advantages, int64_t j,
                                       const RolloutConfig& rollout,
                                       const FlowGrpoLossConfig& config) {
  torch::Tensor ref_mean;
  if (config.beta > 0) {
    if (micro_batch.ref_means.defined()) {
      ref_mean = micro_batch.ref_means.select(1, j);
    } else {
      torch::NoGradGuard no_grad;
      lora::DisableAdapters reference(*model);
      ref_mean = rollout_step(model, micro_batch, j, rollout).prev_sample_mean;
    }
  }
  auto step = rollout_step(model, micro_batch, j, rollout);
  FlowGrpoLossInputs in;
  in.log_prob = step.log_prob;
  in.old_log_prob = micro_batch.log_probs.select(1, j);
  in.advantages = advantages;
  in.prev_sample_mean = step.prev_sample_mean;
  in.ref_prev_sample_mean = ref_mean;
  in.std_dev_t = step.std_dev_t;
  auto out = flow_grpo_loss(in, config);
  return {out.loss,
          {{"loss", out.loss.detach()},
           {"policy_loss", out.policy_loss},
           {"kl", out.kl_loss},
           {"ppo_kl", out.ppo_kl},
           {"clipfrac", out.clipfrac}}};
}

Metrics flow_grpo_backward(models::DiT& model, const DiffusionRollout& micro_batch,
                           const torch::Tensor& advantages, const RolloutConfig& rollout,
                           const FlowGrpoLossConfig& config,
                           const std::vector<int64_t>& train_steps) {
  std::vector<int64_t> steps = train_steps;
  if (steps.empty()) {
    for (int64_t j = 0; j < micro_batch.num_steps(); ++j) steps.push_back(j);
  }
  Metrics sum;
  for (int64_t j : steps) {
    auto out = flow_grpo_timestep_loss(model, micro_batch, advantages, j, rollout, config);
    out.loss.backward();
    accumulate_metrics(sum, out.metrics);
  }
  return sum;
}

// ---------------------------------------------------------------------------------------------
// DiffusionNFT

MicroBatchLoss nft_timestep_loss(models::DiT& model, const torch::Tensor& x0,
                                 const torch::Tensor& labels, const torch::Tensor& r,
                                 const torch::Tensor& t, const torch::Tensor& eps,
                                 const NftLossConfig& config) {
  auto ts = per_sample_sigma(t, x0.size(0), x0.device());
  auto xt = flow_interpolate(x0, eps, ts);
  torch::Tensor v_old, v_ref, v;
  {
    torch::NoGradGuard no_grad;
    lora::UseAdapter old(*model, "old");
    v_old = model(xt, ts, labels);
  }
  if (config.ref_kl_coef > 0) {
    torch::NoGradGuard no_grad;
    lora::DisableAdapters reference(*model);
    v_ref = model(xt, ts, labels);
  }
  {
    lora::UseAdapter current(*model, "default");
    v = model(xt, ts, labels);
  }
  auto out = nft_loss({v, v_old, v_ref, x0, xt, ts, r}, config);
  return {out.loss,
          {{"loss", out.loss.detach()},
           {"policy_loss", out.policy_loss},
           {"kl", out.ref_loss},
           {"positive_loss", out.positive_loss},
           {"negative_loss", out.negative_loss}}};
}

// ---------------------------------------------------------------------------------------------
// Diffusion-DPO

MicroBatchLoss dpo_pair_loss(models::DiT& model, const torch::Tensor& pairs_x0,
                             const torch::Tensor& pairs_labels, const torch::Tensor& eps,
                             const torch::Tensor& sigmas, const DpoLossConfig& config) {
  require(
      pairs_x0.size(0) == 2 * eps.size(0), "eps",
      fmt::format("needs one noise per pair: {} for {} samples", eps.size(0), pairs_x0.size(0)));
  auto eps2 = repeat_for_pairs(eps);
  auto s2 = repeat_for_pairs(per_sample_sigma(sigmas, eps.size(0), eps.device()));
  auto xt = flow_interpolate(pairs_x0, eps2, s2);
  auto target = diffusion_target(pairs_x0, eps2, "flow_matching");
  torch::Tensor ref_pred;
  {
    torch::NoGradGuard no_grad;
    lora::DisableAdapters reference(*model);
    ref_pred = model(xt, s2, pairs_labels);
  }
  auto pred = model(xt, s2, pairs_labels);
  auto out = diffusion_dpo_loss(pred, ref_pred, target, config);
  return {out.loss,
          {{"loss", out.loss.detach()},
           {"implicit_acc", out.implicit_acc},
           {"reward_margin", out.reward_margin},
           {"model_mse", out.model_mse},
           {"ref_mse", out.ref_mse}}};
}

// ---------------------------------------------------------------------------------------------
// One RL step

void DiffusionRLConfig::validate() const {
  require(algorithm == "flow_grpo" || algorithm == "nft" || algorithm == "dpo", "algorithm",
          fmt::format("unknown value \"{}\" (expected one of: flow_grpo nft dpo)", algorithm));
  require(group_size >= 2, "group_size", fmt::format("must be >= 2, got {}", group_size));
  require(micro_batch_size >= 1, "micro_batch_size",
          fmt::format("must be >= 1, got {}", micro_batch_size));
  require(mini_batches >= 1, "mini_batches", fmt::format("must be >= 1, got {}", mini_batches));
  require(timestep_fraction > 0 && timestep_fraction <= 1, "timestep_fraction",
          fmt::format("must be in (0, 1], got {}", timestep_fraction));
  require(rollout.num_steps >= 1, "rollout.num_steps", "must be >= 1");
  require(algorithm == "nft" || rollout.noise_level > 0, "rollout.noise_level",
          "must be > 0 for flow_grpo and dpo (log-probs need a stochastic step)");
}

namespace {

void zero_grads(models::DiT& model, torch::optim::Optimizer& optimizer) {
  optimizer.zero_grad();
  if (model.is_sharded()) model.fsdp().zero_grad();
}

double optimizer_step(models::DiT& model, torch::optim::Optimizer& optimizer, double max_norm) {
  if (model.is_sharded()) {
    auto sharded = model.fsdp();
    return optim::clip_and_step(sharded, optimizer, max_norm).grad_norm;
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad() && p.grad().defined()) params.push_back(p);
  }
  const double norm =
      max_norm > 0 ? torch::nn::utils::clip_grad_norm_(params, max_norm)
                   : torch::nn::utils::clip_grad_norm_(params, std::numeric_limits<double>::max());
  if (std::isfinite(norm)) optimizer.step();
  return norm;
}

lora::NamedTensors adapter_tensors(models::DiT& model) {
  return model.is_sharded() ? lora::named_tensors(model.fsdp().sharded_parameters())
                            : lora::named_tensors(*model);
}

std::vector<int64_t> first_steps(int64_t total, double fraction) {
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(total * fraction));
  std::vector<int64_t> steps;
  for (int64_t j = 0; j < k; ++j) steps.push_back(j);
  return steps;
}

}  // namespace

RLStepResult diffusion_rl_rollout(models::DiT& rollout_model, const RewardFn& reward,
                                  const torch::Tensor& labels, const DiffusionRLConfig& config,
                                  at::Generator generator, dist::ProcessGroup* group) {
  config.validate();
  const int64_t b = labels.size(0);
  require(b % config.group_size == 0, "labels",
          fmt::format("{} samples do not split into groups of {}", b, config.group_size));
  RLStepResult result;
  auto start = std::chrono::steady_clock::now();
  result.rollout = sample_with_logprob(rollout_model, labels, config.rollout, generator);
  result.seconds["rollout"] = seconds_since(start);

  start = std::chrono::steady_clock::now();
  result.rewards = reward(result.rollout.images(), result.rollout.labels).to(torch::kFloat);
  // Advantages over the global batch: each rank holds whole groups, the std is global.
  const int64_t world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  auto all_rewards = result.rewards.contiguous();
  if (group) {
    all_rewards = torch::empty({world * b}, torch::kFloat);
    group->all_gather(result.rewards.contiguous(), all_rewards);
  }
  std::vector<int64_t> uids(static_cast<size_t>(world * b));
  for (size_t i = 0; i < uids.size(); ++i) uids[i] = static_cast<int64_t>(i) / config.group_size;
  result.advantages =
      diffusion_group_advantages(all_rewards, uids, config.advantage).narrow(0, rank * b, b);
  result.group_ids.assign(uids.begin() + rank * b, uids.begin() + (rank + 1) * b);
  result.reward_mean = all_rewards.mean().item<double>();
  result.reward_std = all_rewards.std(/*unbiased=*/false).item<double>();
  result.seconds["reward"] = seconds_since(start);
  return result;
}

RLStepResult diffusion_rl_step(models::DiT& model, torch::optim::Optimizer& optimizer,
                               const RewardFn& reward, const torch::Tensor& labels, int64_t step,
                               const DiffusionRLConfig& config, at::Generator generator,
                               dist::ProcessGroup* group) {
  RLStepResult result;
  {
    // NFT samples with its behaviour policy, the "old" adapter.
    std::optional<lora::UseAdapter> behaviour;
    if (config.algorithm == "nft") behaviour.emplace(*model, "old");
    result = diffusion_rl_rollout(model, reward, labels, config, generator, group);
  }
  diffusion_rl_update(model, optimizer, result, step, config, generator);
  return result;
}

void diffusion_rl_update(models::DiT& model, torch::optim::Optimizer& optimizer,
                         RLStepResult& result, int64_t step, const DiffusionRLConfig& config,
                         at::Generator generator) {
  config.validate();
  const int64_t b = result.rollout.size();
  const auto& labels = result.rollout.labels;
  const auto& advantages = result.advantages;
  const int64_t T = result.rollout.num_steps();
  Metrics sum;
  int64_t counted = 0, optimizer_steps = 0;
  auto start = std::chrono::steady_clock::now();
  if (config.algorithm == "flow_grpo") {
    if (config.flow_grpo.beta > 0) {
      compute_reference_means(model, result.rollout, config.rollout, config.micro_batch_size);
    }
    result.seconds["reference"] = seconds_since(start);
    start = std::chrono::steady_clock::now();
    const auto train_steps = first_steps(T, config.timestep_fraction);
    const int64_t mini = (b + config.mini_batches - 1) / config.mini_batches;
    for (int64_t m0 = 0; m0 < b; m0 += mini) {
      const int64_t m_len = std::min(mini, b - m0);
      const int64_t n_micro = (m_len + config.micro_batch_size - 1) / config.micro_batch_size;
      auto loss_config = config.flow_grpo;
      loss_config.loss_divisor = static_cast<double>(
          grad_accum_divisor("flow_grpo", n_micro, static_cast<int64_t>(train_steps.size())));
      zero_grads(model, optimizer);
      for (int64_t s0 = m0; s0 < m0 + m_len; s0 += config.micro_batch_size) {
        const int64_t len = std::min(config.micro_batch_size, m0 + m_len - s0);
        accumulate_metrics(sum, flow_grpo_backward(model, result.rollout.rows(s0, len),
                                                   advantages.narrow(0, s0, len), config.rollout,
                                                   loss_config, train_steps));
        counted += static_cast<int64_t>(train_steps.size());
      }
      result.grad_norm = optimizer_step(model, optimizer, config.max_grad_norm);
      ++optimizer_steps;
    }
  } else if (config.algorithm == "nft") {
    auto r = nft_reward_prob(advantages, config.nft_adv_mode, config.nft.adv_clip_max);
    auto selected =
        nft_select_train_timesteps(result.rollout.timesteps, config.timestep_fraction, generator);
    const int64_t K = selected.timesteps.size(1);
    const int64_t n_micro = (b + config.micro_batch_size - 1) / config.micro_batch_size;
    auto loss_config = config.nft;
    loss_config.loss_divisor = static_cast<double>(grad_accum_divisor("nft", n_micro, K));
    auto x0 = result.rollout.images();
    zero_grads(model, optimizer);
    for (int64_t s0 = 0; s0 < b; s0 += config.micro_batch_size) {
      const int64_t len = std::min(config.micro_batch_size, b - s0);
      for (int64_t k = 0; k < K; ++k) {
        auto mb_x0 = x0.narrow(0, s0, len);
        auto eps = at::randn(mb_x0.sizes(), generator, mb_x0.options());
        auto out = nft_timestep_loss(model, mb_x0, labels.narrow(0, s0, len), r.narrow(0, s0, len),
                                     selected.timesteps.narrow(0, s0, len).select(1, k) / 1000.0,
                                     eps, loss_config);
        out.loss.backward();
        accumulate_metrics(sum, out.metrics);
        ++counted;
      }
    }
    result.grad_norm = optimizer_step(model, optimizer, config.max_grad_norm);
    lora::ema_update(adapter_tensors(model), "old", "default",
                     ema_decay(config.nft_decay_schedule, step));
  } else {
    auto pairs = dpo_make_pairs(result.rewards, result.group_ids);
    const int64_t P = pairs.num_pairs();
    require(P > 0, "group_size", "DPO found no pairs");
    auto idx = pairs.index_tensor();
    auto pair_x0 = result.rollout.images().index_select(0, idx);
    auto pair_labels = labels.index_select(0, idx);
    const auto train_scheduler = FlowMatchScheduler::create(1000, config.dpo_shift);
    auto ts = dpo_sample_timesteps(train_scheduler, P, generator);
    auto eps = at::randn({P, pair_x0.size(1), pair_x0.size(2), pair_x0.size(3)}, generator,
                         pair_x0.options());
    const int64_t n_micro = (P + config.micro_batch_size - 1) / config.micro_batch_size;
    auto loss_config = config.dpo;
    loss_config.loss_divisor = static_cast<double>(grad_accum_divisor("dpo", n_micro));
    zero_grads(model, optimizer);
    for (int64_t p0 = 0; p0 < P; p0 += config.micro_batch_size) {
      const int64_t len = std::min(config.micro_batch_size, P - p0);
      auto out = dpo_pair_loss(model, pair_x0.narrow(0, 2 * p0, 2 * len),
                               pair_labels.narrow(0, 2 * p0, 2 * len), eps.narrow(0, p0, len),
                               ts.sigmas.narrow(0, p0, len), loss_config);
      out.loss.backward();
      accumulate_metrics(sum, out.metrics);
      ++counted;
    }
    result.grad_norm = optimizer_step(model, optimizer, config.max_grad_norm);
  }
  result.seconds["update"] = seconds_since(start);
  for (auto& [name, value] : sum) {
    // "loss" is already divided by the accumulation divisor: its sum is each optimizer step's
    // mean loss.
    result.metrics[name] = name == "loss"
                               ? value / static_cast<double>(std::max<int64_t>(optimizer_steps, 1))
                               : value / static_cast<double>(counted);
  }
}

}  // namespace shardrl::algos::dit
