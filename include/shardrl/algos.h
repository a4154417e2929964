// The math of ShardRL's RL post-training algorithms: flow-matching SDE sampling with log-probs
// (Flow-GRPO), DiffusionNFT, Diffusion-DPO, and verl's LM policy losses. Formulas and test vectors:
// shared/reference/rl-algorithms.md. No distributed code and no models here: engines run the
// forward passes, feed the tensors in, and call backward() on the returned loss.
//
// Conventions:
//  - An optional tensor argument is an undefined torch::Tensor when absent.
//  - Math runs in fp32 whatever the input dtype: with bf16 model outputs the PPO ratio of a
//    mean log-prob would be rounded coarser than the 1e-4 clip range it is compared with.
//  - Metrics are detached 0-dim tensors, so a caller can gather them in one device->host copy.
//  - An unknown mode string throws std::invalid_argument naming the config field and the value.
//  - Batch-dim-first everywhere; "per sample" means a [B] tensor.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace shardrl::algos {

// ---------------------------------------------------------------------------------------------
// Flow-matching scheduler and SDE step (§1)

// Shifted Euler flow-matching schedule (diffusers' FlowMatchEulerDiscreteScheduler for SD3).
struct FlowMatchScheduler {
  torch::Tensor sigmas;     // [N+1] fp32: the N step sigmas, sigmas[0] = 1, then a final 0
  torch::Tensor timesteps;  // [N] fp32: 1000 * sigmas[:N]

  // sigmas = shift(linspace(sigma_max, sigma_min, N)) with shift(s) = k*s / (1 + (k-1)*s).
  // sigma_min < 0 means diffusers' value: training timestep 1 of 1000 after the shift,
  // k*1e-3 / (1 + (k-1)*1e-3), i.e. 0.003/1.002 for SD3's k = 3.
  static FlowMatchScheduler create(int64_t num_steps, double shift = 3.0, double sigma_max = 1.0,
                                   double sigma_min = -1.0);

  int64_t num_steps() const { return timesteps.size(0); }
  double sigma(int64_t i) const;  // sigmas[i], i in [0, N]
};

struct SdeStepOptions {
  double noise_level = 0.7;  // a: scales the SDE's diffusion coefficient
  // "sde": Flow-GRPO's SDE step. "cps": Coefficients-Preserving Sampling (flow_grpo's
  // sde_type="cps"): std_dev_t = sigma_prev * sin(a pi / 2) and the mean keeps the x0 / noise
  // coefficients of the ODE's marginal, (1 - sigma_prev) x0_hat + sqrt(sigma_prev^2 - std^2)
  // x1_hat; its log_prob drops every constant, -mean((x_prev - mean)^2), as flow_grpo's does.
  // "dance_sde": DanceGRPO's step (verl-omni's flow_match_sde.py): the Euler mean plus the score
  // correction -a^2/2 * score * (sigma_prev - sigma) with score = -(x - (1 - sigma) x0_hat) /
  // sigma^2, and std_dev_t = a sqrt(sigma - sigma_prev) (the step's whole std: its sqrt_dt is not
  // applied again).
  std::string sde_type = "sde";
  // Defined: score this sample (training recomputes the rollout's log-prob); undefined: draw one.
  torch::Tensor prev_sample;
  std::optional<at::Generator> generator;  // for the drawn noise; the default generator if unset
};

struct SdeStepResult {
  torch::Tensor prev_sample;       // x_{i+1}, fp32, shape of the sample
  torch::Tensor log_prob;          // [B]: MEAN (not sum) of the Gaussian log-density over elements
  torch::Tensor prev_sample_mean;  // fp32, shape of the sample; carries the model's gradient
  torch::Tensor std_dev_t;         // [B, 1, ...] (or 0-dim for scalar sigmas)
  torch::Tensor sqrt_dt;           // sqrt(sigma - sigma_prev), shaped like std_dev_t
};

// The SDE types sde_step_with_logprob knows (rollout.algo.sde_type).
const std::vector<std::string>& sde_types();

// One Flow-GRPO SDE step from sigmas[step_index] to sigmas[step_index + 1].
// step_index: 0-dim or [B] integer tensor (per-sample steps).
SdeStepResult sde_step_with_logprob(const FlowMatchScheduler& scheduler,
                                    const torch::Tensor& model_output, const torch::Tensor& sample,
                                    const torch::Tensor& step_index,
                                    const SdeStepOptions& options = {});
