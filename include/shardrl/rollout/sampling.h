// Language-model rollouts with the decoder's KV cache: temperature and top-p (nucleus) sampling,
// per-token log-probs of the sampled tokens, EOS handling and verl's response mask.
//
// Log-prob convention (verl's): a recorded log-prob is log_softmax(logits / temperature) at the
// sampled token, over the whole vocabulary, before top-p filtering. That is what the actor
// recomputes in training (response_log_probs() below, and verl's compute_log_prob, divide the
// logits by the rollout temperature and know nothing of top-p), so the PPO ratio of an unchanged
// policy is exactly 1. With top_p < 1 the tokens are drawn from the renormalised nucleus, whose
// log-prob is higher by -log(nucleus mass). Greedy decoding (temperature 0) records
// log_softmax(logits), i.e. temperature 1.
#pragma once

#include <torch/torch.h>

#include <optional>

#include "shardrl/models/llama.h"

namespace shardrl::rollout {

struct SamplingOptions {
  int64_t max_new_tokens = 16;
  double temperature = 0.0;   // 0: greedy; > 0: sample from softmax(logits / temperature)
  double top_p = 1.0;         // in (0, 1]: keep the smallest top set holding this much mass
  int64_t eos_token_id = -1;  // a row ends once it emits this (-1: never)
  int64_t pad_token_id = -1;  // fills a row after its eos (-1: the eos id)
  // Rows sampled per prompt (HF's num_return_sequences; GRPO's rollout.n): each prompt is
  // prefilled once and its KV cache copied to its rows, which come out consecutive.
  int64_t num_return_sequences = 1;
  // Seeded generator for the draws: the same seed gives the same rollout.
  std::optional<at::Generator> generator;
  // Record the entropy of each sampled position's distribution, softmax(logits / temperature)
  // over the whole vocabulary (verl's actor/entropy): Rollout::entropy.
  bool record_entropy = false;
};

struct Rollout {
  torch::Tensor prompts;         // [B, P] int64
  torch::Tensor responses;       // [B, L] int64; after a row's eos: pad_token_id
  torch::Tensor sequences;       // [B, P + L] prompts then responses
  torch::Tensor log_probs;       // [B, L] fp32, see the convention above; 0 outside the mask
  torch::Tensor response_mask;   // [B, L] fp32: 1 up to and including a row's eos, then 0
  torch::Tensor attention_mask;  // [B, P + L] int64: the prompt's mask, then ones
  torch::Tensor entropy;  // [B, L] fp32 with record_entropy (0 outside the mask), else undefined
};

// Continues every row of `prompts` [B, P] num_return_sequences (n) times with the KV cache,
// without grad: the Rollout has B * n rows, prompt i's in rows [i * n, (i + 1) * n). L =
// max_new_tokens, or fewer when every row has ended. Prompts of different lengths are left-padded,
// with `prompt_mask` [B, P] (1 for a token, 0 for padding; undefined: no padding): each row then
// continues as it would alone (see models::LlamaForCausalLM::forward). A sharded model is gathered
// once for the whole rollout (fsdp::UnshardScope), not per token.
Rollout sample(models::LlamaForCausalLM& model, const torch::Tensor& prompts,
               const SamplingOptions& options, const torch::Tensor& prompt_mask = {});

// sample(...).sequences.
torch::Tensor generate(models::LlamaForCausalLM& model, const torch::Tensor& prompt,
                       const SamplingOptions& options);

// Teacher-forced log-probs of the last sequences.size(1) - prompt_length tokens of `sequences`
// under log_softmax(logits / temperature) (temperature 0 counts as 1): [B, L] fp32, with grad
// when grad mode is on. The old-policy, reference and current log-probs of PPO/GRPO.
// attention_mask [B, total] for left-padded prompts (Rollout::attention_mask), or undefined.
// Under sequence parallelism only these log-probs are gathered (models::LlamaForCausalLM::forward).
torch::Tensor response_log_probs(models::LlamaForCausalLM& model, const torch::Tensor& sequences,
                                 int64_t prompt_length, double temperature,
                                 const torch::Tensor& attention_mask = {});

// The same log-probs with the padding removed (verl's use_remove_padding): each row's valid
// prompt tokens (attention_mask) and its response up to response_mask's last 1 go into one
// packed row (models::pack_sequences), so the decoder computes nothing on padding and its time
// follows the real tokens. Positions where response_mask is 0 get 0. Equal to
// response_log_probs where response_mask is 1.
// share_prompts (verl's use_prefix_grouper): consecutive rows with the same prompt (a GRPO
// group) pack it once, and each answer attends to that copy (models::pack_sequences); the
// log-probs and their gradients are those of the padded rows, for a prompt's compute once a group.
torch::Tensor packed_response_log_probs(models::LlamaForCausalLM& model,
                                        const torch::Tensor& sequences, int64_t prompt_length,
                                        double temperature, const torch::Tensor& attention_mask,
                                        const torch::Tensor& response_mask,
                                        bool share_prompts = false);

// The critic's values of the response tokens: token j's is the value model's output at the
// position before it (the state it is sampled from, as verl's critic reads
// values[:, -response_length - 1 : -1]). [B, L] fp32, 0 where response_mask is 0, with grad when
// grad mode is on. attention_mask as response_log_probs'.
torch::Tensor response_values(models::LlamaForTokenClassification& model,
                              const torch::Tensor& sequences, int64_t prompt_length,
                              const torch::Tensor& attention_mask,
                              const torch::Tensor& response_mask);
// The same values on packed tokens (use_remove_padding), as packed_response_log_probs packs them.
torch::Tensor packed_response_values(models::LlamaForTokenClassification& model,
                                     const torch::Tensor& sequences, int64_t prompt_length,
                                     const torch::Tensor& attention_mask,
                                     const torch::Tensor& response_mask);

}  // namespace shardrl::rollout
