// A small GPT-style transformer: the built-in model for tests, benchmarks and the first demo.
// Each block is an fsdp::Unit, so sharding it needs no change to the model code.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "shardrl/fsdp.h"
#include "shardrl/models/layers.h"
#include "shardrl/models/lora.h"

namespace shardrl::models {

struct TransformerConfig {
  int64_t vocab_size = 97;  // deliberately not divisible by small world sizes
  int64_t max_seq_len = 64;
  int64_t d_model = 48;
  int64_t n_heads = 4;
  int64_t n_layers = 2;
  int64_t mlp_ratio = 4;
  int64_t parameter_count() const;
  // The fields as config.json carries them in checkpoints and exports.
  nlohmann::json to_json() const;
  static TransformerConfig from_json(const nlohmann::json& j);  // errors name the field
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const TransformerConfig& config);
  torch::Tensor forward(torch::Tensor x);

  // Recompute this block's activations in backward instead of keeping them (see
  // activation_checkpoint.h).
  bool checkpoint_activations = false;

 private:
  torch::Tensor compute(const torch::Tensor& x);
  torch::Tensor attention(const torch::Tensor& x);
  int64_t n_heads_;
  LayerNorm ln1_{nullptr}, ln2_{nullptr};
  // LoraLinear: a models::Linear until an adapter is added (lora::apply_lora).
  lora::LoraLinear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, proj_{nullptr},
      fc1_{nullptr}, fc2_{nullptr};
};

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const TransformerConfig& config);
  // tokens [B, T] int64 -> logits [B, T, vocab]
  torch::Tensor forward(torch::Tensor tokens);
  std::vector<fsdp::Unit<BlockImpl>>& blocks() { return blocks_; }
  const TransformerConfig& config() const { return config_; }
  // Activation checkpointing per block (see activation_checkpoint.h).
  void set_activation_checkpointing(bool enabled);

 private:
  friend void shard_transformer(fsdp::Unit<TransformerImpl>& model, const dist::DeviceMesh& mesh,
                                const fsdp::Options& options);
  TransformerConfig config_;
  fsdp::Unit<EmbeddingImpl> tok_emb_{nullptr};
  Embedding pos_emb_{nullptr};
  std::vector<fsdp::Unit<BlockImpl>> blocks_;
  LayerNorm ln_f_{nullptr};
  fsdp::Unit<LinearImpl> head_{nullptr};
};

using Transformer = fsdp::Unit<TransformerImpl>;

// Shards as FSDP2's usual recipe (models::shard_by_block): every block, the token embedding and
// the head are units of their own, and the root keeps the position embedding and the final norm.
// The head's gradient is reduced while the blocks' backward runs, not after it.
void shard_transformer(Transformer& model, const dist::DeviceMesh& mesh,
                       const fsdp::Options& options);

// Mean next-token cross-entropy of logits [B, T, V] against tokens [B, T] (predicting t+1).
torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& tokens);

}  // namespace shardrl::models
