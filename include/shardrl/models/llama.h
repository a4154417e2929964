// The LLaMA-family causal decoders people post-train: Llama (2, 3.x with its RoPE scaling), Qwen2
// and Qwen3 (per-head q/k RMSNorm, head_dim given apart from hidden / heads). RMSNorm, rotary
// embeddings, SwiGLU MLP, grouped-query attention through at::scaled_dot_product_attention (no
// [T, T] scores kept on the CPU's flash kernel), tied or untied embeddings and a KV cache for
// sampling.
//
// Parameter names and config.json fields are those of Hugging Face transformers' Llama / Qwen2 /
// Qwen3 (`model.layers.0.self_attn.q_proj.weight`, `num_key_value_heads`, ...), so weights move
// between ShardRL and transformers as safetensors without renaming. Every projection is a
// LoraLinear, so lora::apply_lora() can target them by their HF names ("q_proj", "v_proj", ...).
// Each decoder layer is an fsdp::Unit, and so are the embeddings and the untied head;
// shard_llama() shards them by the block wrap policy (wrap_policy.h).
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "shardrl/fsdp.h"
#include "shardrl/models/kv_cache.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/weights.h"
#include "shardrl/models/wrap_policy.h"
#include "shardrl/ulysses.h"

namespace shardrl::models {

// transformers' rope_parameters (rope_scaling before transformers 5): the rotary frequencies.
struct RopeParameters {
  std::string rope_type = "default";  // "default", or "llama3" (Llama 3.1 and later)
  double rope_theta = 10000.0;
  // llama3: wavelengths above original_max_position_embeddings / low_freq_factor are stretched by
  // `factor`, those below original_max_position_embeddings / high_freq_factor kept, and those
  // between blended smoothly (transformers' _compute_llama3_parameters).
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;
};

struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // < num_attention_heads: grouped-query attention
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  RopeParameters rope_parameters;
  bool tie_word_embeddings = false;
  // q/k/v/o biases (llama, qwen3); Qwen2 always has q/k/v biases and no o bias.
  bool attention_bias = false;
  // 0: hidden_size / num_attention_heads (Llama's default). Qwen3 gives it apart (Qwen3-0.6B:
  // 16 heads of 128 in a hidden size of 1024).
  int64_t head_dim = 0;
  // "llama", "qwen2" or "qwen3" (per-head RMSNorm of q and k before RoPE: q_norm, k_norm).
  std::string model_type = "llama";

  int64_t attention_head_dim() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
  bool qk_norm() const { return model_type == "qwen3"; }
  // Errors name the field at fault.
  void validate() const;
  // What transformers' save_pretrained writes for the model (rope_parameters; rope_theta and, for
  // llama3 scaling, rope_scaling as well, for readers before transformers 5).
  nlohmann::json to_json() const;
  // Reads HF field names; absent optional fields take the model type's defaults in transformers,
  // absent required ones and wrong types are errors naming the field. A field that changes the
  // model's math and is not implemented (another rope type, a sliding window in use, experts,
  // quantization, attention dropout, ...) is an error naming it, never ignored.
  static LlamaConfig from_json(const nlohmann::json& j);
  // A config.json; its errors name the file (and the field).
  static LlamaConfig load(const std::string& config_json_path);
  void save(const std::string& config_json_path) const;
};

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Which keys each query of an attention forward sees.
struct AttentionMask {
  // Bool, true where a query may see a key: [T, past + T], or [B, 1, T, past + T] per row (left
  // padding); or the same as floats added to the scores (0 where a query may see a key, -inf
  // where not), as LlamaModel builds it once for all its layers. Undefined: `causal` says.
  torch::Tensor allowed;
  // Without `allowed`: true, each query sees the keys at its own position and before (queries and
  // keys at the same positions: the kernels' is_causal, no mask built); false, every key (one new
  // token after a cache).
  bool causal = true;
  // Packed sequences (PackedSequences): the tokens of one row are these sequences back to back,
  // and each query sees the earlier keys of its own sequence only (flash-attn's varlen, as verl's
  // use_remove_padding runs it). Empty: the row is one sequence.
  std::vector<int64_t> sequence_lengths;
  // Per packed sequence, or empty for none: how many keys at the start of the last earlier
  // sequence with no shared prefix its queries see before their own (a GRPO group's prompt packed
  // once for all its answers, PackedSequences::shared_prefix).
  std::vector<int64_t> shared_prefix;
};

