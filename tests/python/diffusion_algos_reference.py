"""verl-omni's diffusion algorithms, as verl-omni computes them (tests/test_diffusion_reference.cpp).

Transcribed from verl-project/verl-omni at a1139ba, not from ShardRL:
  verl_omni/pipelines/schedulers/flow_match_sde.py   FlowMatchSDEDiscreteScheduler.sample_previous_step
                                                     (sde_type sde, cps, dance_sde; return_sqrt_dt)
  verl_omni/trainer/diffusion/diffusion_algos.py     FlowGRPOLoss (flow_grpo, dance_grpo), FlowDPPOLoss,
                                                     GRPOGuardLoss, KLLoss, DistillKLLoss,
                                                     DistillFlowMatchingMSELoss, DPOLoss, DiffusionNFTLoss,
                                                     compute_flow_grpo_outcome_advantage,
                                                     DiffusionNFTLoss._compute_group_advantages and
                                                     _advantage_to_reward_prob
  verl_omni/trainer/diffusion/diffusion_trainer_utils.py  old_policy_decay
  verl_omni/pipelines/qwen_image_mix_grpo/vllm_omni_rollout_adapter.py
                                                     _maybe_make_progressive_window (MixGRPO)
  verl_omni/workers/utils/losses.py                  diffusion_loss (+ kl_loss_coef * kl,
                                                     + distill_loss_coef * distill)
The scheduler's sigmas are diffusers' FlowMatchEulerDiscreteScheduler's, the one verl-omni's
scheduler derives from.

usage: diffusion_algos_reference.py CONFIG_JSON IN_FILE OUT_FILE
  CONFIG_JSON: num_inference_steps, shift, noise_level, the diffusion_loss fields (clip_ratio,
    adv_clip_max, mix_beta, ref_kl_coef, adaptive_weight_min, dpo_beta, kl_mask_threshold,
    add_kl_coefficient), kl_loss_coef, distill_loss_coef, distill_loss_mode, adv_modes, decay
    steps, window cases.
  IN_FILE (safetensors), per SDE type T in sde, cps, dance_sde (rows of ShardRL's sampler):
    T/x, T/prev, T/v [R, C, H, W], T/sigma, T/sigma_next [R], T/old_log_probs, T/advantages [R],
    T/old_prev_sample_mean, T/ref_prev_sample_mean, T/teacher_prev_sample_mean,
    T/teacher_noise_pred; and nft/*, dpo/*, rewards, uids.
  OUT_FILE (safetensors): T/{log_prob, mean, std_dev_t, sqrt_dt} and T/<mode>/{loss, metric...}
    for every reverse-process loss mode, nft/..., dpo/..., advantages, reward_prob/<mode>,
    decay/<schedule>, window/<case>.
"""
import json
import math
import random as _random
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file, save_file


class Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# --- flow_match_sde.py: sample_previous_step, with the timestep path (per-sample sigmas) ---------
def sample_previous_step(sigmas, sample, model_output, sigma_idx, noise_level, prev_sample, sde_type,
                         include_logprob_normalizer=True):
    sigma = sigmas[sigma_idx].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_prev = sigmas[sigma_idx + 1].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_max = sigmas[1]
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        prev_sample_mean = (
            sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (
            2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2)
        )
        if include_logprob_normalizer:
            log_prob = (
                log_prob
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
            )
    elif sde_type == "cps":
        sin_noise = math.sin(noise_level * math.pi / 2)
        std_dev_t = sigma_prev * sin_noise
        pred_original_sample = sample - sigma * model_output
        noise_estimate = sample + model_output * (1 - sigma)
        prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
            sigma_prev**2 - std_dev_t**2
        )
        log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)
    elif sde_type == "dance_sde":
        dsigma = sigma_prev - sigma
        delta_t = sigma - sigma_prev
        prev_sample_mean = sample + dsigma * model_output
        pred_original_sample = sample - sigma * model_output
        score_estimate = -(sample - pred_original_sample * (1 - sigma)) / (sigma**2)
        log_term = -0.5 * noise_level**2 * score_estimate
        prev_sample_mean = prev_sample_mean + log_term * dsigma
        std_dev_t = noise_level * torch.sqrt(delta_t)
        log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (std_dev_t**2))
        if include_logprob_normalizer:
            log_prob = log_prob - torch.log(std_dev_t) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    else:
        raise ValueError(sde_type)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    sqrt_dt = torch.sqrt(-1 * dt)
    sqrt_dt = sqrt_dt.reshape(sqrt_dt.shape[0])
    return log_prob, prev_sample_mean, std_dev_t, sqrt_dt


