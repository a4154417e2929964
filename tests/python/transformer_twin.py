"""PyTorch twin of ShardRL's built-in transformer (src/models/transformer.cpp), module for module:
the same parameter names, shapes and computation (manual causal attention, exact GELU). The bf16
test and the benchmarks' PyTorch baselines build it."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# Mirrors src/models/transformer.cpp module for module, so parameter names, shapes and the
# computation (manual causal attention, exact GELU) are the same as the C++ model's.
class Block(nn.Module):
    def __init__(self, d_model, n_heads, mlp_ratio):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

    def attention(self, x):
        B, T, D = x.shape
        hd = D // self.n_heads

        def heads(t):
            return t.view(B, T, self.n_heads, hd).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.matmul(torch.softmax(scores, -1), v)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab_size, max_seq_len, d_model, n_heads, n_layers, mlp_ratio=4):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        assert T <= self.max_seq_len, f"sequence length {T} exceeds max_seq_len {self.max_seq_len}"
        positions = torch.arange(T, dtype=torch.long, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