// Several sequences in one row without their padding (verl's use_remove_padding; flash-attn's
// unpad_input): tokens [1, N], the valid tokens of every row concatenated, position_ids [1, N]
// counting from 0 in each sequence, so every token computes what it does in its padded row.
struct PackedSequences {
  torch::Tensor tokens;
  torch::Tensor position_ids;
  std::vector<int64_t> lengths;  // tokens of each sequence, in order; they sum to N
  // [N]: where each packed token sits in the padded batch, flattened (row * T + column).
  torch::Tensor indices;
  // [B * T]: the packed index that computes each position of the padded batch, -1 at padding. A
  // row whose prompt is shared points its prompt positions at the packed copy it shares.
  torch::Tensor packed_index;
  // Per sequence, or empty when no prompt is shared: the tokens of the last earlier sequence
  // without a shared prefix (its leader, which starts with the prompt) that this sequence attends
  // to before its own (AttentionMask::shared_prefix).
  std::vector<int64_t> shared_prefix;
};

// The tokens of `tokens` [B, T] where `valid` [B, T] (bool, or 0/1) is set, row by row. A row
// with no valid token is an error naming it.
// With shared_prefix_length P > 0 (verl's use_prefix_grouper), a row whose first P columns equal
// the row's before it, tokens and validity alike, packs only its tokens after them: it attends
// to the first row of its run's prompt, computed once, and keeps the positions of its padded
// row, so every token computes what it would in its padded row. A row that shares its prompt and
// has nothing after it packs no sequence.
PackedSequences pack_sequences(const torch::Tensor& tokens, const torch::Tensor& valid,
                               int64_t shared_prefix_length = 0);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  // x [B, T, D]; cos/sin [T, head_dim], or [B, 1, T, head_dim] with per-row positions, for the
  // positions of x. With a cache, attends to the cached keys too and appends this step's keys and
  // values to `layer` of it.
  // Under sequence parallelism (set_sequence_parallel, no cache), x, cos and sin are this rank's
  // slice of the sequence and `mask` covers the whole padded sequence: Ulysses' all-to-alls give
  // each rank every position for heads / sp of the heads.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionMask& mask, KVCache* cache, size_t layer);
  void set_sequence_parallel(dist::ProcessGroup* group) { sequence_parallel_ = group; }
  lora::LoraLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // Qwen3: RMSNorm over each head's head_dim of q and k, before RoPE (null otherwise).
  RMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
  dist::ProcessGroup* sequence_parallel_ = nullptr;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& x);  // down(silu(gate(x)) * up(x))
  lora::LoraLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& config, size_t index);
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        const AttentionMask& mask, KVCache* cache);
  // Recompute this layer's activations in backward instead of keeping them (not with a cache,
  // which sampling uses without grad anyway).
  bool checkpoint_activations = false;
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  torch::Tensor compute(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionMask& mask, KVCache* cache);
  size_t index_;
};