SdeStepResult sde_step_with_logprob(const FlowMatchScheduler& scheduler,
                                    const torch::Tensor& model_output, const torch::Tensor& sample,
                                    int64_t step_index, const SdeStepOptions& options = {});
// The same step from explicit sigmas (0-dim or [B]). sigma1 is the schedule's sigmas[1]: at
// sigma == 1 it stands in for sigma in the 1 - sigma denominator of std_dev_t, which would be 0.
SdeStepResult sde_step_with_logprob_sigmas(const torch::Tensor& model_output,
                                           const torch::Tensor& sample, const torch::Tensor& sigma,
                                           const torch::Tensor& sigma_prev, double sigma1,
                                           const SdeStepOptions& options = {});

// Classifier-free guidance: v_uncond + g * (v_cond - v_uncond).
torch::Tensor cfg_combine(const torch::Tensor& v_uncond, const torch::Tensor& v_cond,
                          double guidance_scale);

// Forward noising xt = (1 - sigma) * x0 + sigma * eps; sigma is 0-dim or per sample [B].
torch::Tensor flow_interpolate(const torch::Tensor& x0, const torch::Tensor& eps,
                               const torch::Tensor& sigma);

// Regression target of the denoiser. prediction_type: "flow_matching" (eps - x0, a velocity) or
// "epsilon" (eps).
torch::Tensor diffusion_target(const torch::Tensor& x0, const torch::Tensor& eps,
                               const std::string& prediction_type);

// ---------------------------------------------------------------------------------------------
// Group-relative advantages

struct DiffusionAdvantageConfig {
  bool normalize_by_std = true;  // false: A = r - mean_group
  bool global_std = true;        // std of the whole batch (Flow-GRPO default), else per group
  double eps = 1e-4;
};

// Flow-GRPO / NFT advantages per sample: (r - mean_group) / (std + eps) with torch.std's unbiased
// std, as verl-omni's compute_flow_grpo_outcome_advantage (flow_grpo's np.std is the population
// one). Singleton groups get 0. rewards: [B]; uids: B group keys.
// Returns fp32 [B] on the rewards' device.
torch::Tensor diffusion_group_advantages(const torch::Tensor& rewards,
                                         const std::vector<std::string>& uids,
                                         const DiffusionAdvantageConfig& config = {});
torch::Tensor diffusion_group_advantages(const torch::Tensor& rewards,
                                         const std::vector<int64_t>& uids,
                                         const DiffusionAdvantageConfig& config = {});

// [B] -> [B, num_timesteps]: every denoising step of a sample shares its advantage.
torch::Tensor broadcast_over_timesteps(const torch::Tensor& advantages, int64_t num_timesteps);

// verl's GRPO outcome advantage: (s - mean_g) / (std_g + eps) with the UNBIASED std; a singleton
// group uses mean 0, std 1. scores: [B]. Returns fp32 [B].
torch::Tensor grpo_score_advantages(const torch::Tensor& scores,
                                    const std::vector<std::string>& uids,
                                    bool norm_adv_by_std = true, double eps = 1e-6);
torch::Tensor grpo_score_advantages(const torch::Tensor& scores, const std::vector<int64_t>& uids,
                                    bool norm_adv_by_std = true, double eps = 1e-6);
// Token level, as verl: scores are the row sums of token_level_rewards [B, L], and the per-sample
// advantage is broadcast over the response and zeroed outside response_mask [B, L].
torch::Tensor grpo_outcome_advantages(const torch::Tensor& token_level_rewards,
                                      const torch::Tensor& response_mask,
                                      const std::vector<std::string>& uids,
                                      bool norm_adv_by_std = true, double eps = 1e-6);
torch::Tensor grpo_outcome_advantages(const torch::Tensor& token_level_rewards,
                                      const torch::Tensor& response_mask,
                                      const std::vector<int64_t>& uids, bool norm_adv_by_std = true,
                                      double eps = 1e-6);

// ---------------------------------------------------------------------------------------------
// Gradient accumulation (§6)