# --- diffusion_algos.py ----------------------------------------------------------------------------
def flow_grpo_loss(old_log_prob, log_prob, advantages, config, rollout_is_weights=None):
    loss_cfg = config.diffusion_loss
    advantages = torch.clamp(advantages, -loss_cfg.adv_clip_max, loss_cfg.adv_clip_max)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - loss_cfg.clip_ratio, 1.0 + loss_cfg.clip_ratio)
    per_elem_loss = torch.maximum(unclipped_loss, clipped_loss)
    if rollout_is_weights is not None:
        per_elem_loss = per_elem_loss * rollout_is_weights.detach()
    pg_loss = torch.mean(per_elem_loss)
    metrics = {
        "ppo_kl": torch.mean(-log_ratio),
        "clipfrac": torch.mean((torch.abs(ratio - 1.0) > loss_cfg.clip_ratio).float()),
        "ratio_mean": ratio.mean(),
    }
    return pg_loss, metrics


def _broadcast_sqrt_dt(sqrt_dt, target):
    if sqrt_dt.ndim == 0:
        return sqrt_dt.reshape(1, *([1] * (target.ndim - 1)))
    return sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (target.ndim - 1)))


def flow_dppo_loss(old_log_prob, log_prob, advantages, config, old_prev_sample_mean, prev_sample_mean,
                   std_dev_t, sqrt_dt, rollout_is_weights=None):
    loss_cfg = config.diffusion_loss
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if loss_cfg.add_kl_coefficient:
        sigma_t = std_dev_t * _broadcast_sqrt_dt(sqrt_dt, std_dev_t)
        kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))
    else:
        kl_per_elem = mean_diff_sq / 2
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
    high_kl_mask = kl_per_sample >= loss_cfg.kl_mask_threshold
    pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
    neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype)
    per_elem_loss = torch.where(keep_mask, unclipped_loss, zero)
    if rollout_is_weights is not None:
        per_elem_loss = per_elem_loss * rollout_is_weights.detach()
    pg_loss = torch.mean(per_elem_loss)
    metrics = {
        "ppo_kl": torch.mean(-log_ratio),
        "ratio_mean": ratio.mean(),
        "kl_new_old_mean": kl_per_sample.mean(),
        "masked_fraction": rm_mask.float().mean(),
    }
    return pg_loss, metrics


def grpo_guard_loss(old_log_prob, log_prob, advantages, config, old_prev_sample_mean, prev_sample_mean,
                    std_dev_t, sqrt_dt, rollout_is_weights=None):
    loss_cfg = config.diffusion_loss
    advantages = torch.clamp(advantages, -loss_cfg.adv_clip_max, loss_cfg.adv_clip_max)
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if mean_diff_sq.ndim > 1:
        mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio_mean_bias = mean_diff_sq / (2 * scale**2)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp((log_ratio + ratio_mean_bias) * scale)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - loss_cfg.clip_ratio, 1.0 + loss_cfg.clip_ratio)
    per_elem_loss = torch.maximum(unclipped_loss, clipped_loss)
    if rollout_is_weights is not None:
        per_elem_loss = per_elem_loss * rollout_is_weights.detach()
    pg_loss = torch.mean(per_elem_loss) / (sqrt_dt_mean**2)
    metrics = {
        "ppo_kl": torch.mean(-log_ratio),
        "clipfrac": torch.mean((torch.abs(ratio - 1.0) > loss_cfg.clip_ratio).float()),
        "ratio_mean": ratio.mean(),
    }
    return pg_loss, metrics


def kl_loss(prev_sample_mean, ref_prev_sample_mean, std_dev_t):
    # verl-omni's latents are (bs, s, c): dims (1, 2) are every non-batch dim.
    kl = ((prev_sample_mean - ref_prev_sample_mean) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * std_dev_t**2)
    return kl.mean()


def distill_fm_mse_loss(noise_pred, teacher_noise_pred):
    return ((noise_pred - teacher_noise_pred) ** 2).mean()