// HF's LlamaModel: registered as "model" so the names carry its prefix.
class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& config);
  // -> hidden states; attention_mask as LlamaForCausalLM's. Under sequence parallelism without a
  // cache, tokens and attention_mask hold whole sequences on every rank of the group and the
  // result is this rank's slice of the hidden states (ulysses::sequence_slice of the length).
  torch::Tensor forward(const torch::Tensor& tokens, KVCache* cache,
                        const torch::Tensor& attention_mask);
  // -> hidden states [1, N, hidden] of packed sequences (under sequence parallelism, this rank's
  // slice of them, N padded for the group).
  torch::Tensor forward_packed(const PackedSequences& packed);
  // Ulysses over `group` (null or of size 1: off); its size must split the heads.
  void set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group);
  void set_activation_checkpointing(bool enabled);  // per decoder layer
  fsdp::Unit<EmbeddingImpl> embed_tokens{nullptr};
  std::vector<fsdp::Unit<LlamaDecoderLayerImpl>> layers;
  RMSNorm norm{nullptr};
  // The Ulysses group (null: off); set through set_sequence_parallel.
  std::shared_ptr<dist::ProcessGroup> sequence_parallel;

 private:
  // The layers on `tokens` at `positions`, this rank's slice of them under sequence parallelism.
  torch::Tensor run(torch::Tensor tokens, const torch::Tensor& positions, AttentionMask mask,
                    KVCache* cache, const std::optional<ulysses::SequenceSlice>& slice);
  LlamaConfig config_;
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  explicit LlamaForCausalLMImpl(const LlamaConfig& config);
  // tokens [B, T] int64 -> logits [B, T, vocab]. With a cache, positions continue after it and
  // the cache grows by T. attention_mask [B, past + T] (HF's: 1 for a token, 0 for padding; any
  // integer or bool dtype) lets rows of different lengths share a batch, left-padded: a padding
  // key is seen by no query, and a row's positions count its tokens only (HF's position_ids,
  // cumsum(mask) - 1), so each row's logits are those it has alone. Undefined: every token counts.
  // logits_to_keep > 0 (HF's argument) computes the head on the last that many positions only:
  // [B, logits_to_keep, vocab], what sampling needs of a prompt.
  //
  // next_tokens [B, logits_to_keep] (int64), the token each kept position predicts, returns their
  // log-probs under log_softmax(logits / temperature) instead (temperature 0 counts as 1):
  // [B, logits_to_keep] fp32, what PPO and GRPO need of the policy.
  //
  // Under Ulysses sequence parallelism (set_sequence_parallel) a forward without a cache runs the
  // decoder on this rank's slice of every sequence; tokens, attention_mask and next_tokens are
  // the whole sequences, the same on every rank of the group, and so is the result. Only the
  // log-probs of next_tokens are gathered across the group; without next_tokens, the logits are.
  // Sampling (with a cache) runs unsplit on every rank.
  torch::Tensor forward(torch::Tensor tokens, KVCache* cache = nullptr,
                        torch::Tensor attention_mask = {}, int64_t logits_to_keep = 0,
                        torch::Tensor next_tokens = {}, double temperature = 1.0);
  // Packed sequences (verl's use_remove_padding): the log-probs [K] fp32 of next_tokens [K] at
  // the packed positions `scored` [K], under log_softmax(logits / temperature). A position may be
  // scored more than once: a shared prompt's last token predicts the first token of every answer
  // of its group. The decoder runs on the N packed tokens only and the head on the K scored
  // entries only. Under
  // Ulysses every rank of the group passes the same packed sequences and gets the same result.
  torch::Tensor forward(const PackedSequences& packed, torch::Tensor scored,
                        torch::Tensor next_tokens, double temperature);
  const LlamaConfig& config() const { return config_; }
  // Activation checkpointing per decoder layer (see activation_checkpoint.h).
  void set_activation_checkpointing(bool enabled);
  // Ulysses sequence parallelism over `group` (DeviceMesh::sequence_parallel_group; null turns it
  // off). The group's size must split the heads (ulysses::check_heads).
  void set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group);
  // With tied embeddings, a forward-only kernel the head runs instead of linear(hidden,
  // embed_tokens.weight) on an inference replica (LinearImpl::set_inference_kernel; installed by
  // pack_for_inference); empty: the embeddings as they are.
  void set_tied_head_inference_kernel(LinearImpl::InferenceKernel kernel) {
    tied_head_kernel_ = std::move(kernel);
  }

  LlamaModel model{nullptr};
  fsdp::Unit<LinearImpl> lm_head{nullptr};  // null when tie_word_embeddings

 private:
  torch::Tensor head(const torch::Tensor& hidden);  // lm_head, or the tied embeddings
  // Log-probs [B, K] of next_tokens [B, K] at positions [K] (in any order, repeats allowed) of the
  // length-T rows whose hidden states are h: all of them, or this rank's slice under sequence
  // parallelism, where each rank scores the entries whose position it holds and the group
  // all-gathers them per entry.
  torch::Tensor log_probs_at(const torch::Tensor& h, int64_t T, const torch::Tensor& positions,
                             const torch::Tensor& next_tokens, double temperature);
  LlamaConfig config_;
  LinearImpl::InferenceKernel tied_head_kernel_;
};
using LlamaForCausalLM = fsdp::Unit<LlamaForCausalLMImpl>;