// What each micro-batch loss is divided by so that one optimizer step sees the mean gradient.
// algorithm: "flow_grpo" (alias "ppo") and "nft": num_micro_batches * num_timesteps (every
// timestep is its own backward); "dpo": num_micro_batches. Every rank must run the same number of
// micro-batches, or the FSDP collectives of the extra ones would wait forever.
int64_t grad_accum_divisor(const std::string& algorithm, int64_t num_micro_batches,
                           int64_t num_timesteps = 1);

// ---------------------------------------------------------------------------------------------
// Flow-GRPO loss (§1)

struct FlowGrpoLossConfig {
  double clip_range = 1e-4;  // tiny because log_prob is a per-element mean
  double adv_clip_max = 5.0;
  double beta = 0.0;          // KL-to-reference weight; > 0 needs ref_prev_sample_mean
  double loss_divisor = 1.0;  // grad_accum_divisor("flow_grpo", ...)
};

struct FlowGrpoLossInputs {
  torch::Tensor log_prob;              // [B] current policy at timestep t, with grad
  torch::Tensor old_log_prob;          // [B] rollout log-prob at t
  torch::Tensor advantages;            // [B] advantages at t
  torch::Tensor prev_sample_mean;      // current policy's step mean (for the KL term)
  torch::Tensor ref_prev_sample_mean;  // same with adapters disabled; optional unless beta > 0
  torch::Tensor std_dev_t;             // from the step; [B, 1, ...], [B] or 0-dim
  torch::Tensor rollout_is_weights;    // optional [B] importance weights, no gradient
  // flow_dppo and grpo_guard only: the old policy's step mean and the step's sqrt(-dt).
  torch::Tensor old_prev_sample_mean;  // shape of prev_sample_mean, no gradient
  torch::Tensor sqrt_dt;               // [B, 1, ...], [B] or 0-dim, like std_dev_t
};

struct FlowGrpoLossOutput {
  torch::Tensor loss;         // (L_pg + beta * L_kl) / loss_divisor, with grad
  torch::Tensor policy_loss;  // L_pg (detached)
  torch::Tensor kl_loss;      // L_kl (detached; 0 when no reference mean was given)
  torch::Tensor ppo_kl;       // mean(-log_ratio)
  torch::Tensor clipfrac;     // mean(|ratio - 1| > clip_range)
};

FlowGrpoLossOutput flow_grpo_loss(const FlowGrpoLossInputs& inputs,
                                  const FlowGrpoLossConfig& config = {});

// ---------------------------------------------------------------------------------------------
// verl-omni's other reverse-process losses (§7): each reads one SDE step of the current policy
// per row. The KL-to-reference term is not part of them: step_kl_loss adds it, as verl-omni's
// diffusion_loss adds its "kl" loss when actor.use_kl_loss.

// Per-sample Gaussian KL between two step means of the same std: mean over elements of
// (mean - other)^2 / (2 std_dev_t^2), then the mean over samples. verl-omni's "kl" loss (other: the
// reference's mean) and "distill_kl" (other: the teacher's).
torch::Tensor step_kl_loss(const torch::Tensor& prev_sample_mean, const torch::Tensor& other_mean,
                           const torch::Tensor& std_dev_t);

// verl-omni's "distill_fm_mse": mean((noise_pred - teacher_noise_pred)^2) over every element.
torch::Tensor distill_fm_mse_loss(const torch::Tensor& noise_pred,
                                  const torch::Tensor& teacher_noise_pred);

struct FlowDppoLossConfig {
  double kl_mask_threshold = 1e-5;  // diffusion_loss.kl_mask_threshold
  // diffusion_loss.add_kl_coefficient: the KL divides by 2 (std_dev_t sqrt_dt)^2; false: by 2.
  bool add_kl_coefficient = true;
  double loss_divisor = 1.0;
};

struct PolicyStepLossOutput {
  torch::Tensor loss;             // policy loss / loss_divisor, with grad
  torch::Tensor policy_loss;      // detached
  torch::Tensor ppo_kl;           // mean(-log_ratio)
  torch::Tensor clipfrac;         // grpo_guard: mean(|ratio - 1| > clip); flow_dppo: 0 (no clip)
  torch::Tensor ratio_mean;       // mean(ratio)
  torch::Tensor kl_new_old;       // flow_dppo: mean of the per-sample KL to the old mean; else 0
  torch::Tensor masked_fraction;  // flow_dppo: share of samples the trust region drops; else 0
};

