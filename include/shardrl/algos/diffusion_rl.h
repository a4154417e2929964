// Diffusion RL on a flow-matching transformer conditioned on text (models::FlowModel: SD3's or
// Qwen-Image's MMDiT): the supervised flow-matching
// loss, the sampler that records what Flow-GRPO needs (SDE or CPS steps inside an SDE window,
// ODE steps outside it), the rows each algorithm trains on, and the per-micro-batch losses of
// Flow-GRPO, DiffusionNFT and Diffusion-DPO. The math (schedule, SDE step, losses) is algos.h;
// this file runs the model.
//
// Everything an update needs is a row of a TensorMap (the engine's Batch): one row per
// (sample, trained step) for Flow-GRPO and NFT, one per pair for DPO, with the text conditioning
// repeated per row. So an engine splits the rows into micro-batches, calls diffusion_loss once
// per micro-batch and back-propagates it; no loop here runs backward or steps an optimizer. What a
// loss needs from a frozen policy (the reference, NFT's old policy) is computed first, by
// frozen_outputs on that policy, and joins the rows as columns, as verl computes ref_log_prob
// before the update.
//
// The model may be sharded (fsdp::Unit): then every rank must make the same calls in the same
// order (each forward all-gathers).
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardrl/algos.h"
#include "shardrl/dist.h"
#include "shardrl/models/flow_model.h"

namespace shardrl::algos {

// Detached 0-dim metrics by name (e.g. "clipfrac", "kl").
using Metrics = std::map<std::string, torch::Tensor>;
// Named tensors that share dim 0, the row dimension (engine::Batch is the same type).
using TensorMap = std::map<std::string, torch::Tensor>;

struct MicroBatchLoss {
  torch::Tensor loss;  // scalar with grad: the mean over the micro-batch's rows (not divided)
  Metrics metrics;
};

// ---------------------------------------------------------------------------------------------
// Text conditioning

// The text encoder's output for each row, under these column names in a TensorMap (diffusers'
// pipeline argument names):
//   "prompt_embeds" [B, L, joint_attention_dim] and what the model reads beside it: SD3
//   "pooled_prompt_embeds" [B, pooled_projection_dim], Qwen-Image "prompt_embeds_mask" [B, L]
// and, for CFG's unconditional branch (the empty negative prompt's encoding, repeated per row),
//   "negative_prompt_embeds", "negative_pooled_prompt_embeds", "negative_prompt_embeds_mask" of
//   the same shapes (those of the positive columns present).
struct Conditioning {
  torch::Tensor prompt_embeds, pooled_prompt_embeds;
  torch::Tensor negative_prompt_embeds, negative_pooled_prompt_embeds;  // undefined: no CFG
  torch::Tensor prompt_embeds_mask, negative_prompt_embeds_mask;        // undefined: no mask