def dpo_loss(noise, latent, model_noise_pred, ref_noise_pred, sample_level_rewards, config):
    scores = sample_level_rewards
    chosen_scores, rejected_scores = scores[0::2], scores[1::2]
    assert not torch.any(chosen_scores < rejected_scores).item()
    beta = config.diffusion_loss.dpo_beta
    target = noise.float() - latent.float()
    model_err = ((model_noise_pred.float() - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((ref_noise_pred.float() - target) ** 2).flatten(1).mean(dim=1)
    w_diff = model_err[0::2] - ref_err[0::2]
    l_diff = model_err[1::2] - ref_err[1::2]
    inside_term = -0.5 * beta * (w_diff - l_diff)
    implicit_acc = (inside_term > 0).sum().float() / inside_term.size(0)
    loss = -F.logsigmoid(inside_term).mean()
    margins = (-0.5 * beta * w_diff - (-0.5 * beta * l_diff)).mean()
    return loss, {"implicit_acc": implicit_acc, "reward_margin": margins}


def nft_loss(forward_prediction, old_prediction, ref_forward_prediction, x0, xt, t_expanded, reward_prob,
             config):
    loss_cfg = config.diffusion_loss
    beta = loss_cfg.mix_beta
    reward_weight = reward_prob.to(dtype=x0.dtype)
    reduce_dims = tuple(range(1, x0.ndim))
    positive_prediction = beta * forward_prediction + (1.0 - beta) * old_prediction
    implicit_negative_prediction = (1.0 + beta) * old_prediction - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    positive_weight = (
        torch.abs(x0_prediction.double() - x0.double()).mean(dim=reduce_dims, keepdim=True)
        .clip(min=loss_cfg.adaptive_weight_min).to(dtype=x0_prediction.dtype))
    negative_weight = (
        torch.abs(negative_x0_prediction.double() - x0.double()).mean(dim=reduce_dims, keepdim=True)
        .clip(min=loss_cfg.adaptive_weight_min).to(dtype=negative_x0_prediction.dtype))
    positive_loss = ((x0_prediction - x0) ** 2 / positive_weight).mean(dim=reduce_dims)
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight).mean(dim=reduce_dims)
    per_sample = (reward_weight * positive_loss / beta) + ((1.0 - reward_weight) * negative_loss / beta)
    policy_loss = (per_sample * loss_cfg.adv_clip_max).mean()
    ref_kl_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=reduce_dims).mean()
    loss = policy_loss + loss_cfg.ref_kl_coef * ref_kl_loss
    return loss, {"policy_loss": policy_loss, "positive_loss": positive_loss.mean(),
                  "negative_loss": negative_loss.mean(), "kl": ref_kl_loss}


def compute_flow_grpo_outcome_advantage(scores, index, epsilon=1e-4, norm_adv_by_std_in_grpo=True,
                                        global_std=True):
    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    batch_std = torch.std(scores) if global_std else None
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx] = id2score[idx][0]
            id2std[idx] = batch_std if global_std else torch.tensor(1.0)
        else:
            st = torch.stack(id2score[idx])
            id2mean[idx] = torch.mean(st)
            id2std[idx] = batch_std if global_std else torch.std(st)
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores


