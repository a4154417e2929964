#include "shardrl/models/llama.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>

#include "models/json_fields.h"
#include "shardrl/models/activation_checkpoint.h"
#include "shardrl/ulysses.h"

namespace shardrl::models {
namespace {

namespace F = torch::nn::functional;

// HF's rotate_half: the second half of the head dims, negated, then the first half.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// cos and sin [..., head_dim] of `positions` (int64, any shape), computed in fp32 as HF does.
std::pair<torch::Tensor, torch::Tensor> rotary(const LlamaConfig& c,
                                               const torch::Tensor& positions) {
  const auto device = positions.device();
  const int64_t hd = c.head_dim();
  auto inv_freq =
      1.0 /
      torch::pow(
          c.rope_theta,
          torch::arange(0, hd, 2, torch::dtype(torch::kLong).device(device)).to(torch::kFloat) /
              static_cast<double>(hd));
  auto freqs = positions.to(torch::kFloat).unsqueeze(-1) * inv_freq;
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

}  // namespace

void LlamaConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0)
      throw std::invalid_argument(fmt::format("config: {} must be positive, got {}", field, v));
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(max_position_embeddings, "max_position_embeddings");
  if (hidden_size % num_attention_heads != 0 || head_dim() % 2 != 0) {
    throw std::invalid_argument(fmt::format(
        "config: hidden_size {} must split into num_attention_heads {} heads of even size",
        hidden_size, num_attention_heads));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    throw std::invalid_argument(
        fmt::format("config: num_key_value_heads {} must divide num_attention_heads {}",
                    num_key_value_heads, num_attention_heads));
  }
  if (!(rms_norm_eps > 0)) throw std::invalid_argument("config: rms_norm_eps must be positive");
  if (!(rope_theta > 0)) throw std::invalid_argument("config: rope_theta must be positive");
}