  // Reads the columns above (the negative ones when present); a missing one is an error naming it.
  static Conditioning from(const TensorMap& rows);
  void add_to(TensorMap& rows) const;  // writes the defined ones
  Conditioning index_select(const torch::Tensor& rows) const;
  int64_t size() const { return prompt_embeds.size(0); }
  bool has_negative() const { return negative_prompt_embeds.defined(); }
  models::FlowText text() const {
    return {prompt_embeds, pooled_prompt_embeds, prompt_embeds_mask};
  }
  models::FlowText negative_text() const {
    return {negative_prompt_embeds, negative_pooled_prompt_embeds, negative_prompt_embeds_mask};
  }
};

// The velocity at noise level sigma [B] (fp32, in [0, 1]) for latents x [B, C, H, W], as the
// model's pipeline computes it (models::FlowModel). true_cfg_scale > 1: v_neg + s * (v - v_neg)
// from one batched forward of both branches (needs the negative embeddings), with the family's
// correction (Qwen-Image: rescaled to the conditional velocity's norm); 1: the conditional branch
// alone.
torch::Tensor flow_velocity(const models::FlowModel& model, const torch::Tensor& x,
                            const torch::Tensor& sigma, const Conditioning& cond,
                            double true_cfg_scale);

// ---------------------------------------------------------------------------------------------
// Supervised stage

struct FlowMatchingLossConfig {
  // Share of rows whose prompt is replaced by the negative (empty) prompt, so that CFG has an
  // unconditional branch to use; > 0 needs the negative columns.
  double caption_dropout = 0.1;
  // "logit_normal" (SD3's sigmoid(N(0, 1))) or "uniform" noise levels.
  std::string timestep_sampling = "logit_normal";
};

// rows: "images" [B, C, H, W] (clean latents) and the conditioning. The loss is
// mean((v(x_sigma, sigma) - (eps - x0))^2) with x_sigma = (1 - sigma) x0 + sigma eps, no CFG.
MicroBatchLoss flow_matching_loss(const models::FlowModel& model, const TensorMap& rows,
                                  const FlowMatchingLossConfig& config, at::Generator generator);

// ---------------------------------------------------------------------------------------------
// Sampling (verl-omni's rollout.algo and rollout.pipeline)

struct SamplerConfig {
  int64_t num_inference_steps = 10;  // rollout.pipeline.num_inference_steps
  double shift = 3.0;                // the flow-matching scheduler's shift (SD3: 3.0)
  double noise_level = 0.7;          // rollout.algo.noise_level; 0: every step is the ODE
  // rollout.algo.sde_type: "sde", "cps" or "dance_sde" (sde_types()). CPS's std is sigma_next
  // sin(noise_level pi / 2): 0 on the last step (to sigma 0), so a window holding it gets a NaN KL
  // to the reference there.
  std::string sde_type = "sde";
  // rollout.algo.sde_window_size: how many consecutive steps are stochastic (and trained); 0 (the
  // YAML's null) means every step but the last, as in flow_grpo and verl-omni. The window
  // [start, start + size) lies in rollout.algo.sde_window_range [first, last) (last -1:
  // num_inference_steps): start is drawn uniformly from [first, last - size].
  int64_t sde_window_size = 0;
  std::pair<int64_t, int64_t> sde_window_range{0, -1};
  // MixGRPO (actor_rollout_ref.model.algorithm mix_grpo): how the window moves from one training
  // step to the next. rollout.algo.sample_strategy "random": the start is Python's
  // random.Random(sde_window_seed + step).randint(first, last - size), as verl-omni's MixGRPO
  // pipeline draws it (the same start on every rank); "progressive": the window slides by its size
  // every rollout.algo.iters_per_group steps, from the range's start to its end, where it stays.
  bool mix_grpo = false;
  std::string sample_strategy = "random";
  int64_t iters_per_group = 1;
  int64_t sde_window_seed = 0;
  double true_cfg_scale = 1.0;      // rollout.pipeline.true_cfg_scale
  int64_t height = 28, width = 28;  // rollout.pipeline.height / width, in latent pixels