// transformers' LlamaForTokenClassification (Qwen2's, Qwen3's) with num_labels 1: the decoder and
// a scalar head `score` (Linear(hidden, 1) with bias). verl's critic (model_type value_model) is
// this model made from the actor's causal LM folder: `score` is new there, initialized as
// transformers initializes it (init_value_head), and lm_head is not read.
class LlamaForTokenClassificationImpl : public torch::nn::Module {
 public:
  explicit LlamaForTokenClassificationImpl(const LlamaConfig& config);
  // tokens [B, T] -> values [B, T] fp32, one a position; attention_mask as LlamaForCausalLM's.
  // Under Ulysses every rank of the group passes the whole rows and gets all the values.
  torch::Tensor forward(torch::Tensor tokens, torch::Tensor attention_mask = {});
  // Packed sequences -> values [N] fp32 of the N packed tokens.
  torch::Tensor forward(const PackedSequences& packed);
  const LlamaConfig& config() const { return config_; }
  void set_activation_checkpointing(bool enabled) { model->set_activation_checkpointing(enabled); }
  void set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group) {
    model->set_sequence_parallel(std::move(group));
  }

  LlamaModel model{nullptr};
  Linear score{nullptr};  // in the root unit: hidden + 1 params

 private:
  torch::Tensor values(const torch::Tensor& hidden, int64_t length);
  LlamaConfig config_;
};
using LlamaForTokenClassification = fsdp::Unit<LlamaForTokenClassificationImpl>;

// transformers' init of a new head: weight ~ N(0, initializer_range), bias 0, drawn from a
// generator seeded with `seed` so every rank draws the same values.
void init_value_head(LinearImpl& score, double initializer_range, uint64_t seed);

// config.json of the value model: the causal LM's with <Family>ForTokenClassification as its
// architecture and one label, what AutoModelForTokenClassification reads back.
nlohmann::json value_model_config_json(const LlamaConfig& config);

// Shards every decoder layer as a unit, then the embeddings and the head (when untied: tied
// embeddings serve the head inside the root's forward, so they stay with the root), then the
// root (final norm).
void shard_llama(LlamaForCausalLM& model, const dist::DeviceMesh& mesh, const WrapPolicy& policy);
// The value model's: the decoder layers and the embeddings as units, the score head in the root.
void shard_llama(LlamaForTokenClassification& model, const dist::DeviceMesh& mesh,
                 const WrapPolicy& policy);

// Checks `config` against the tensor shapes of an HF checkpoint (name -> shape): a field that
// disagrees with the weights is an error naming the field and the tensor.
void check_config_against_weights(const LlamaConfig& config,
                                  const std::map<std::string, std::vector<int64_t>>& shapes);

// Loads Hugging Face-style weights (a safetensors file or a directory, see weight_shapes) into the
// model's base weights (adapter params are left alone): the
// config is checked against the weights first, then load_weights() checks every tensor. Call
// before sharding.
void load_llama_weights(LlamaForCausalLMImpl& model, const std::string& path);

// A Hugging Face model directory (config.json and model.safetensors or the sharded index, e.g.
// transformers' save_pretrained or `shardrl export`) as an unsharded model, for inference.
LlamaForCausalLM load_llama(const std::string& dir);

// Writes `dir`/model.safetensors (the base weights of `params`, adapter tensors left out, in
// `dtype`) and `dir`/config.json: a directory transformers' from_pretrained reads.
void save_llama(const std::map<std::string, torch::Tensor>& params, const LlamaConfig& config,
                const std::string& dir, torch::ScalarType dtype = torch::kFloat);

}  // namespace shardrl::models