nlohmann::json LlamaConfig::to_json() const {
  const bool qwen = model_type == "qwen2";
  nlohmann::json j = {{"architectures", {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", model_type},
                      {"vocab_size", vocab_size},
                      {"hidden_size", hidden_size},
                      {"intermediate_size", intermediate_size},
                      {"num_hidden_layers", num_hidden_layers},
                      {"num_attention_heads", num_attention_heads},
                      {"num_key_value_heads", num_key_value_heads},
                      {"max_position_embeddings", max_position_embeddings},
                      {"rms_norm_eps", rms_norm_eps},
                      {"rope_theta", rope_theta},  // for readers before transformers 5
                      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", rope_theta}}},
                      {"tie_word_embeddings", tie_word_embeddings},
                      {"hidden_act", "silu"},
                      {"torch_dtype", "float32"}};
  if (!qwen) j["attention_bias"] = attention_bias;
  return j;
}

LlamaConfig LlamaConfig::from_json(const nlohmann::json& j) {
  LlamaConfig c;
  detail::read_field(j, "model_type", c.model_type, false);
  if (c.model_type != "llama" && c.model_type != "qwen2") {
    throw std::invalid_argument(fmt::format(
        "config.json: field model_type is '{}' (expected llama or qwen2)", c.model_type));
  }
  // Qwen2 always has q/k/v biases and no attention_bias field.
  c.attention_bias = c.model_type == "qwen2";
  detail::read_field(j, "vocab_size", c.vocab_size, true);
  detail::read_field(j, "hidden_size", c.hidden_size, true);
  detail::read_field(j, "intermediate_size", c.intermediate_size, true);
  detail::read_field(j, "num_hidden_layers", c.num_hidden_layers, true);
  detail::read_field(j, "num_attention_heads", c.num_attention_heads, true);
  c.num_key_value_heads = c.num_attention_heads;  // HF's default: plain multi-head attention
  detail::read_field(j, "num_key_value_heads", c.num_key_value_heads, false);
  detail::read_field(j, "max_position_embeddings", c.max_position_embeddings, false);
  detail::read_field(j, "rms_norm_eps", c.rms_norm_eps, false);
  // transformers 5 writes rope_parameters {rope_type, rope_theta}; earlier versions rope_theta.
  detail::read_field(j, "rope_theta", c.rope_theta, false);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rope = j["rope_parameters"];
    std::string rope_type = "default";
    detail::read_field(rope, "rope_type", rope_type, false);
    if (rope_type != "default") {
      throw std::invalid_argument(fmt::format(
          "config.json: field rope_parameters.rope_type is '{}' (only default is supported)",
          rope_type));
    }
    detail::read_field(rope, "rope_theta", c.rope_theta, false);
  }
  detail::read_field(j, "tie_word_embeddings", c.tie_word_embeddings, false);
  if (c.model_type == "llama") detail::read_field(j, "attention_bias", c.attention_bias, false);
  std::string act = "silu";
  detail::read_field(j, "hidden_act", act, false);
  if (act != "silu") {
    throw std::invalid_argument(
        fmt::format("config.json: field hidden_act is '{}' (only silu is supported)", act));
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    throw std::invalid_argument("config.json: field rope_scaling is not supported");
  }
  // Fields of transformers' configs this decoder does not implement: refused, not ignored.
  detail::require_positive(c.num_attention_heads, "num_attention_heads");  // head_dim() divides
  int64_t head_dim = c.head_dim();
  detail::read_field(j, "head_dim", head_dim, false);
  if (head_dim != c.head_dim()) {
    throw std::invalid_argument(fmt::format(
        "config.json: field head_dim is {} (only hidden_size / num_attention_heads = {} is "
        "supported)",
        head_dim, c.head_dim()));
  }
  for (const char* flag : {"mlp_bias", "use_sliding_window"}) {
    bool on = false;
    detail::read_field(j, flag, on, false);
    if (on) {
      throw std::invalid_argument(
          fmt::format("config.json: field {} is true (not supported)", flag));
    }
  }
  c.validate();
  return c;
}

LlamaConfig LlamaConfig::load(const std::string& path) {
  return detail::with_path(path, [](const nlohmann::json& j) { return from_json(j); });
}

void LlamaConfig::save(const std::string& path) const {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << to_json().dump(2) << "\n";
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight",
                              fsdp::new_parameter({dim}, [](torch::Tensor& w) { w.fill_(1); }));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // In fp32 whatever the compute dtype, then back: what HF does, so bf16 runs agree with it.
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * h.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim()) {
  const int64_t d = c.hidden_size;
  auto linear = [&](const char* name, int64_t in, int64_t out, bool bias) {
    return register_module(name, lora::LoraLinear(torch::nn::LinearOptions(in, out).bias(bias)));
  };
  q_proj = linear("q_proj", d, heads_ * head_dim_, c.attention_bias);
  k_proj = linear("k_proj", d, kv_heads_ * head_dim_, c.attention_bias);
  v_proj = linear("v_proj", d, kv_heads_ * head_dim_, c.attention_bias);
  // Qwen2 biases q/k/v but not o; Llama's attention_bias covers all four.
  o_proj = linear("o_proj", heads_ * head_dim_, d, c.attention_bias && c.model_type != "qwen2");
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const torch::Tensor& blocked,
                                          KVCache* cache, size_t layer) {
  const int64_t B = x.size(0), T = x.size(1);
  auto split = [&](const torch::Tensor& t, int64_t heads) {
    return t.view({B, T, heads, head_dim_}).transpose(1, 2);
  };
  auto q = split(q_proj(x), heads_), k = split(k_proj(x), kv_heads_),
       v = split(v_proj(x), kv_heads_);
  auto c = cos.to(q.scalar_type()), s = sin.to(q.scalar_type());
  q = q * c + rotate_half(q) * s;
  k = k * c + rotate_half(k) * s;
  if (cache) std::tie(k, v) = cache->append(layer, k, v);
  // Ulysses: [B, heads, T / sp, hd] -> [B, heads / sp, T, hd]. Rank r then holds query heads
  // [r * heads / sp, ...) and needs the key/value heads they read; with fewer key/value heads
  // than ranks, each is repeated until every rank has one (verl's repeat_kv).
  const bool sequence_parallel = sequence_parallel_ && !cache;
  if (sequence_parallel) {
    const int64_t sp = sequence_parallel_->size();
    if (kv_heads_ % sp != 0) {
      k = k.repeat_interleave(sp / kv_heads_, 1);
      v = v.repeat_interleave(sp / kv_heads_, 1);
    }
    q = ulysses::gather_seq_scatter_heads(q, /*seq_dim=*/2, /*head_dim=*/1, *sequence_parallel_);
    k = ulysses::gather_seq_scatter_heads(k, 2, 1, *sequence_parallel_);
    v = ulysses::gather_seq_scatter_heads(v, 2, 1, *sequence_parallel_);
  }
  // Grouped-query attention: each key/value head serves rep = heads / kv_heads consecutive query
  // heads. Those heads' queries are stacked as rows of one matrix per key/value head, so the
  // keys and values are read in place rather than repeated: under sampling they are the whole
  // cache, which a repeat would copy rep times at every token.
  const int64_t Bq = q.size(0), Hq = q.size(1), Tq = q.size(2), kvh = k.size(1);
  const int64_t rep = Hq / kvh;
  auto scores = torch::matmul(q.reshape({Bq, kvh, rep * Tq, head_dim_}), k.transpose(-2, -1))
                    .view({Bq, Hq, Tq, k.size(2)}) /
                std::sqrt(static_cast<double>(head_dim_));
  scores = scores.masked_fill(blocked, -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores.to(torch::kFloat), -1).to(q.scalar_type());
  auto out =
      torch::matmul(probs.view({Bq, kvh, rep * Tq, k.size(2)}), v).view({Bq, Hq, Tq, head_dim_});
  if (sequence_parallel) {
    out =
        ulysses::gather_heads_scatter_seq(out, /*head_dim=*/1, /*seq_dim=*/2, *sequence_parallel_);
  }
  return o_proj(out.transpose(1, 2).reshape({B, T, heads_ * head_dim_}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c) {
  auto linear = [&](const char* name, int64_t in, int64_t out) {
    return register_module(name, lora::LoraLinear(torch::nn::LinearOptions(in, out).bias(false)));
  };
  gate_proj = linear("gate_proj", c.hidden_size, c.intermediate_size);
  up_proj = linear("up_proj", c.hidden_size, c.intermediate_size);
  down_proj = linear("down_proj", c.intermediate_size, c.hidden_size);
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, size_t index) : index_(index) {
  self_attn = register_module("self_attn", LlamaAttention(c));
  mlp = register_module("mlp", LlamaMLP(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor LlamaDecoderLayerImpl::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                             torch::Tensor blocked, KVCache* cache) {
  if (!checkpoint_activations || cache) return compute(x, cos, sin, blocked, cache);
  // The mask needs no grad: captured, not an input of the recompute.
  return checkpointed(
      [this, blocked](const std::vector<torch::Tensor>& in) {
        return compute(in[0], in[1], in[2], blocked, nullptr);
      },
      {x, cos, sin});
}

torch::Tensor LlamaDecoderLayerImpl::compute(const torch::Tensor& x_in, const torch::Tensor& cos,
                                             const torch::Tensor& sin, const torch::Tensor& blocked,
                                             KVCache* cache) {
  torch::Tensor x = x_in;
  x = x + self_attn(input_layernorm(x), cos, sin, blocked, cache, index_);
  return x + mlp(post_attention_layernorm(x));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c) : config_(c) {
  embed_tokens =
      register_module("embed_tokens", fsdp::Unit<EmbeddingImpl>(c.vocab_size, c.hidden_size));
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers.emplace_back(c, static_cast<size_t>(i));
    list->push_back(layers.back().ptr());
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& tokens_in, KVCache* cache,
                                      const torch::Tensor& attention_mask_in) {
  const int64_t B = tokens_in.size(0), past = cache ? cache->length() : 0;
  TORCH_CHECK(past + tokens_in.size(1) <= config_.max_position_embeddings, "sequence length ",
              past + tokens_in.size(1), " exceeds max_position_embeddings ",
              config_.max_position_embeddings);
  // Ulysses: positions and the mask are those of the whole sequence, padded for the group (a
  // padding key is hidden from every real query: it is in their future, and masked too when a
  // mask is given); the embeddings and layers then see this rank's slice only.
  std::optional<ulysses::SequenceSlice> slice;
  torch::Tensor tokens = tokens_in, attention_mask = attention_mask_in;
  if (sequence_parallel && !cache) {
    slice = ulysses::sequence_slice(tokens.size(1), *sequence_parallel);
    const int64_t pad = slice->padded_length - slice->length;
    tokens = at::constant_pad_nd(tokens, {0, pad}, 0);
    if (attention_mask.defined()) attention_mask = at::constant_pad_nd(attention_mask, {0, pad}, 0);
  }
  const int64_t T = tokens.size(1);
  const auto device = tokens.device();
  torch::Tensor positions =
      torch::arange(past, past + T, torch::dtype(torch::kLong).device(device));
  // The keys each query may not see: [T, past + T] (the future), or per row [B, 1, T, past + T].
  const auto future =
      torch::ones({T, past + T}, torch::dtype(torch::kBool).device(device)).triu(past + 1);
  torch::Tensor blocked = future;
  if (attention_mask.defined()) {
    TORCH_CHECK(attention_mask.dim() == 2 && attention_mask.size(0) == B &&
                    attention_mask.size(1) == past + T,
                "attention_mask: expected [", B, ", ", past + T, "] (past + new tokens), got ",
                attention_mask.sizes());
    const auto valid = attention_mask.to(device).to(torch::kBool);
    // HF's position_ids for left padding: each row counts its own tokens from 0.
    positions = (valid.to(torch::kLong).cumsum(1) - 1).clamp_min(0).narrow(1, past, T);
    // A query sees the earlier tokens of its row, and always itself: a padding query then has
    // a key to attend to (its output is never used), where an all-hidden row would give NaN
    // and spread it through the values.
    const auto itself =
        torch::eye(T, past + T, torch::dtype(torch::kBool).device(device)).roll(past, 1);
    blocked = (future.unsqueeze(0) | ~valid.unsqueeze(1)) & ~itself.unsqueeze(0);
    blocked = blocked.unsqueeze(1);  // [B, 1, T, past + T]: one mask for every head
  }
  auto [cos, sin] = rotary(config_, positions);
  if (cos.dim() == 3) cos = cos.unsqueeze(1), sin = sin.unsqueeze(1);  // [B, 1, T, head_dim]
  if (slice) {
    tokens = tokens.narrow(1, slice->begin, slice->local_length);
    cos = cos.narrow(-2, slice->begin, slice->local_length);
    sin = sin.narrow(-2, slice->begin, slice->local_length);
  }
  auto x = embed_tokens(tokens);
  for (auto& layer : layers) x = layer(x, cos, sin, blocked, cache);
  return norm(x);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c) : config_(c) {
  c.validate();
  model = register_module("model", LlamaModel(c));
  if (!c.tie_word_embeddings) {
    lm_head = register_module(
        "lm_head",
        fsdp::Unit<LinearImpl>(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
  }
}

torch::Tensor LlamaForCausalLMImpl::head(const torch::Tensor& hidden) {
  if (lm_head) return lm_head(hidden);
  if (!tied_head_kernel_) return F::linear(hidden, model->embed_tokens->weight);
  TORCH_CHECK(!torch::GradMode::is_enabled(),
              "LlamaForCausalLM: packed for inference (pack_for_inference), so it runs without "
              "grad only");
  return tied_head_kernel_(hidden);
}

namespace {
// log_softmax(logits / temperature) at `targets` [B, K] for logits [B, K, vocab], in fp32.
torch::Tensor target_log_probs(const torch::Tensor& logits_in, const torch::Tensor& targets,
                               double temperature) {
  auto logits = logits_in.to(torch::kFloat);
  if (temperature > 0) logits = logits / temperature;
  return torch::log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
}
}  // namespace

torch::Tensor LlamaForCausalLMImpl::forward(torch::Tensor tokens, KVCache* cache,
                                            torch::Tensor attention_mask, int64_t logits_to_keep,
                                            torch::Tensor next_tokens, double temperature) {
  const int64_t T = tokens.size(1);
  const int64_t keep = logits_to_keep > 0 && logits_to_keep < T ? logits_to_keep : T;
  TORCH_CHECK(
      !next_tokens.defined() || (next_tokens.dim() == 2 && next_tokens.size(0) == tokens.size(0) &&
                                 next_tokens.size(1) == keep),
      "LlamaForCausalLM: next_tokens must be [", tokens.size(0), ", ", keep,
      "] (one per kept position), got ", next_tokens.sizes());
  auto h = model(tokens, cache, attention_mask);
  if (!model->sequence_parallel || cache) {
    if (keep < T) h = h.narrow(1, T - keep, keep);
    auto logits = head(h);
    return next_tokens.defined() ? target_log_probs(logits, next_tokens, temperature) : logits;
  }
  // h is this rank's slice of the padded sequence.
  auto& group = *model->sequence_parallel;
  const auto slice = ulysses::sequence_slice(T, group);
  if (!next_tokens.defined()) {
    auto logits = ulysses::gather_outputs_and_unpad(head(h), 1, T, group);
    return keep < T ? logits.narrow(1, T - keep, keep) : logits;
  }
  // The head runs on this rank's kept positions [lo, hi) only, so no rank holds more than its
  // share of the logits. A rank with none runs it on one position at weight 0: every rank must
  // run every FSDP unit and every all-to-all of the backward, whatever its slice holds.
  const int64_t lo = std::clamp(T - keep - slice.begin, int64_t{0}, slice.local_length);
  const int64_t hi = std::clamp(T - slice.begin, int64_t{0}, slice.local_length);
  torch::Tensor local;
  if (hi > lo) {
    const auto targets = next_tokens.narrow(1, slice.begin + lo - (T - keep), hi - lo);
    local =
        at::constant_pad_nd(target_log_probs(head(h.narrow(1, lo, hi - lo)), targets, temperature),
                            {lo, slice.local_length - hi}, 0);
  } else {
    const auto unused =
        target_log_probs(head(h.narrow(1, 0, 1)), next_tokens.narrow(1, 0, 1) * 0, temperature);
    local = torch::zeros({h.size(0), slice.local_length}, unused.options()) + 0.0 * unused.sum();
  }
  return ulysses::gather_outputs_and_unpad(local, 1, T, group).narrow(1, T - keep, keep);
}

void LlamaForCausalLMImpl::set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group) {
  if (group) {
    ulysses::check_heads(config_.num_attention_heads, config_.num_key_value_heads, group->size());
  }
  model->sequence_parallel = group && group->size() > 1 ? group : nullptr;
  for (auto& layer : model->layers) {
    layer->self_attn->set_sequence_parallel(model->sequence_parallel.get());
  }
}

void LlamaForCausalLMImpl::set_activation_checkpointing(bool enabled) {
  for (auto& layer : model->layers) layer->checkpoint_activations = enabled;
}

void shard_llama(LlamaForCausalLM& model, const dist::DeviceMesh& mesh, const WrapPolicy& policy) {
  auto& decoder = *model->model;
  if (model->config().tie_word_embeddings) {
    shard_by_block(model, decoder.layers, mesh, policy);
  } else {
    shard_by_block(model, decoder.layers, mesh, policy, decoder.embed_tokens, model->lm_head);
  }
}

void check_config_against_weights(const LlamaConfig& c,
                                  const std::map<std::string, std::vector<int64_t>>& shapes) {
  auto disagree = [](const char* field, int64_t value, const std::string& tensor,
                     const std::vector<int64_t>& shape) {
    throw std::invalid_argument(
        fmt::format("config field {} = {} disagrees with tensor {} of shape {}", field, value,
                    tensor, fmt::format("[{}]", fmt::join(shape, ", "))));
  };
  auto check_dim = [&](const std::string& tensor, size_t dim, int64_t expected, const char* field,
                       int64_t value) {
    auto it = shapes.find(tensor);
    if (it == shapes.end() || it->second.size() <= dim) return;  // reported as a missing tensor
    if (it->second[dim] != expected) disagree(field, value, tensor, it->second);
  };
  const std::string embed = "model.embed_tokens.weight";
  check_dim(embed, 0, c.vocab_size, "vocab_size", c.vocab_size);
  check_dim(embed, 1, c.hidden_size, "hidden_size", c.hidden_size);
  const std::string l0 = "model.layers.0.";
  check_dim(l0 + "self_attn.k_proj.weight", 0, c.num_key_value_heads * c.head_dim(),
            "num_key_value_heads", c.num_key_value_heads);
  check_dim(l0 + "self_attn.q_proj.weight", 0, c.num_attention_heads * c.head_dim(),
            "num_attention_heads", c.num_attention_heads);
  check_dim(l0 + "mlp.gate_proj.weight", 0, c.intermediate_size, "intermediate_size",
            c.intermediate_size);
  const bool has_q_bias = shapes.count(l0 + "self_attn.q_proj.bias") > 0;
  if (shapes.count(l0 + "self_attn.q_proj.weight") && has_q_bias != c.attention_bias) {
    throw std::invalid_argument(fmt::format(
        "config field attention_bias = {} disagrees with the weights: tensor {} is {}",
        c.attention_bias, l0 + "self_attn.q_proj.bias", has_q_bias ? "present" : "absent"));
  }
  static const std::regex layer_re(R"(model\.layers\.(\d+)\..*)");
  int64_t layers = 0;
  std::string deepest;
  for (const auto& [name, shape] : shapes) {
    std::smatch m;
    if (!std::regex_match(name, m, layer_re)) continue;
    const int64_t n = std::stoll(m[1].str()) + 1;
    if (n > layers) layers = n, deepest = name;
  }
  if (layers != c.num_hidden_layers && layers > 0) {
    throw std::invalid_argument(
        fmt::format("config field num_hidden_layers = {} disagrees with the weights: they hold {} "
                    "layers (deepest tensor {})",
                    c.num_hidden_layers, layers, deepest));
  }
  if (c.tie_word_embeddings && shapes.count("lm_head.weight")) {
    throw std::invalid_argument(
        "config field tie_word_embeddings = true disagrees with the weights: they hold tensor "
        "lm_head.weight");
  }
}

void load_llama_weights(LlamaForCausalLMImpl& model, const std::string& path) {
  check_config_against_weights(model.config(), weight_shapes(path));
  load_weights(model, path);
}

LlamaForCausalLM load_llama(const std::string& dir) {
  LlamaForCausalLM model(LlamaConfig::load((std::filesystem::path(dir) / "config.json").string()));
  load_llama_weights(*model, dir);
  return model;
}

void save_llama(const std::map<std::string, torch::Tensor>& params, const LlamaConfig& config,
                const std::string& dir, torch::ScalarType dtype) {
  std::filesystem::create_directories(dir);
  save_weights(params, dir + "/model.safetensors", dtype);
  config.save(dir + "/config.json");
}

}  // namespace shardrl::models