// Flow-DPPO (verl-omni's flow_dppo): no ratio clip and no advantage clamp; the loss -A ratio of a
// sample is dropped when its KL to the old policy's mean reaches kl_mask_threshold and the update
// moves further away ((ratio > 1 and A > 0) or (ratio < 1 and A < 0)). Reads log_prob,
// old_log_prob, advantages, prev_sample_mean, old_prev_sample_mean, std_dev_t, sqrt_dt and the
// optional rollout_is_weights.
PolicyStepLossOutput flow_dppo_loss(const FlowGrpoLossInputs& inputs,
                                    const FlowDppoLossConfig& config = {});

// GRPO-Guard (verl-omni's grpo_guard, arXiv 2510.22319): with s = std_dev_t sqrt_dt the ratio is
// exp((log_prob - old_log_prob + |mean - old_mean|^2 / (2 s^2)) s), clipped as Flow-GRPO's
// (advantages clamped to adv_clip_max), and the per-sample loss divided by sqrt_dt^2. verl-omni
// runs one timestep per call and uses the batch's mean s and sqrt_dt; here every row carries its
// own step, so s and sqrt_dt are the row's (the same thing when the rows share a step).
PolicyStepLossOutput grpo_guard_loss(const FlowGrpoLossInputs& inputs,
                                     const FlowGrpoLossConfig& config = {});

// ---------------------------------------------------------------------------------------------
// DiffusionNFT (§2)

// Reward probability r in [0, 1] from advantages. adv_mode: "continuous", "positive_only",
// "negative_only", "one_only", "binary". Modes act on A (after the clamp to +-adv_clip_max) and
// BEFORE r = clamp(A / c / 2 + 0.5, 0, 1), as in the reference code: so one_only maps A > 0 to
// 1/c/2 + 0.5 (0.6 for c = 5), not to 1, and binary maps to {0.4, 0.5, 0.6}.
torch::Tensor nft_reward_prob(const torch::Tensor& advantages, const std::string& adv_mode,
                              double adv_clip_max = 5.0);

struct NftTimestepSelection {
  torch::Tensor indices;    // [B, K] int64 column indices into the rollout timesteps
  torch::Tensor timesteps;  // [B, K] the selected rollout timesteps
};
// Per row a random permutation of the rollout timesteps [B, T], keeping the first
// K = max(1, int(T * timestep_fraction)). timestep_fraction in (0, 1].
NftTimestepSelection nft_select_train_timesteps(const torch::Tensor& rollout_timesteps,
                                                double timestep_fraction,
                                                std::optional<at::Generator> generator = {});

struct NftLossConfig {
  double beta = 1.0;  // mix weight of the implicit positive/negative policies, (0, 1]
  double adv_clip_max = 5.0;
  double ref_kl_coef = 0.0;           // > 0 needs v_ref
  double adaptive_weight_min = 1e-5;  // floor of the per-sample x0 error that normalises L_pos/neg
  double loss_divisor = 1.0;          // grad_accum_divisor("nft", ...)
};

struct NftLossInputs {
  torch::Tensor v;      // current ("default" adapter) velocity, with grad
  torch::Tensor v_old;  // "old" adapter velocity (treated as constant)
  torch::Tensor v_ref;  // adapters disabled; optional unless ref_kl_coef > 0
  torch::Tensor x0;     // clean latent
  torch::Tensor xt;     // (1 - t) * x0 + t * eps
  torch::Tensor t;      // [B] or 0-dim, timestep / 1000
  torch::Tensor r;      // [B] reward probability (nft_reward_prob)
};

struct NftLossOutput {
  torch::Tensor loss;           // (L_pol + ref_kl_coef * L_ref) / loss_divisor, with grad
  torch::Tensor policy_loss;    // L_pol (detached)
  torch::Tensor ref_loss;       // L_ref (detached; 0 without v_ref)
  torch::Tensor positive_loss;  // mean_b L_pos (detached)
  torch::Tensor negative_loss;  // mean_b L_neg (detached)
};

