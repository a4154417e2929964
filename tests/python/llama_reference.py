"""Independent LLaMA / Qwen2 decoder in plain torch (no transformers), written from HF's modeling
code: reads config.json + model.safetensors, writes the fp32 logits of the given tokens.

usage: llama_reference.py MODEL_DIR TOKENS_CSV ROWS OUT_FILE
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


def main():
    model_dir, tokens_csv, rows, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_default_dtype(torch.float64)  # the reference runs in fp64
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    w = {k: v.double() for k, v in safetensors_io.load(os.path.join(model_dir, "model.safetensors")).items()}
    tokens = torch.tensor([int(t) for t in tokens_csv.split(",")]).view(rows, -1)
    B, T = tokens.shape
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    hd = D // H
    eps = cfg["rms_norm_eps"]

    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).double() / hd))
    freqs = torch.outer(torch.arange(T).double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def lin(x, name):
        y = x @ w[name + ".weight"].t()
        if name + ".bias" in w:
            y = y + w[name + ".bias"]
        return y

    x = w["model.embed_tokens.weight"][tokens]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj").view(B, T, H, hd).transpose(1, 2)
        k = lin(h, p + "self_attn.k_proj").view(B, T, KV, hd).transpose(1, 2)
        v = lin(h, p + "self_attn.v_proj").view(B, T, KV, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # HF's repeat_kv: kv head j serves query heads j * n_rep ... (j + 1) * n_rep - 1
        k = k[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
        v = v[:, :, None].expand(B, KV, H // KV, T, hd).reshape(B, H, T, hd)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        a = (att @ v).transpose(1, 2).reshape(B, T, D)
        x = x + lin(a, p + "self_attn.o_proj")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = lin(h, p + "mlp.gate_proj")
        x = x + lin(torch.nn.functional.silu(gate) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    safetensors_io.write_raw(x @ head.t(), out)


if __name__ == "__main__":
    main()