  FlowMatchScheduler scheduler() const;
  void validate() const;  // errors name the field (e.g. "rollout.algo.sde_type")
};
// As JSON with the field names above (absent fields keep their defaults): EngineConfig::loss
// carries it to the registered loss as "sampler".
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(SamplerConfig, num_inference_steps, shift,
                                                noise_level, sde_type, sde_window_size,
                                                sde_window_range, mix_grpo, sample_strategy,
                                                iters_per_group, sde_window_seed, true_cfg_scale,
                                                height, width)

// Steps [begin, end) that are stochastic in one rollout batch.
struct SdeWindow {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool contains(int64_t step) const { return step >= begin && step < end; }
};
// With sde_window_size 0, steps [0, T - 1) (every step but the last, which lands on sigma 0
// where the Gaussian is sharpest; [0, 1) for T = 1), else a window of that size whose start is
// drawn uniformly so that it fits in the range (flow_grpo's sd3_pipeline_with_logprob_fast.py,
// verl-omni's pipelines). `generator` must be seeded alike on every rank: all ranks use one
// window per step, as Flow-GRPO-Fast does. With config.mix_grpo the start follows
// config.sample_strategy at `global_step` (verl-omni's global_steps: 1 at the first training
// step) and the generator is not used.
SdeWindow draw_sde_window(const SamplerConfig& config, at::Generator generator,
                          int64_t global_step = 0);
// What Python's random.Random(seed).randint(low, high) returns (Mersenne Twister seeded by
// init_by_array, randbelow by rejection), for MixGRPO's window start.
int64_t python_random_randint(int64_t seed, int64_t low, int64_t high);

struct DiffusionRollout {
  torch::Tensor latents;    // [B, T+1, C, H, W]: the initial noise, then x after each step
  torch::Tensor log_probs;  // [B, T] fp32: log-prob of each step's transition (0 outside window)
  torch::Tensor sigmas;     // [T+1] fp32: the schedule the steps ran on
  SdeWindow window;         // the stochastic steps
  Conditioning cond;        // per sample
  int64_t size() const { return latents.size(0); }
  int64_t num_steps() const { return log_probs.size(1); }
  torch::Tensor images() const { return latents.select(1, -1); }  // the final samples
};

// Samples cond.size() latents of config's size from N(0, I) noise: the SDE (or CPS) step with
// noise_level inside `window`, the deterministic Euler (ODE) step outside it. No grad; the noise
// is drawn from `generator`. noise_level 0 gives the ODE sample (evaluation).
DiffusionRollout sample_with_logprob(const models::FlowModel& model, const Conditioning& cond,
                                     const SamplerConfig& config, const SdeWindow& window,
                                     at::Generator generator);

// ---------------------------------------------------------------------------------------------
// Rewards to advantages

struct GroupAdvantages {
  torch::Tensor advantages;                // [B] this rank's, group-relative with the global std
  std::vector<int64_t> group_ids;          // [B] the global group of each sample
  double reward_mean = 0, reward_std = 0;  // over every rank's samples
};
// rewards [B]: this rank's, group_size consecutive samples per prompt; every rank passes the same
// B. `group` (null: one process) gathers them, so the std is the whole batch's (Flow-GRPO's
// global_std) and group ids are global.
GroupAdvantages group_advantages(const torch::Tensor& rewards, int64_t group_size,
                                 const DiffusionAdvantageConfig& config,
                                 dist::ProcessGroup* group = nullptr);

// ---------------------------------------------------------------------------------------------
// The policy's step on the rows

// One reverse step of `model` on flow_grpo_rows-style rows ("latents", "next_latents", "sigma",
// "sigma_next" and the conditioning): the velocity the step used (CFG-combined; verl-omni's
// noise_pred) and the step's log-prob, mean, std_dev_t and sqrt_dt. What the sampler computed for
// the same rows, with grad when grad mode is on. Every reverse-process loss and frozen column
// reaches the model through this one function.
struct PolicyStep {
  torch::Tensor velocity;
  SdeStepResult step;
};
PolicyStep policy_step(const models::FlowModel& model, const TensorMap& rows,
                       const SamplerConfig& sampler);

// verl's old-log-prob pass: the trainer's recomputation of the rollout's steps on the rows,
// without grad: "old_log_probs" [R] and "old_prev_sample_mean". The rollout's own log-probs stay in
// the rows as "rollout_log_probs".
TensorMap recompute_log_probs(const models::FlowModel& model, const TensorMap& rows,
                              const SamplerConfig& sampler);

// verl-omni's rollout-train consistency metrics: rollout_corr/logprob_abs_diff_mean and _max of
// |old_log_probs - rollout_log_probs| over rows that hold both.
Metrics logprob_consistency(const TensorMap& rows);

// ---------------------------------------------------------------------------------------------
// Rows of an update

// Flow-GRPO's trained steps: the first max(1, int(n * timestep_fraction)) of the window's n steps
// (algorithm.timestep_fraction).
std::vector<int64_t> flow_grpo_train_steps(const SdeWindow& window, double timestep_fraction);

// One row per (sample, step in `steps`), sample-major: "latents" (x_j), "next_latents" (x_{j+1}),
// "sigma", "sigma_next" [R] fp32, "rollout_log_probs" [R] and, until recompute_log_probs replaces
// them, "old_log_probs" (the same), "advantages" [R], and the conditioning.
TensorMap flow_grpo_rows(const DiffusionRollout& rollout, const torch::Tensor& advantages,
                         const std::vector<int64_t>& steps);

// One row per (sample, timestep): K = max(1, int(T * timestep_fraction)) of the rollout's steps
// drawn per sample (nft_select_train_timesteps), fresh noise eps: "x0" (the final sample), "xt",
// "t" [R] (sigma), "r" [R] (reward probability), and the conditioning. Sample-major.
TensorMap nft_rows(const DiffusionRollout& rollout, const torch::Tensor& reward_prob,
                   double timestep_fraction, at::Generator generator);

// One row per pair (dpo_make_pairs over `group_ids`): "chosen_x0", "rejected_x0", "eps" (shared by
// both), "sigma" [P] drawn from a 1000-step schedule with `shift` (dpo_sample_timesteps), and the
// pair's conditioning (the chosen sample's; a group shares its prompt).
TensorMap dpo_rows(const DiffusionRollout& rollout, const torch::Tensor& rewards,
                   const std::vector<int64_t>& group_ids, double shift, at::Generator generator);
// The same rows from given pairs (offline DPO, algorithm.sample_source offline): chosen and
// rejected [P, C, H, W] with the pairs' conditioning [P].
TensorMap offline_dpo_rows(const torch::Tensor& chosen, const torch::Tensor& rejected,
                           const Conditioning& cond, double shift, at::Generator generator);

// ---------------------------------------------------------------------------------------------
// Losses (verl-omni's actor.diffusion_loss)

// The loss modes of verl-omni's model types (their engines' losses). diffusion_model (the PPO
// engine, reverse-process losses on one SDE step per row): flow_grpo (its default), dance_grpo,
// flow_dppo, grpo_guard, kl, distill_kl, distill_fm_mse; diffusion_nft_model: diffusion_nft;
// diffusion_dpo_model: dpo. Another type is an error naming actor_rollout_ref.model.model_type.
std::string loss_mode_of(const std::string& model_type);  // the default
const std::vector<std::string>& loss_modes_of(const std::string& model_type);
// Whether the mode's loss reads one reverse SDE step per row (flow_grpo_rows), as verl-omni's PPO
// engine runs it.
bool is_reverse_process_loss(const std::string& loss_mode);

struct DiffusionLossConfig {
  // actor.diffusion_loss.loss_mode: one of loss_modes_of(model_type).
  std::string loss_mode = "flow_grpo";
  double clip_ratio = 1e-4;   // diffusion_loss.clip_ratio (flow_grpo, dance_grpo, grpo_guard)
  double adv_clip_max = 5.0;  // diffusion_loss.adv_clip_max
  // actor.kl_loss_coef when actor.use_kl_loss, else 0: the reference KL that verl-omni adds to a
  // reverse-process loss ("kl" on its own is loss_mode kl).
  double kl_loss_coef = 0.0;
  double mix_beta = 0.5;              // diffusion_loss.mix_beta (NFT's beta)
  double ref_kl_coef = 0.0;           // diffusion_loss.ref_kl_coef (NFT)
  double adaptive_weight_min = 1e-5;  // diffusion_loss.adaptive_weight_min (NFT)
  double dpo_beta = 2000.0;           // diffusion_loss.dpo_beta
  double kl_mask_threshold = 1e-5;    // diffusion_loss.kl_mask_threshold (flow_dppo)
  bool add_kl_coefficient = true;     // diffusion_loss.add_kl_coefficient (flow_dppo)
  // actor.distill_loss_coef when actor.use_distill_loss, else 0: the teacher term
  // (actor.distill_loss_mode: distill_kl or distill_fm_mse) added to a reverse-process loss.
  double distill_loss_coef = 0.0;
  std::string distill_loss_mode = "distill_kl";
  void validate() const;  // errors name the field (e.g. "actor.diffusion_loss.clip_ratio")
  // Whether the loss reads a reference policy's outputs (frozen_outputs with role "reference").
  bool needs_reference() const;
  // Whether it reads a teacher's (frozen_outputs with role "teacher"): loss_mode distill_kl or
  // distill_fm_mse, or a distillation term.
  bool needs_teacher() const;
  // Whether it reads the old policy's step ("old_log_probs", "old_prev_sample_mean" of
  // recompute_log_probs): flow_dppo and grpo_guard.
  bool needs_old_step() const;
};
// As JSON with the field names above (absent fields keep their defaults): EngineConfig::loss.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(DiffusionLossConfig, loss_mode, clip_ratio,
                                                adv_clip_max, kl_loss_coef, mix_beta, ref_kl_coef,
                                                adaptive_weight_min, dpo_beta, kl_mask_threshold,
                                                add_kl_coefficient, distill_loss_coef,
                                                distill_loss_mode)

