// The class-conditional DiT's diffusion RL (the path the SD3 one in diffusion_rl.h replaces; it
// lives in algos::dit until the trainer moves over): the supervised flow-matching loss, the SDE
// rollout that records what Flow-GRPO needs, and the per-micro-batch losses of Flow-GRPO,
// DiffusionNFT and Diffusion-DPO. The math (schedule, SDE step, losses) is algos.h; this file runs
// the model.
//
// Every loss here is a function of (model, micro-batch) that returns a loss tensor and detached
// metrics, so an engine's forward_backward_batch can call it per micro-batch. Flow-GRPO and NFT
// back-propagate once per timestep (as the reference implementations do, so only one timestep's
// activations are alive): their *_timestep_loss is the loss_fn, and *_backward loops over the
// timesteps of one micro-batch calling backward() on each.
//
// The model may be sharded (fsdp::Unit): then every rank must make the same calls in the same
// order (each forward all-gathers). LoRA roles: adapter "default" is the trained policy, "old" the
// NFT behaviour policy, and adapters disabled give the reference (models::lora).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "shardrl/algos.h"
#include "shardrl/dist.h"
#include "shardrl/models/dit.h"

namespace shardrl::algos::dit {

// Detached 0-dim metrics by name (e.g. "clipfrac", "kl").
using Metrics = std::map<std::string, torch::Tensor>;

struct MicroBatchLoss {
  torch::Tensor loss;  // with grad (already divided by the accumulation divisor)
  Metrics metrics;
};

// Adds `other`'s metrics into `into` (sums; divide by the count for means).
void accumulate_metrics(Metrics& into, const Metrics& other);

// The DiT's velocity at noise level sigma ([B] or 0-dim, in [0, 1]) for class labels [B], with
// classifier-free guidance when guidance_scale != 1 (one batched forward of both branches).
torch::Tensor dit_velocity(models::DiT& model, const torch::Tensor& x, const torch::Tensor& sigma,
                           const torch::Tensor& labels, double guidance_scale);

// ---------------------------------------------------------------------------------------------
// Supervised stage

struct FlowMatchingLossConfig {
  double label_dropout = 0.1;  // labels replaced by the null class, so CFG has an unconditional
  // "logit_normal" (SD3's sigmoid(N(0, 1))) or "uniform" noise levels.
  std::string timestep_sampling = "logit_normal";
};

// mean((v(x_sigma, sigma, y) - (eps - x0))^2) with x_sigma = (1 - sigma) x0 + sigma eps.
torch::Tensor flow_matching_loss(models::DiT& model, const torch::Tensor& x0,
                                 const torch::Tensor& labels, const FlowMatchingLossConfig& config,
                                 at::Generator generator);

// ---------------------------------------------------------------------------------------------
// Rollout

struct RolloutConfig {
  int64_t num_steps = 10;
  double shift = 1.0;  // schedule shift (SD3: 3 at 1024 px; small images want less)
  double noise_level = 0.7;
  double guidance_scale = 1.0;
  FlowMatchScheduler scheduler() const { return FlowMatchScheduler::create(num_steps, shift); }
};

struct DiffusionRollout {
  torch::Tensor latents;    // [B, T+1, C, H, W]: the initial noise, then x after each step
  torch::Tensor log_probs;  // [B, T] fp32: log-prob of step j's transition
  torch::Tensor timesteps;  // [B, T] fp32: 1000 * sigma_j
  torch::Tensor labels;     // [B] int64
  // [B, T, C, H, W] the reference policy's step means (adapters disabled), for Flow-GRPO's KL;
  // undefined until compute_reference_means().
  torch::Tensor ref_means;
  int64_t size() const { return labels.size(0); }
  int64_t num_steps() const { return log_probs.size(1); }
  torch::Tensor images() const { return latents.select(1, -1); }  // the final samples
  DiffusionRollout rows(int64_t start, int64_t length) const;     // a micro-batch
};

// Samples labels.size(0) images from N(0, I) noise with the SDE step (noise_level 0: the ODE,
// plain Euler, whose log-probs are not defined). No grad; seeded by `generator`.
DiffusionRollout sample_with_logprob(models::DiT& model, const torch::Tensor& labels,
                                     const RolloutConfig& config, at::Generator generator);

// Step j of a rollout scored again under the current model: the rollout's x_{j+1} as the sample.
// Carries the model's gradient when grad mode is on.
SdeStepResult rollout_step(models::DiT& model, const DiffusionRollout& rollout, int64_t j,
                           const RolloutConfig& config);

// ---------------------------------------------------------------------------------------------
// Flow-GRPO (§1)

// Fills rollout.ref_means: every step's mean under the model with adapters disabled, no grad.
void compute_reference_means(models::DiT& model, DiffusionRollout& rollout,
                             const RolloutConfig& config, int64_t micro_batch_size);

// The clipped loss at rollout step j of a micro-batch; advantages [b]. With config.beta > 0 the
// reference step mean is micro_batch.ref_means, or computed here when that is undefined.
MicroBatchLoss flow_grpo_timestep_loss(models::DiT& model, const DiffusionRollout& micro_batch,
                                       const torch::Tensor& advantages, int64_t j,
                                       const RolloutConfig& rollout,
                                       const FlowGrpoLossConfig& config);

// Runs flow_grpo_timestep_loss and backward() for each step in `train_steps` (all steps when
// empty); config.loss_divisor must already count the timesteps. Returns summed metrics
// ("loss", "policy_loss", "kl", "ppo_kl", "clipfrac") over the timesteps.
Metrics flow_grpo_backward(models::DiT& model, const DiffusionRollout& micro_batch,
                           const torch::Tensor& advantages, const RolloutConfig& rollout,
                           const FlowGrpoLossConfig& config,
                           const std::vector<int64_t>& train_steps = {});

// ---------------------------------------------------------------------------------------------
// DiffusionNFT (§2)

// One NFT step at noise level t [b] (timestep / 1000) on clean samples x0 [b, C, H, W] with
// reward probabilities r [b] and fresh noise eps: v from adapter "default" (with grad), v_old from
// adapter "old", v_ref with adapters disabled when ref_kl_coef > 0. Conditional velocities, no CFG
// (NFT trains the guidance-free model).
MicroBatchLoss nft_timestep_loss(models::DiT& model, const torch::Tensor& x0,
                                 const torch::Tensor& labels, const torch::Tensor& r,
                                 const torch::Tensor& t, const torch::Tensor& eps,
                                 const NftLossConfig& config);

// ---------------------------------------------------------------------------------------------
// Diffusion-DPO (§3)

// pairs_x0 / pairs_labels: [2P, ...] interleaved chosen/rejected (dpo_make_pairs order); eps [P,
// C, H, W] and sigmas [P]: one noise and one noise level per pair, shared by both members.
MicroBatchLoss dpo_pair_loss(models::DiT& model, const torch::Tensor& pairs_x0,
                             const torch::Tensor& pairs_labels, const torch::Tensor& eps,
                             const torch::Tensor& sigmas, const DpoLossConfig& config);

// ---------------------------------------------------------------------------------------------
// One RL step: rollout -> reward -> group-relative advantages -> update

struct DiffusionRLConfig {
  std::string algorithm = "flow_grpo";  // "flow_grpo", "nft" or "dpo"
  RolloutConfig rollout;
  int64_t group_size = 8;        // samples per class prompt; each rank holds whole groups
  int64_t micro_batch_size = 8;  // samples (dpo: pairs) per forward
  // flow_grpo: optimizer steps per rollout batch (the batch split in order); past the first the
  // policy has moved and the ratio clip acts.
  int64_t mini_batches = 1;
  double timestep_fraction = 1.0;  // flow_grpo and nft: share of the rollout steps trained on
  double max_grad_norm = 1.0;
  DiffusionAdvantageConfig advantage;
  FlowGrpoLossConfig flow_grpo;
  NftLossConfig nft;
  std::string nft_adv_mode = "continuous";
  std::string nft_decay_schedule = "linear_to_0_5";
  DpoLossConfig dpo;
  double dpo_shift = 1.0;  // shift of the 1000-step schedule DPO draws noise levels from
  void validate() const;   // errors name the field
};

// Reward per sample [B] fp32 for images [B, C, H, W] generated for labels [B].
using RewardFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

struct RLStepResult {
  DiffusionRollout rollout;                // this rank's samples
  torch::Tensor rewards;                   // [B] this rank's rewards
  torch::Tensor advantages;                // [B] group-relative, with the global std
  std::vector<int64_t> group_ids;          // [B] the global group of each sample
  double reward_mean = 0, reward_std = 0;  // over all ranks' samples
  Metrics metrics;                         // means over micro-batches (and timesteps) on this rank
  double grad_norm = 0;                    // of the last optimizer step
  std::map<std::string, double> seconds;   // "rollout", "reward", "reference", "update"
};

// labels: this rank's prompts, group_size consecutive samples per class; every rank must pass the
// same count. `group` (null: one process) gathers rewards for the advantages' global std. The
// optimizer must step the model's trainable params (its sharded params when sharded). `step`
// drives the NFT old adapter's EMA schedule.
//
// An RL step is its two halves below, run on one model; NFT samples with the "old" adapter.
RLStepResult diffusion_rl_step(models::DiT& model, torch::optim::Optimizer& optimizer,
                               const RewardFn& reward, const torch::Tensor& labels, int64_t step,
                               const DiffusionRLConfig& config, at::Generator generator,
                               dist::ProcessGroup* group = nullptr);

// The rollout half: samples with `rollout_model` as it is (the behaviour policy: the trained
// model, or a rollout replica the engine's weight sync keeps current), scores the samples and
// computes the advantages. Fills everything but metrics and grad_norm; seconds "rollout" and
// "reward". Collective over `group` (the reward gather) only.
RLStepResult diffusion_rl_rollout(models::DiT& rollout_model, const RewardFn& reward,
                                  const torch::Tensor& labels, const DiffusionRLConfig& config,
                                  at::Generator generator, dist::ProcessGroup* group = nullptr);

// The update half on the trained model: the reference means (Flow-GRPO with a KL), then the
// algorithm's optimizer step(s). Fills metrics, grad_norm, seconds "reference" and "update".
void diffusion_rl_update(models::DiT& model, torch::optim::Optimizer& optimizer,
                         RLStepResult& result, int64_t step, const DiffusionRLConfig& config,
                         at::Generator generator);

}  // namespace shardrl::algos::dit