def advantage_to_reward_prob(advantages, adv_clip_max, adv_mode):
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        advantages = torch.clamp(advantages, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        advantages = torch.clamp(advantages, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        advantages = torch.where(advantages > 0, torch.ones_like(advantages), torch.zeros_like(advantages))
    elif adv_mode == "binary":
        advantages = torch.sign(advantages)
    reward_prob = (advantages / adv_clip_max) / 2.0 + 0.5
    return torch.clamp(reward_prob, 0, 1)


OLD_POLICY_DECAY_SCHEDULES = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}


def old_policy_decay(step, schedule):
    warmup_steps, ramp_rate, max_decay = OLD_POLICY_DECAY_SCHEDULES[schedule]
    return 0.0 if step < warmup_steps else min((step - warmup_steps) * ramp_rate, max_decay)


def mix_grpo_window(extra):
    """_maybe_make_progressive_window, returning the window."""
    strategy = extra.get("sample_strategy", "random")
    size = int(extra["sde_window_size"])
    envelope_start, envelope_end = (int(v) for v in extra["sde_window_range"])
    max_start = envelope_end - size
    global_steps = int(extra.get("global_steps", 0))
    if strategy == "random":
        start = _random.Random(int(extra["sde_window_seed"]) + global_steps).randint(envelope_start, max_start)
        return [start, start + size]
    iters_per_group = max(1, int(extra.get("iters_per_group", 1)))
    n_advances = max(0, global_steps) // iters_per_group
    start = min(envelope_start + n_advances * size, max_start)
    return [start, start + size]


def main():
    cfg = json.load(open(sys.argv[1]))
    io = load_file(sys.argv[2])
    out = {}
    scheduler = FlowMatchEulerDiscreteScheduler(shift=cfg["shift"])
    scheduler.set_timesteps(int(cfg["num_inference_steps"]))
    sigmas = scheduler.sigmas.float()
    out["sigmas"] = sigmas.contiguous()
    dl = Obj(**cfg["diffusion_loss"])
    config = Obj(diffusion_loss=dl, kl_loss_coef=cfg["kl_loss_coef"],
                 distill_loss_coef=cfg["distill_loss_coef"], distill_loss_mode=cfg["distill_loss_mode"])

    def put(prefix, loss, metrics):
        out[f"{prefix}/loss"] = torch.as_tensor(loss, dtype=torch.float32).reshape(1)
        for k, v in metrics.items():
            out[f"{prefix}/{k}"] = torch.as_tensor(v, dtype=torch.float32).reshape(1)

    for sde_type in ("sde", "cps", "dance_sde"):
        p = sde_type + "/"
        x, prev, v = io[p + "x"], io[p + "prev"], io[p + "v"]
        # verl-omni finds each row's step by its timestep in the scheduler's table.
        table = sigmas.tolist()
        idx = torch.tensor([min(range(len(table)), key=lambda k: abs(table[k] - s))
                            for s in io[p + "sigma"].tolist()])
        assert torch.allclose(sigmas[idx + 1], io[p + "sigma_next"], atol=1e-6)
        log_prob, mean, std_dev_t, sqrt_dt = sample_previous_step(
            sigmas, x, v, idx, cfg["noise_level"], prev, sde_type)
        out[p + "log_prob"] = log_prob
        out[p + "mean"] = mean
        out[p + "std_dev_t"] = std_dev_t.reshape(-1)
        out[p + "sqrt_dt"] = sqrt_dt
        old_lp, adv = io[p + "old_log_probs"], io[p + "advantages"]
        old_mean, ref_mean = io[p + "old_prev_sample_mean"], io[p + "ref_prev_sample_mean"]
        # Latents as verl-omni packs them, (bs, s, c), for the losses that reduce dims (1, 2).
        pack = lambda t: t.reshape(t.shape[0], -1, 1)
        std3 = std_dev_t.reshape(-1, 1, 1)
        kl = kl_loss(pack(mean), pack(ref_mean), std3)
        teacher = {
            "distill_kl": kl_loss(pack(mean), pack(io[p + "teacher_prev_sample_mean"]), std3),
            "distill_fm_mse": distill_fm_mse_loss(v, io[p + "teacher_noise_pred"]),
        }
        for mode in ("flow_grpo", "dance_grpo", "flow_dppo", "grpo_guard", "kl", "distill_kl",
                     "distill_fm_mse"):
            if mode in ("flow_grpo", "dance_grpo"):
                loss, m = flow_grpo_loss(old_lp, log_prob, adv, config)
            elif mode == "flow_dppo":
                loss, m = flow_dppo_loss(old_lp, log_prob, adv, config, old_mean, mean, std_dev_t, sqrt_dt)
            elif mode == "grpo_guard":
                loss, m = grpo_guard_loss(old_lp, log_prob, adv, config, old_mean, mean, std_dev_t, sqrt_dt)
            elif mode == "kl":
                loss, m = kl, {}
            else:
                loss, m = teacher[mode], {}
            m = dict(m)
            m["policy_loss"] = loss
            # losses.py: + kl_loss_coef * kl (use_kl_loss), + distill_loss_coef * distill.
            total = loss + config.kl_loss_coef * kl + config.distill_loss_coef * teacher[config.distill_loss_mode]
            put(p + mode, total, m)

    # DiffusionNFT: the group advantages, their reward probabilities and the loss.
    rewards, uids = io["rewards"], io["uids"].tolist()
    for global_std in (True, False):
        for norm in (True, False):
            out[f"advantages/global{int(global_std)}_norm{int(norm)}"] = compute_flow_grpo_outcome_advantage(
                rewards, uids, norm_adv_by_std_in_grpo=norm, global_std=global_std)
    adv = compute_flow_grpo_outcome_advantage(rewards, uids)
    for mode in cfg["adv_modes"]:
        out[f"reward_prob/{mode}"] = advantage_to_reward_prob(adv, dl.adv_clip_max, mode)
    n = {k[4:]: t for k, t in io.items() if k.startswith("nft/")}
    t_expanded = n["t"].reshape(-1, *([1] * (n["x0"].ndim - 1)))
    loss, m = nft_loss(n["v"], n["v_old"], n["v_ref"], n["x0"], n["xt"], t_expanded, n["r"], config)
    put("nft", loss, m)
    d = {k[4:]: t for k, t in io.items() if k.startswith("dpo/")}
    loss, m = dpo_loss(d["noise"], d["latent"], d["pred"], d["ref_pred"], d["scores"], config)
    put("dpo", loss, m)

    for schedule in OLD_POLICY_DECAY_SCHEDULES:
        out[f"decay/{schedule}"] = torch.tensor([old_policy_decay(s, schedule) for s in cfg["decay_steps"]],
                                                dtype=torch.float64)
    for name, case in cfg["windows"].items():
        out[f"window/{name}"] = torch.tensor(
            [mix_grpo_window({**case, "global_steps": s}) for s in case["steps"]], dtype=torch.int64)
    save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[3])


if __name__ == "__main__":
    main()