NftLossOutput nft_loss(const NftLossInputs& inputs, const NftLossConfig& config = {});

// Decay of the "old" adapter's EMA: d(step) = step < flat_steps ? 0
//                                               : min((step - flat_steps) * rate, max_decay).
struct EmaDecaySchedule {
  int64_t flat_steps = 0;
  double rate = 0.0;
  double max_decay = 0.0;
};
// decay_schedule: "copy" (0, 0, 0), "linear_to_0_5" (0, 0.001, 0.5),
// "delayed_linear_to_0_999" (75, 0.0075, 0.999).
EmaDecaySchedule ema_decay_schedule(const std::string& decay_schedule);
double ema_decay(const EmaDecaySchedule& schedule, int64_t step);
double ema_decay(const std::string& decay_schedule, int64_t step);

// In place, without autograd: target[i] <- decay * target[i] + (1 - decay) * source[i].
// decay == 0 is an exact copy (stale NaNs in target do not survive).
void ema_update(const std::vector<torch::Tensor>& target, const std::vector<torch::Tensor>& source,
                double decay);

// ---------------------------------------------------------------------------------------------
// Diffusion-DPO (§3)

struct DpoPairing {
  // Batch indices, chosen at even and rejected at odd positions: index_select(0, indices) turns
  // the batch into [w0, l0, w1, l1, ...].
  std::vector<int64_t> indices;
  int64_t num_skipped_groups = 0;  // groups with fewer than 2 samples
  int64_t num_pairs() const { return static_cast<int64_t>(indices.size() / 2); }
  torch::Tensor index_tensor() const;  // indices as an int64 CPU tensor
};

// Online pairing: groups by uid (in order of first appearance), sorts each by reward
// descending (stable, so ties keep batch order) and pairs best with worst.
DpoPairing dpo_make_pairs(const std::vector<double>& rewards, const std::vector<std::string>& uids);
DpoPairing dpo_make_pairs(const std::vector<double>& rewards, const std::vector<int64_t>& uids);
DpoPairing dpo_make_pairs(const torch::Tensor& rewards, const std::vector<std::string>& uids);
DpoPairing dpo_make_pairs(const torch::Tensor& rewards, const std::vector<int64_t>& uids);

// Logit-normal index: floor(sigmoid(N(0,1)) * num_train_timesteps), clamped into range. [n] int64.
torch::Tensor dpo_sample_timestep_indices(int64_t n, int64_t num_train_timesteps = 1000,
                                          std::optional<at::Generator> generator = {});

struct DpoTimesteps {
  torch::Tensor indices;    // [P] int64 into the training schedule
  torch::Tensor timesteps;  // [P] fp32, train_scheduler.timesteps[indices]
  torch::Tensor sigmas;     // [P] fp32, train_scheduler.sigmas[indices]
};
// One timestep per pair from the training schedule (typically 1000 steps).
DpoTimesteps dpo_sample_timesteps(const FlowMatchScheduler& train_scheduler, int64_t num_pairs,
                                  std::optional<at::Generator> generator = {});

// [P, ...] -> [2P, ...]: both members of a pair share their noise and timestep.
torch::Tensor repeat_for_pairs(const torch::Tensor& per_pair);

struct DpoLossConfig {
  double beta = 100.0;
  double loss_divisor = 1.0;  // grad_accum_divisor("dpo", ...)
};

struct DpoLossOutput {
  torch::Tensor loss;             // mean_pairs(-logsigmoid(inside)) / loss_divisor, with grad
  torch::Tensor implicit_acc;     // mean(inside > 0)
  torch::Tensor reward_margin;    // mean(inside) = mean(chosen reward - rejected reward)
  torch::Tensor chosen_reward;    // mean(-0.5 * beta * (e_theta_w - e_ref_w))
  torch::Tensor rejected_reward;  // mean(-0.5 * beta * (e_theta_l - e_ref_l))
  torch::Tensor model_mse;        // mean of e_theta over all samples
  torch::Tensor ref_mse;          // mean of e_ref over all samples
};

// Inputs are [2P, ...], interleaved chosen/rejected as dpo_make_pairs orders them.
DpoLossOutput diffusion_dpo_loss(const torch::Tensor& model_pred, const torch::Tensor& ref_pred,
                                 const torch::Tensor& target, const DpoLossConfig& config = {});

