"""verl's LLM advantage estimators and policy losses, written from verl's
verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py (github.com/verl-project/verl),
against ShardRL's algos (tests/test_lm_algos.cpp).

The C++ test writes the fixed inputs and its own results to IN_FILE (safetensors); this script
recomputes every result as verl does and prints one check per result (checks.py). Inputs:
  rewards, mask, values, old_log_prob, log_prob, advantages [B, L] fp32; uids [B] int64;
  reward_baselines [B]; logits [B, L, V]; config [5] fp64 = (gamma, lam, clip_ratio_low,
  clip_ratio_high, clip_ratio_c); metric [B] (dynamic sampling's); overlong_config [3] fp64 =
  (max_response_length, overlong_buffer.len, overlong_buffer.penalty_factor).
ShardRL's results are named ours/...: adv/<estimator>, ret/<estimator>, adv/grpo_no_std,
pg_loss/<mode>/<agg>, grad/<mode>/<agg> (d pg_loss / d log_prob), clipfrac/<mode>,
clipfrac_lower/<mode>, ppo_kl/<mode>, agg/<agg> (of the values), entropy, overlong (the
penalty of each row's response length), kept (the uids dynamic sampling keeps).

usage: verl_lm_algos_reference.py IN_FILE
"""
import sys
from collections import defaultdict

import numpy as np
import torch
from safetensors.torch import load_file

from checks import failed, relative_error, report


# verl/utils/torch_functional.py
def masked_sum(values, mask, axis=None):
    return (values * mask).sum(axis=axis) if axis is not None else (values * mask).sum()


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8) if axis is not None else s / (mask.sum() + 1e-8)


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


# verl/trainer/ppo/core_algos.py: the advantage estimators
def gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean, id2std = {}, {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype)
            id2std[idx] = torch.tensor(1.0, dtype=scores.dtype)
        else:
            t = torch.stack(id2score[idx])
            id2mean[idx] = torch.mean(t)
            id2std[idx] = torch.std(t)
    for i in range(bsz):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def group_scores(scores, index):
    """verl's id2score / id2mean of rloo and reinforce_plus_plus_baseline: a lone response's
    mean is 0."""
    id2score = defaultdict(list)
    id2mean = {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype)
        else:
            id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
    return id2score, id2mean


def rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = group_scores(scores, index)
    for i in range(scores.shape[0]):
        response_num = len(id2score[index[i]])
        if response_num > 1:
            scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[
                index[i]] * response_num / (response_num - 1)
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def reinforce_plus_plus(token_level_rewards, response_mask, gamma):
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = new_running_return * response_mask[:, t]
        running_return = new_running_return * response_mask[:, t] + running_return * (
            1 - response_mask[:, t])
    advantages = masked_whiten(returns, response_mask)
    advantages = advantages * response_mask
    return advantages, returns


def reinforce_plus_plus_baseline(token_level_rewards, response_mask, index):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    _, id2mean = group_scores(scores, index)
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
    scores = masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def remax(token_level_rewards, reward_baselines, response_mask):
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


# verl/trainer/ppo/core_algos.py: agg_loss on one rank (dp_size 1, no global batch info)
def agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        loss = masked_sum(seq_losses, seq_mask) / seq_mask.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_mask.shape[-1]
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return masked_sum(seq_losses, seq_mask) / seq_mask.sum()
    raise ValueError(loss_agg_mode)


# verl/trainer/ppo/core_algos.py: compute_value_loss (verl_F.clip_by_value is max(min(x, hi), lo))
def value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


# the policy losses: (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)
def vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, c):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, c):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach(
    ).unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.tensor(0.0)


def gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, c):
    pg_losses = -log_prob * advantages
    return agg_loss(pg_losses, response_mask, loss_agg_mode), None, None, None


def geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, c):
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -low, high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl,
                                       sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) /
                      (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# recipe/dapo: the DAPO reward manager's overlong penalty, one response at a time
def overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, penalty_factor):
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * penalty_factor, 0)


