"""Independent LLaMA / Qwen2 / Qwen3 decoder in plain torch (no transformers), written from HF's
modeling code: reads config.json + model.safetensors, writes the fp64-computed logits of the given
tokens as fp32.

usage: llama_reference.py MODEL_DIR TOKENS_CSV ROWS OUT_FILE [MASK_CSV]

MASK_CSV (HF's attention_mask, 1 for a token, 0 for padding; left padding) hides padding keys from
every query and counts each row's positions over its tokens only (position_ids = cumsum - 1).
Covers head_dim given apart from hidden / heads, Qwen3's per-head q/k RMSNorm before RoPE, and
rope_parameters (or rope_scaling) of type llama3.
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import safetensors_io  # noqa: E402


def rms_norm(x, w, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(cfg, hd):
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2).double() / hd))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv_freq
    assert kind == "llama3", kind
    # Llama 3.1's scaling (Meta's apply_scaling): long wavelengths divided by the factor, short ones
    # kept, the band between interpolated linearly in 1 / wavelength.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope.get("original_max_position_embeddings", cfg["max_position_embeddings"])
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < context / high:
            out.append(f)
        elif wavelen > context / low:
            out.append(f / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out)


def main():
    model_dir, tokens_csv, rows, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_default_dtype(torch.float64)  # the reference runs in fp64
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    w = {k: v.double() for k, v in safetensors_io.load(os.path.join(model_dir, "model.safetensors")).items()}
    tokens = torch.tensor([int(t) for t in tokens_csv.split(",")]).view(rows, -1)
    B, T = tokens.shape
    if len(sys.argv) > 5:
        valid = torch.tensor([int(t) for t in sys.argv[5].split(",")]).view(rows, -1).bool()
    else:
        valid = torch.ones(B, T, dtype=torch.bool)
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    hd = cfg.get("head_dim") or D // H
    eps = cfg["rms_norm_eps"]

    positions = (valid.long().cumsum(1) - 1).clamp(min=0).double()
    freqs = positions[..., None] * inverse_frequencies(cfg, hd)  # [B, T, hd / 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, hd]
    cos, sin = emb.cos(), emb.sin()

    def lin(x, name):
        y = x @ w[name + ".weight"].t()
        if name + ".bias" in w:
            y = y + w[name + ".bias"]
        return y

    # A query sees its row's earlier tokens, and itself.
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]
    allowed |= torch.eye(T, dtype=torch.bool)[None]
    mask = torch.zeros(B, 1, T, T).masked_fill(~allowed[:, None], float("-inf"))
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj").view(B, T, H, hd)
        k = lin(h, p + "self_attn.k_proj").view(B, T, KV, hd)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: per head, before RoPE
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = lin(h, p + "self_attn.v_proj").view(B, T, KV, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # HF's repeat_kv: kv head j serves query heads j * n_rep ... (j + 1) * n_rep - 1
        k = k[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
        v = v[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        a = (att @ v).transpose(1, 2).reshape(B, T, H * hd)
        x = x + lin(a, p + "self_attn.o_proj")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = lin(h, p + "mlp.gate_proj")
        x = x + lin(torch.nn.functional.silu(gate) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    safetensors_io.write_raw(x @ head.t(), out)


if __name__ == "__main__":
    main()