// What loss_mode's loss reads from a frozen policy, computed under NoGradGuard with `model` as it
// is (the caller picks the policy: adapters disabled, another adapter, or a reference or teacher
// engine's model). role "reference": a reverse-process loss {"ref_prev_sample_mean"},
// diffusion_nft {"ref_velocity"}, dpo {"ref_chosen_pred", "ref_rejected_pred"}. role "old"
// (diffusion_nft only): {"old_velocity"}. role "teacher" (a reverse-process loss with
// needs_teacher()): {"teacher_prev_sample_mean"} for distill_kl, {"teacher_noise_pred"} (the
// teacher's velocity at the row's state) for distill_fm_mse.
TensorMap frozen_outputs(const std::string& role, const models::FlowModel& model,
                         const TensorMap& rows, const DiffusionLossConfig& loss,
                         const SamplerConfig& sampler);

// The loss of one micro-batch of rows, the mean over its rows, with the current model (with
// grad). The frozen columns it needs must be in `rows` (an error names a missing one). Metrics:
// reverse-process modes "policy_loss" (the mode's own loss), "kl" (the reference term), "ppo_kl",
// "clipfrac", "ratio_mean" and, with a teacher term, "distill_loss"; flow_dppo adds
// "kl_new_old_mean" and "masked_fraction"; diffusion_nft "policy_loss", "kl", "positive_loss",
// "negative_loss"; dpo "implicit_acc", "reward_margin", "model_mse", "ref_mse".
MicroBatchLoss diffusion_loss(const models::FlowModel& model, const TensorMap& rows,
                              const DiffusionLossConfig& loss, const SamplerConfig& sampler);

}  // namespace shardrl::algos
