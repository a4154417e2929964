"""Flow-GRPO's SDE and CPS steps as flow_grpo computes them (tests/test_diffusion_sd3.cpp).

Written from yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
(sde_step_with_logprob, sde_type "sde" and "cps"), with the sigmas of diffusers'
FlowMatchEulerDiscreteScheduler (SD3's scheduler) rather than ShardRL's. With
dt = sigma_prev - sigma (sigma_prev: the next, smaller noise level):

  sde: std_dev_t = sqrt(sigma / (1 - (sigma == 1 ? sigmas[1] : sigma))) * noise_level
       mean = x (1 + std^2 / (2 sigma) dt) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt
       log_prob = mean over elements of the Gaussian log-density N(prev; mean, (std sqrt(-dt))^2)
  cps: std_dev_t = sigma_prev sin(noise_level pi / 2)
       x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v
       mean = (1 - sigma_prev) x0_hat + sqrt(sigma_prev^2 - std^2) x1_hat
       log_prob = mean over elements of -(prev - mean)^2  (flow_grpo drops every constant)

usage: flow_grpo_step_reference.py IN_FILE OUT_FILE
  IN_FILE (safetensors): v, x, prev [S, B, C, H, W] (S cases), steps [S] int64 step indices,
  config [3] fp64 = (num_inference_steps, shift, noise_level).
  OUT_FILE: {sde,cps}_{mean,std,log_prob}: mean [S, B, C, H, W], std and log_prob [S, B].
"""
import math
import sys

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file, save_file


def step(sigmas, v, x, prev, index, noise_level, sde_type):
    v, x, prev = v.double(), x.double(), prev.double()
    shape = (-1,) + (1,) * (x.dim() - 1)
    sigma = sigmas[index].double().expand(x.shape[0]).reshape(shape)
    sigma_prev = sigmas[index + 1].double().expand(x.shape[0]).reshape(shape)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (
            1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        s = std_dev_t * torch.sqrt(-dt)
        log_prob = -((prev - mean) ** 2) / (2 * s**2) - torch.log(s) - math.log(
            math.sqrt(2 * math.pi))
    else:
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sigma * v
        x1_hat = x + v * (1 - sigma)
        mean = x0_hat * (1 - sigma_prev) + x1_hat * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        log_prob = -((prev - mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.dim())))
    return mean, std_dev_t.reshape(-1), log_prob


def main():
    io = load_file(sys.argv[1])
    steps, shift, noise_level = io["config"].tolist()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(int(steps))
    sigmas = scheduler.sigmas.float()
    out = {}
    for sde_type in ("sde", "cps"):
        results = [step(sigmas, io["v"][i], io["x"][i], io["prev"][i], int(j), noise_level, sde_type)
                   for i, j in enumerate(io["steps"].tolist())]
        for k, name in enumerate(("mean", "std", "log_prob")):
            out[f"{sde_type}_{name}"] = torch.stack([r[k] for r in results]).float().contiguous()
    out["sigmas"] = sigmas.contiguous()
    save_file(out, sys.argv[2])


if __name__ == "__main__":
    main()
