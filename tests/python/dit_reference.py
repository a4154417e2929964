"""Independent DiT (flow-matching velocity head) in plain torch, written from facebookresearch/DiT's
models.py: reads config.json + model.safetensors and inputs.safetensors (x, t, y), writes the fp32
velocity.

usage: dit_reference.py MODEL_DIR INPUTS OUT_FILE
"""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import safetensors_io  # noqa: E402


def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000 ** omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float64) / half)
    args = t[:, None].double() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def main():
    model_dir, inputs_path, out = sys.argv[1:4]
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    w = {k: v.double() for k, v in safetensors_io.load(os.path.join(model_dir, "model.safetensors")).items()}
    inputs = safetensors_io.load(inputs_path)
    x, t, y = inputs["x"].double(), inputs["t"].double(), inputs["y"].long()
    D, p, C, H = cfg["hidden_size"], cfg["patch_size"], cfg["in_channels"], cfg["num_heads"]
    g = cfg["input_size"] // p

    def lin(h, name):
        return F.linear(h, w[name + ".weight"], w.get(name + ".bias"))

    def norm(h):
        return F.layer_norm(h, (D,), eps=1e-6)

    h = F.conv2d(x, w["x_embedder.proj.weight"], w["x_embedder.proj.bias"], stride=p)
    h = h.flatten(2).transpose(1, 2) + torch.from_numpy(get_2d_sincos_pos_embed(D, g))[None]
    temb = timestep_embedding(t * cfg["timestep_scale"], cfg["frequency_embedding_size"])
    c = lin(F.silu(lin(temb, "t_embedder.mlp.0")), "t_embedder.mlp.2")
    c = c + w["y_embedder.embedding_table.weight"][y]
    N, T = h.shape[0], h.shape[1]
    for i in range(cfg["depth"]):
        b = f"blocks.{i}."
        mod = lin(F.silu(c), b + "adaLN_modulation.1").chunk(6, dim=1)
        a = modulate(norm(h), mod[0], mod[1])
        qkv = lin(a, b + "attn.qkv").reshape(N, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = ((q @ k.transpose(-2, -1)) * (D // H) ** -0.5).softmax(dim=-1)
        a = (att @ v).transpose(1, 2).reshape(N, T, D)
        h = h + mod[2].unsqueeze(1) * lin(a, b + "attn.proj")
        m = modulate(norm(h), mod[3], mod[4])
        m = lin(F.gelu(lin(m, b + "mlp.fc1"), approximate="tanh"), b + "mlp.fc2")
        h = h + mod[5].unsqueeze(1) * m
    shift, scale = lin(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    h = lin(modulate(norm(h), shift, scale), "final_layer.linear")
    h = h.reshape(N, g, g, p, p, C)
    h = torch.einsum("nhwpqc->nchpwq", h).reshape(N, C, g * p, g * p)
    safetensors_io.write_raw(h, out)


if __name__ == "__main__":
    main()
