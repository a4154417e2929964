// The decoder's KV cache: what sampling keeps of every layer's keys and values between tokens.
#pragma once

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace shardrl::models {

// Keys and values of every layer seen so far; one per sequence batch being sampled.
struct KVCache {
  KVCache() = default;
  // Room for `capacity` positions, allocated at the first forward and written in place (HF's
  // StaticCache): without it each token's keys and values are concatenated to the cache, which
  // copies all of it at every token.
  explicit KVCache(int64_t capacity) : capacity(capacity) {}

  std::vector<torch::Tensor> keys, values;  // per layer: [B, kv_heads, past, head_dim]
  int64_t capacity = 0;                     // 0: grows by concatenation
  // With a capacity: per layer [B, kv_heads, capacity, head_dim]; keys and values view them.
  std::vector<torch::Tensor> key_buffers, value_buffers;

  int64_t length() const { return keys.empty() || !keys[0].defined() ? 0 : keys[0].size(2); }
  // Appends this step's keys and values [B, kv_heads, T, head_dim] to `layer`; returns the
  // layer's keys and values so far.
  std::pair<torch::Tensor, torch::Tensor> append(size_t layer, const torch::Tensor& k,
                                                 const torch::Tensor& v);
  // Keeps the rows `indices` (int64 [B']; a row may repeat) in that order, as HF's
  // batch_select_indices: a prompt prefilled once serves its n samples, and finished rows leave
  // the batch.
  void batch_select_indices(const torch::Tensor& indices);
};

}  // namespace shardrl::models