// ---------------------------------------------------------------------------------------------
// Language-model policy loss (§4, verl core_algos)

// sum(values * mask) / (sum(mask) + 1e-8): an all-masked input gives 0, not NaN.
torch::Tensor masked_mean(const torch::Tensor& values, const torch::Tensor& mask);

// loss_agg_mode (verl's agg_loss on one rank): "token-mean" (every token weighs the same),
// "token-sum", "seq-mean-token-sum", "seq-mean-token-mean" (every sequence weighs the same),
// "seq-mean-token-sum-norm" (seq-mean-token-sum divided by loss_scale_factor; <= 0: by L).
// loss_mat, loss_mask: [B, L]. The seq-mean modes average over sequences that have at least one
// unmasked token.
torch::Tensor agg_loss(const torch::Tensor& loss_mat, const torch::Tensor& loss_mask,
                       const std::string& loss_agg_mode, double loss_scale_factor = 0.0);

struct PolicyLossConfig {
  // verl's actor.policy_loss.loss_mode:
  //  - "vanilla": PPO's clipped ratio per token, asymmetric clip, dual clip for A < 0;
  //  - "gspo": GSPO, the sequence's geometric-mean ratio (its gradient through each token),
  //    clipped, always aggregated seq-mean-token-mean whatever loss_agg_mode says (as verl);
  //  - "gpg": -log_prob * A, no ratio and no clip;
  //  - "geo_mean": GMPO, the clipped token log-ratios averaged into a sequence ratio, times
  //    the sequence's mean advantage, averaged over the rows (loss_agg_mode unused, as verl).
  std::string loss_mode = "vanilla";
  double clip_ratio_low = 0.2;   // ratio floor 1 - clip_ratio_low
  double clip_ratio_high = 0.2;  // ratio ceiling 1 + clip_ratio_high (DAPO raises it)
  double clip_ratio_c = 3.0;     // dual clip for A < 0 (vanilla); must be > 1
  std::string loss_agg_mode = "token-mean";
  double loss_scale_factor = 0.0;  // seq-mean-token-sum-norm's divisor; <= 0: the response length
};

struct PolicyLossOutput {
  torch::Tensor pg_loss;            // aggregated, with grad
  torch::Tensor pg_losses;          // [B, L] per-token losses before aggregation (geo_mean: [B])
  torch::Tensor pg_clipfrac;        // masked mean of clipped tokens (gpg: 0)
  torch::Tensor ppo_kl;             // masked mean of -log_ratio
  torch::Tensor pg_clipfrac_lower;  // vanilla: dual-clip activations; geo_mean: clipped, A < 0
};

// The policy loss of config.loss_mode; all tensors [B, L].
PolicyLossOutput compute_policy_loss(const torch::Tensor& old_log_prob,
                                     const torch::Tensor& log_prob, const torch::Tensor& advantages,
                                     const torch::Tensor& response_mask,
                                     const PolicyLossConfig& config = {});

struct ValueLossOutput {
  torch::Tensor vf_loss;      // 0.5 * agg_loss(max(unclipped, clipped) squared errors), with grad
  torch::Tensor vf_clipfrac;  // masked mean of the tokens whose clipped error was the larger
};

// PPO's clipped value loss (verl's compute_value_loss, from TRL's PPO trainer): the new values
// vpreds may move at most cliprange_value from the values the critic gave at rollout time, and
// the larger of the two squared errors to the returns counts. All tensors [B, L].
ValueLossOutput compute_value_loss(const torch::Tensor& vpreds, const torch::Tensor& returns,
                                   const torch::Tensor& values, const torch::Tensor& response_mask,
                                   double cliprange_value,
                                   const std::string& loss_agg_mode = "token-mean",
                                   double loss_scale_factor = 0.0);

// Entropy of softmax(logits) over the last dim, logsumexp(l) - sum(softmax(l) * l) as verl
// computes it: [..., V] -> [...] fp32, with grad.
torch::Tensor entropy_from_logits(const torch::Tensor& logits);

// ---------------------------------------------------------------------------------------------
// Language-model advantage estimators (verl core_algos' compute_*_advantage)