# recipe/dapo's dynamic sampling: the prompts whose metric varies, or that have one response
def kept_prompt_uids(metric, index):
    prompt_uid2metric_vals = defaultdict(list)
    for uid, metric_val in zip(index, metric):
        prompt_uid2metric_vals[uid].append(metric_val)
    prompt_uid2metric_std = {}
    for prompt_uid, metric_vals in prompt_uid2metric_vals.items():
        prompt_uid2metric_std[prompt_uid] = np.std(metric_vals)
    return [uid for uid, std in prompt_uid2metric_std.items()
            if std > 0 or len(prompt_uid2metric_vals[uid]) == 1]


LOSSES = {"vanilla": vanilla, "gspo": gspo, "gpg": gpg, "geo_mean": geo_mean}
AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
        "seq-mean-token-sum-norm"]


def check(name, want, io, tol=1e-5):
    got = io.get("ours/" + name)
    if got is None:
        report(name, False, error="ShardRL's result is missing")
        return
    err = relative_error(got.double(), want.detach().double())
    report(name, err <= tol, max_error=err)


def main():
    io = load_file(sys.argv[1])
    gamma, lam, low, high, c = io["config"].tolist()
    rewards, mask, values = io["rewards"].double(), io["mask"].double(), io["values"].double()
    index = io["uids"].tolist()
    cases = {
        "gae": lambda: gae(rewards, values, mask, gamma, lam),
        "grpo": lambda: grpo(rewards.clone(), mask, index),
        "grpo_no_std": lambda: grpo(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=False),
        "rloo": lambda: rloo(rewards.clone(), mask, index),
        "reinforce_plus_plus": lambda: reinforce_plus_plus(rewards, mask, gamma),
        "reinforce_plus_plus_baseline":
            lambda: reinforce_plus_plus_baseline(rewards.clone(), mask, index),
        "remax": lambda: remax(rewards, io["reward_baselines"].double(), mask),
    }
    for name, run in cases.items():
        adv, ret = run()
        check("adv/" + name, adv, io)
        if name != "grpo_no_std":
            check("ret/" + name, ret, io)

    old = io["old_log_prob"].double()
    adv_in = io["advantages"].double()
    for mode, fn in LOSSES.items():
        for agg in AGGS:
            log_prob = io["log_prob"].double().requires_grad_(True)
            pg_loss, clipfrac, ppo_kl, lower = fn(old, log_prob, adv_in, mask, agg, low, high, c)
            pg_loss.backward()
            check(f"pg_loss/{mode}/{agg}", pg_loss, io)
            check(f"grad/{mode}/{agg}", log_prob.grad, io)
        if clipfrac is not None:
            check("clipfrac/" + mode, clipfrac, io)
            check("ppo_kl/" + mode, ppo_kl, io)
            check("clipfrac_lower/" + mode, lower, io)
    cliprange_value = io["cliprange_value"].item()
    for agg in AGGS:
        check("agg/" + agg, agg_loss(values, mask, agg), io)
        vpreds = io["vpreds"].double().requires_grad_(True)
        vf_loss, vf_clipfrac = value_loss(
            vpreds, io["returns"].double(), values, mask, cliprange_value, agg)
        vf_loss.backward()
        check("vf_loss/" + agg, vf_loss, io)
        check("vf_grad/" + agg, vpreds.grad, io)
    check("vf_clipfrac", vf_clipfrac, io)
    check("entropy", entropy_from_logits(io["logits"].double()), io)
    max_len, buffer_len, factor = io["overlong_config"].tolist()
    check("overlong", torch.tensor([
        overlong_reward(n, int(max_len), int(buffer_len), factor)
        for n in io["mask"].sum(-1).tolist()], dtype=torch.float64), io)
    kept = kept_prompt_uids(io["metric"].tolist(), index)
    ours = io["ours/kept"].tolist()
    report("kept", ours == kept, ours=ours, verl=kept)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