// Sums a small tensor over the data-parallel ranks (the caller's all-reduce), for the statistics
// verl takes over the whole batch: whitening. Unset: this rank's batch is the whole batch.
using SumOverRanks = std::function<torch::Tensor(torch::Tensor)>;

// verl's masked_whiten: (v - mean) * rsqrt(var + 1e-8) with the masked mean and the unbiased
// masked variance of the whole batch (every rank's, through sum_over_ranks). Fewer than two
// unmasked values in the batch is an error, as verl's.
torch::Tensor masked_whiten(const torch::Tensor& values, const torch::Tensor& mask,
                            const SumOverRanks& sum_over_ranks = {});

struct AdvantageConfig {
  // verl's algorithm.adv_estimator: "gae", "grpo", "rloo", "reinforce_plus_plus",
  // "reinforce_plus_plus_baseline", "remax".
  std::string adv_estimator = "grpo";
  double gamma = 1.0;                   // discount (gae, reinforce_plus_plus)
  double lam = 1.0;                     // GAE's lambda
  bool norm_adv_by_std_in_grpo = true;  // grpo: divide by the group's std (false: Dr. GRPO)
  double epsilon = 1e-6;                // grpo's std guard
  SumOverRanks sum_over_ranks;          // for whitening (gae, reinforce_plus_plus[_baseline])
};

struct AdvantageInputs {
  torch::Tensor token_level_rewards;  // [B, L]
  torch::Tensor response_mask;        // [B, L], 1 on response tokens
  std::vector<int64_t> uids;          // B group keys (grpo, rloo, reinforce_plus_plus_baseline)
  torch::Tensor values;               // [B, L] the critic's values (gae)
  torch::Tensor reward_baselines;     // [B] the greedy answer's reward (remax)
};

struct Advantages {
  // [B, L] fp32, 0 outside the mask; gae's as verl's: the whitened running advantage that the
  // masked positions carry (the policy loss masks them).
  torch::Tensor advantages;
  torch::Tensor returns;  // [B, L] fp32 (the critic's target with gae)
};

// verl's semantics per estimator (a lone member of a group: mean 0, as verl):
//  - gae: TD residuals backwards over the masked tokens (masked positions carry the running
//    value and advantage through), returns = A + V, then A whitened;
//  - grpo: (s - mean_g) / (std_g + eps) with s the row sums of the rewards (grpo_outcome_*);
//  - rloo: s * n / (n - 1) - mean_g * n / (n - 1) for groups of n > 1, s alone for n = 1;
//  - reinforce_plus_plus: discounted returns over the masked tokens, whitened;
//  - reinforce_plus_plus_baseline: s - mean_g on every token, whitened;
//  - remax: reward-to-go minus the greedy baseline on every response token, not whitened.
Advantages compute_advantage(const AdvantageInputs& inputs, const AdvantageConfig& config);

// ---------------------------------------------------------------------------------------------
// DAPO (verl's recipe/dapo: its reward manager and dynamic sampling)

// The overlong reward added to each response's score: min(-(length - (max_response_length -
// buffer_len)) / buffer_len * penalty_factor, 0), a ramp from 0 at max_response_length -
// buffer_len tokens down to -penalty_factor at max_response_length. response_lengths: [B] valid
// tokens per response. buffer_len in [1, max_response_length].
torch::Tensor overlong_penalty(const torch::Tensor& response_lengths, int64_t max_response_length,
                               int64_t buffer_len, double penalty_factor);

// Dynamic sampling's kept groups: the uids (in order of first appearance) whose metric values
// [B] are not all equal (std > 0), and those of a single response, as verl keeps them.
std::vector<int64_t> groups_to_keep(const torch::Tensor& metric, const std::vector<int64_t>& uids);

// Per-token KL estimate between the policy and the reference. kl_penalty: "kl"/"k1"
// (logp - ref), "abs", "mse"/"k2" (0.5 * (logp - ref)^2), "low_var_kl"/"k3"
// (clamp(exp(d) - d - 1, -10, 10) with d = clamp(ref - logp, -20, 20)).
torch::Tensor kl_penalty(const torch::Tensor& log_prob, const torch::Tensor& ref_log_prob,
                         const std::string& penalty);

}  // namespace shardrl::algos
