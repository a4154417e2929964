#include "shardrl/models/llama.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <numeric>
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

// The rotary inverse frequencies [head_dim / 2], in fp32 as transformers computes them.
torch::Tensor inverse_frequencies(const LlamaConfig& c, torch::Device device) {
  const auto& rope = c.rope_parameters;
  const int64_t hd = c.attention_head_dim();
  auto inv_freq =
      1.0 /
      torch::pow(
          rope.rope_theta,
          torch::arange(0, hd, 2, torch::dtype(torch::kLong).device(device)).to(torch::kFloat) /
              static_cast<double>(hd));
  if (rope.rope_type != "llama3") return inv_freq;
  // transformers' _compute_llama3_parameters: wavelengths longer than the pretraining context /
  // low_freq_factor are stretched by `factor`, those shorter than it / high_freq_factor kept,
  // the ones between blended.
  const double old_context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / rope.low_freq_factor;
  const double high_freq_wavelen = old_context / rope.high_freq_factor;
  const auto wavelen = 2 * std::numbers::pi / inv_freq;
  auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
  const auto smooth = (old_context / wavelen - rope.low_freq_factor) /
                      (rope.high_freq_factor - rope.low_freq_factor);
  const auto smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  const auto medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

// cos and sin [..., head_dim] of `positions` (int64, any shape), computed in fp32 as HF does.
std::pair<torch::Tensor, torch::Tensor> rotary(const LlamaConfig& c,
                                               const torch::Tensor& positions) {
  auto freqs =
      positions.to(torch::kFloat).unsqueeze(-1) * inverse_frequencies(c, positions.device());
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
  if (head_dim < 0 || (head_dim == 0 && hidden_size % num_attention_heads != 0) ||
      attention_head_dim() <= 0 || attention_head_dim() % 2 != 0) {
    throw std::invalid_argument(fmt::format(
        "config: head_dim {} must be a positive even size (without head_dim, hidden_size {} "
        "must split into num_attention_heads {} heads of even size)",
        attention_head_dim(), hidden_size, num_attention_heads));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    throw std::invalid_argument(
        fmt::format("config: num_key_value_heads {} must divide num_attention_heads {}",
                    num_key_value_heads, num_attention_heads));
  }
  if (model_type != "llama" && model_type != "qwen2" && model_type != "qwen3") {
    throw std::invalid_argument(
        fmt::format("config: model_type is '{}' (expected llama, qwen2 or qwen3)", model_type));
  }
  if (!(rms_norm_eps > 0)) throw std::invalid_argument("config: rms_norm_eps must be positive");
  const auto& rope = rope_parameters;
  if (!(rope.rope_theta > 0)) {
    throw std::invalid_argument("config: rope_parameters.rope_theta must be positive");
  }
  if (rope.rope_type == "llama3") {
    if (!(rope.factor > 0)) {
      throw std::invalid_argument(
          fmt::format("config: rope_parameters.factor must be positive, got {}", rope.factor));
    }
    if (!(rope.low_freq_factor > 0 && rope.high_freq_factor > rope.low_freq_factor)) {
      throw std::invalid_argument(fmt::format(
          "config: rope_parameters.high_freq_factor ({}) must exceed low_freq_factor ({}) > 0",
          rope.high_freq_factor, rope.low_freq_factor));
    }
    positive(rope.original_max_position_embeddings,
             "rope_parameters.original_max_position_embeddings");
  } else if (rope.rope_type != "default") {
    throw std::invalid_argument(fmt::format(
        "config: rope_parameters.rope_type is '{}' (default and llama3 are implemented)",
        rope.rope_type));
  }
}

nlohmann::json LlamaConfig::to_json() const {
  const char* architecture = model_type == "qwen2"   ? "Qwen2ForCausalLM"
                             : model_type == "qwen3" ? "Qwen3ForCausalLM"
                                                     : "LlamaForCausalLM";
  const auto& rope = rope_parameters;
  nlohmann::json rope_json = {{"rope_type", rope.rope_type}, {"rope_theta", rope.rope_theta}};
  nlohmann::json scaling = nullptr;
  if (rope.rope_type == "llama3") {
    scaling = {{"rope_type", rope.rope_type},
               {"factor", rope.factor},
               {"low_freq_factor", rope.low_freq_factor},
               {"high_freq_factor", rope.high_freq_factor},
               {"original_max_position_embeddings", rope.original_max_position_embeddings}};
    rope_json.update(scaling);
  }
  nlohmann::json j = {{"architectures", {architecture}},
                      {"model_type", model_type},
                      {"vocab_size", vocab_size},
                      {"hidden_size", hidden_size},
                      {"intermediate_size", intermediate_size},
                      {"num_hidden_layers", num_hidden_layers},
                      {"num_attention_heads", num_attention_heads},
                      {"num_key_value_heads", num_key_value_heads},
                      {"max_position_embeddings", max_position_embeddings},
                      {"rms_norm_eps", rms_norm_eps},
                      {"rope_theta", rope.rope_theta},  // for readers before transformers 5
                      {"rope_parameters", rope_json},
                      {"tie_word_embeddings", tie_word_embeddings},
                      {"hidden_act", "silu"},
                      {"torch_dtype", "float32"}};
  // Readers before transformers 5 know the scaling by this name only (it is what Llama 3.2's
  // published config.json holds); transformers 5 reads it as rope_parameters.
  if (!scaling.is_null()) j["rope_scaling"] = scaling;
  if (model_type != "qwen2") j["attention_bias"] = attention_bias;
  // Qwen2's config has no head_dim field (its attention reads one when given).
  if (model_type != "qwen2" || (head_dim > 0 && head_dim * num_attention_heads != hidden_size)) {
    j["head_dim"] = attention_head_dim();
  }
  return j;
}

namespace {

// `obj`.`key` into `value` when present, errors naming `parent`.`key`.
template <class T>
void read_nested(const nlohmann::json& obj, const std::string& parent, const char* key, T& value) {
  if (!obj.contains(key) || obj[key].is_null()) return;
  try {
    value = obj[key].get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument(fmt::format("config.json: field {}.{} has the wrong type ({})",
                                            parent, key, obj[key].dump()));
  }
}

// rope_parameters (transformers 5) or rope_scaling (before it; it wins when both are there, as in
// transformers), over the top-level rope_theta.
RopeParameters read_rope(const nlohmann::json& j, const LlamaConfig& c) {
  RopeParameters rope;
  detail::read_field(j, "rope_theta", rope.rope_theta, false);
  const bool scaling = j.contains("rope_scaling") && !j["rope_scaling"].is_null();
  const char* name = scaling ? "rope_scaling" : "rope_parameters";
  if (!j.contains(name) || j[name].is_null()) return rope;
  const auto& r = j[name];
  if (!r.is_object()) {
    throw std::invalid_argument(
        fmt::format("config.json: field {} has the wrong type ({})", name, r.dump()));
  }
  // Older files name the type "type".
  read_nested(r, name, "type", rope.rope_type);
  read_nested(r, name, "rope_type", rope.rope_type);
  std::set<std::string> known = {"type", "rope_type", "rope_theta"};
  if (rope.rope_type == "llama3") {
    known.insert(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
    rope.original_max_position_embeddings = c.max_position_embeddings;  // transformers' default
    // Phi-3 style: a top-level field wins over the one inside (transformers' exception).
    detail::read_field(j, "original_max_position_embeddings", rope.original_max_position_embeddings,
                       false);
    if (!j.contains("original_max_position_embeddings")) {
      read_nested(r, name, "original_max_position_embeddings",
                  rope.original_max_position_embeddings);
    }
    for (const char* key : {"factor", "low_freq_factor", "high_freq_factor"}) {
      if (!r.contains(key) || r[key].is_null()) {
        throw std::invalid_argument(fmt::format(
            "config.json: field {}.{} is missing (rope_type llama3 needs it)", name, key));
      }
    }
    read_nested(r, name, "factor", rope.factor);
    read_nested(r, name, "low_freq_factor", rope.low_freq_factor);
    read_nested(r, name, "high_freq_factor", rope.high_freq_factor);
  } else if (rope.rope_type != "default") {
    throw std::invalid_argument(
        fmt::format("config.json: field {}.rope_type is '{}' (default and llama3 are implemented)",
                    name, rope.rope_type));
  }
  read_nested(r, name, "rope_theta", rope.rope_theta);
  for (const auto& [key, value] : r.items()) {
    if (!known.count(key)) {
      // A per-layer-type dict ({"full_attention": {...}, ...}) or another type's parameter
      // (partial_rotary_factor, attention_factor, mrope_section, ...).
      throw std::invalid_argument(
          fmt::format("config.json: field {}.{} is not implemented for rope_type {}", name, key,
                      rope.rope_type));
    }
  }
  return rope;
}

// Fields of transformers' configs that change the math and that this decoder does not implement:
// an error naming the field when they are in use.
void refuse_unimplemented(const nlohmann::json& j, const LlamaConfig& c) {
  auto refuse = [](const std::string& field, const nlohmann::json& value, const char* why) {
    throw std::invalid_argument(
        fmt::format("config.json: field {} is {} ({})", field, value.dump(), why));
  };
  auto present = [&](const char* field) { return j.contains(field) && !j[field].is_null(); };
  if (present("mlp_bias") && j["mlp_bias"] != false) {
    refuse("mlp_bias", j["mlp_bias"], "MLP biases are not implemented");
  }
  if (present("partial_rotary_factor") && j["partial_rotary_factor"] != 1 &&
      j["partial_rotary_factor"] != 1.0) {
    refuse("partial_rotary_factor", j["partial_rotary_factor"],
           "RoPE over part of the head is not implemented");
  }
  if (present("attention_dropout") && j["attention_dropout"] != 0 &&
      j["attention_dropout"] != 0.0) {
    refuse("attention_dropout", j["attention_dropout"], "dropout is not implemented");
  }
  if (present("quantization_config")) {
    refuse("quantization_config", j["quantization_config"],
           "quantized weights are not implemented: give the dequantized model");
  }
  // Mixture of experts (Qwen3-MoE, Mixtral, DeepSeek fields).
  for (const char* field : {"num_experts", "num_local_experts", "n_routed_experts",
                            "num_experts_per_tok", "moe_intermediate_size"}) {
    if (present(field) && j[field] != 0) {
      refuse(field, j[field], "mixture-of-experts layers are not implemented");
    }
  }
  // Sliding-window attention: Qwen2 / Qwen3 slide on the layers layer_types names, by default
  // those from max_window_layers on when use_sliding_window is on (sliding_window defaults to
  // 4096 there); the Llama model has none.
  if (c.model_type == "llama") return;
  if (present("layer_types")) {
    const auto& types = j["layer_types"];
    if (!types.is_array()) refuse("layer_types", types, "expected a list of layer types");
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] != "full_attention") {
        throw std::invalid_argument(fmt::format(
            "config.json: field layer_types[{}] is {} (only full_attention is implemented)", i,
            types[i].dump()));
      }
    }
    return;
  }
  bool sliding = false;
  detail::read_field(j, "use_sliding_window", sliding, false);
  int64_t max_window_layers = 28;  // transformers' default
  detail::read_field(j, "max_window_layers", max_window_layers, false);
  const bool window_given_as_null = j.contains("sliding_window") && j["sliding_window"].is_null();
  if (sliding && !window_given_as_null && max_window_layers < c.num_hidden_layers) {
    throw std::invalid_argument(fmt::format(
        "config.json: field use_sliding_window is true (a sliding window of {} on layers {} and "
        "up, from max_window_layers): sliding-window attention is not implemented",
        present("sliding_window") ? j["sliding_window"].dump() : "4096", max_window_layers));
  }
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const nlohmann::json& j) {
  LlamaConfig c;
  detail::read_field(j, "model_type", c.model_type, false);
  if (c.model_type != "llama" && c.model_type != "qwen2" && c.model_type != "qwen3") {
    throw std::invalid_argument(fmt::format(
        "config.json: field model_type is '{}' (expected llama, qwen2 or qwen3)", c.model_type));
  }
  const bool llama = c.model_type == "llama";
  // Qwen2 always has q/k/v biases and no attention_bias field.
  c.attention_bias = c.model_type == "qwen2";
  detail::read_field(j, "vocab_size", c.vocab_size, true);
  detail::read_field(j, "hidden_size", c.hidden_size, true);
  detail::read_field(j, "intermediate_size", c.intermediate_size, true);
  detail::read_field(j, "num_hidden_layers", c.num_hidden_layers, true);
  detail::read_field(j, "num_attention_heads", c.num_attention_heads, true);
  // Divides hidden_size (attention_head_dim()) in what follows: checked before any use.
  detail::require_positive(c.num_attention_heads, "num_attention_heads");
  // transformers' defaults for absent fields: Llama's key/value heads are the attention heads and
  // its head_dim hidden / heads; Qwen2's and Qwen3's configs default to 32 key/value heads and a
  // longer context, and Qwen3's to heads of 128.
  c.num_key_value_heads = llama ? c.num_attention_heads : 32;
  detail::read_field(j, "num_key_value_heads", c.num_key_value_heads, false);
  c.max_position_embeddings = llama ? 2048 : 32768;
  detail::read_field(j, "max_position_embeddings", c.max_position_embeddings, false);
  c.head_dim = c.model_type == "qwen3" ? 128 : 0;
  detail::read_field(j, "head_dim", c.head_dim, false);
  if (c.head_dim <= 0 && (j.contains("head_dim") && !j["head_dim"].is_null())) {
    throw std::invalid_argument(
        fmt::format("config.json: field head_dim must be positive, got {}", c.head_dim));
  }
  detail::read_field(j, "rms_norm_eps", c.rms_norm_eps, false);
  c.rope_parameters = read_rope(j, c);
  detail::read_field(j, "tie_word_embeddings", c.tie_word_embeddings, false);
  if (c.model_type != "qwen2") detail::read_field(j, "attention_bias", c.attention_bias, false);
  std::string act = "silu";
  detail::read_field(j, "hidden_act", act, false);
  if (act != "silu") {
    throw std::invalid_argument(
        fmt::format("config.json: field hidden_act is '{}' (only silu is supported)", act));
  }
  refuse_unimplemented(j, c);
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
    : heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.attention_head_dim()) {
  const int64_t d = c.hidden_size;
  auto linear = [&](const char* name, int64_t in, int64_t out, bool bias) {
    return register_module(name, lora::LoraLinear(torch::nn::LinearOptions(in, out).bias(bias)));
  };
  q_proj = linear("q_proj", d, heads_ * head_dim_, c.attention_bias);
  k_proj = linear("k_proj", d, kv_heads_ * head_dim_, c.attention_bias);
  v_proj = linear("v_proj", d, kv_heads_ * head_dim_, c.attention_bias);
  // Qwen2 biases q/k/v but not o; Llama's and Qwen3's attention_bias covers all four.
  o_proj = linear("o_proj", heads_ * head_dim_, d, c.attention_bias && c.model_type != "qwen2");
  if (c.qk_norm()) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps));
  }
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const AttentionMask& mask,
                                          KVCache* cache, size_t layer) {
  const int64_t B = x.size(0), T = x.size(1);
  // [B, T, heads, head_dim], normalized per head first where the model does (Qwen3), then
  // [B, heads, T, head_dim].
  auto split = [&](const torch::Tensor& t, int64_t heads, RMSNorm& norm) {
    auto h = t.view({B, T, heads, head_dim_});
    return (norm ? norm(h) : h).transpose(1, 2);
  };
  RMSNorm none{nullptr};
  auto q = split(q_proj(x), heads_, q_norm), k = split(k_proj(x), kv_heads_, k_norm),
       v = split(v_proj(x), kv_heads_, none);
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
  // Grouped-query attention inside the kernel (enable_gqa): each key/value head serves
  // heads / kv_heads consecutive query heads and is read in place, not repeated (under sampling
  // it is the whole cache). The CPU's flash kernel keeps no [T, T] scores for backward, only a
  // log-sum-exp per query; scale 1 / sqrt(head_dim) is its default.
  std::optional<torch::Tensor> allowed;
  if (mask.allowed.defined()) {
    allowed = mask.allowed.is_floating_point() ? mask.allowed.to(q.scalar_type()) : mask.allowed;
  }
  torch::Tensor out;
  if (mask.sequence_lengths.empty()) {
    out = at::scaled_dot_product_attention(q, k, v, allowed, /*dropout_p=*/0.0,
                                           /*is_causal=*/!allowed && mask.causal,
                                           /*scale=*/std::nullopt, /*enable_gqa=*/true);
  } else {
    // Packed sequences: one causal call per sequence, so the work is the sum of their squared
    // lengths. A block-diagonal mask over all N tokens would compute N^2 scores and hold the
    // mask; BENCHMARKS compares the two.
    TORCH_CHECK(!cache && !allowed, "packed sequences take no cache and no mask");
    const c10::IntArrayRef lengths(mask.sequence_lengths);
    auto qs = q.split_with_sizes(lengths, 2), ks = k.split_with_sizes(lengths, 2),
         vs = v.split_with_sizes(lengths, 2);
    std::vector<torch::Tensor> outs;
    outs.reserve(lengths.size());
    size_t leader = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const int64_t prefix = mask.shared_prefix.empty() ? 0 : mask.shared_prefix[i];
      if (prefix == 0) {
        leader = i;
        outs.push_back(at::scaled_dot_product_attention(qs[i], ks[i], vs[i], std::nullopt, 0.0,
                                                        /*is_causal=*/true, std::nullopt, true));
        continue;
      }
      // An answer after its group's shared prompt: its keys are the prompt's (the leader's
      // first `prefix`) then its own. Causal within the answer needs an explicit mask, since
      // is_causal aligns the diagonal top-left when queries and keys differ in number.
      const int64_t L = lengths[i];
      const auto keys = torch::cat({ks[leader].narrow(2, 0, prefix), ks[i]}, 2);
      const auto values = torch::cat({vs[leader].narrow(2, 0, prefix), vs[i]}, 2);
      const auto future =
          torch::ones({L, prefix + L}, torch::dtype(torch::kBool).device(q.device()))
              .triu(prefix + 1);
      const auto scores_mask = torch::zeros({L, prefix + L}, q.options())
                                   .masked_fill(future, -std::numeric_limits<float>::infinity());
      outs.push_back(at::scaled_dot_product_attention(qs[i], keys, values, scores_mask, 0.0,
                                                      /*is_causal=*/false, std::nullopt, true));
    }
    out = torch::cat(outs, 2);
  }
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
                                             const AttentionMask& mask, KVCache* cache) {
  if (!checkpoint_activations || cache) return compute(x, cos, sin, mask, cache);
  // The mask needs no grad: captured, not an input of the recompute.
  return checkpointed(
      [this, mask](const std::vector<torch::Tensor>& in) {
        return compute(in[0], in[1], in[2], mask, nullptr);
      },
      {x, cos, sin});
}

torch::Tensor LlamaDecoderLayerImpl::compute(const torch::Tensor& x_in, const torch::Tensor& cos,
                                             const torch::Tensor& sin, const AttentionMask& mask,
                                             KVCache* cache) {
  torch::Tensor x = x_in;
  x = x + self_attn(input_layernorm(x), cos, sin, mask, cache, index_);
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
  // The keys each query sees: the causal kernel alone when queries and keys are the same
  // positions, every key for one new token after a cache; a mask [T, past + T] for several new
  // tokens after a cache, or per row [B, 1, T, past + T] with padding.
  AttentionMask mask;
  mask.causal = past == 0 || T > 1;
  const auto future = [&] {
    return torch::ones({T, past + T}, torch::dtype(torch::kBool).device(device)).triu(past + 1);
  };
  if (past > 0 && T > 1) mask.allowed = ~future();
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
    mask.allowed = ((~future().unsqueeze(0) & valid.unsqueeze(1)) | itself.unsqueeze(0))
                       .unsqueeze(1);  // [B, 1, T, past + T]: one mask for every head
  }
  return run(tokens, positions, std::move(mask), cache, slice);
}

torch::Tensor LlamaModelImpl::forward_packed(const PackedSequences& packed) {
  const int64_t N = packed.tokens.numel();
  TORCH_CHECK(packed.tokens.dim() == 2 && packed.tokens.size(0) == 1 &&
                  packed.position_ids.sizes() == packed.tokens.sizes(),
              "packed sequences: tokens and position_ids must be [1, N], got ",
              packed.tokens.sizes(), " and ", packed.position_ids.sizes());
  TORCH_CHECK(std::accumulate(packed.lengths.begin(), packed.lengths.end(), int64_t{0}) == N,
              "packed sequences: the lengths do not sum to the ", N, " tokens");
  TORCH_CHECK(packed.shared_prefix.empty() || packed.shared_prefix.size() == packed.lengths.size(),
              "packed sequences: ", packed.shared_prefix.size(), " shared prefixes for ",
              packed.lengths.size(), " sequences");
  for (size_t i = 0, leader = 0; i < packed.shared_prefix.size(); ++i) {
    if (packed.shared_prefix[i] == 0) {
      leader = i;
      continue;
    }
    TORCH_CHECK(packed.shared_prefix[i] > 0 && i > 0 && packed.shared_prefix[leader] == 0 &&
                    packed.shared_prefix[i] <= packed.lengths[leader],
                "packed sequences: sequence ", i, " shares ", packed.shared_prefix[i],
                " tokens, more than the sequence it shares them with has (or there is none)");
  }
  AttentionMask mask;
  mask.sequence_lengths = packed.lengths;
  mask.shared_prefix = packed.shared_prefix;
  torch::Tensor tokens = packed.tokens, positions = packed.position_ids;
  std::optional<ulysses::SequenceSlice> slice;
  if (sequence_parallel) {
    // The group's padding is one more sequence at the end, which no real token sees.
    slice = ulysses::sequence_slice(N, *sequence_parallel);
    const int64_t pad = slice->padded_length - N;
    tokens = at::constant_pad_nd(tokens, {0, pad}, 0);
    positions = at::constant_pad_nd(positions, {0, pad}, 0);
    if (pad > 0) mask.sequence_lengths.push_back(pad);
    if (pad > 0 && !mask.shared_prefix.empty()) mask.shared_prefix.push_back(0);
  }
  return run(tokens, positions, std::move(mask), nullptr, slice);
}

torch::Tensor LlamaModelImpl::run(torch::Tensor tokens, const torch::Tensor& positions,
                                  AttentionMask mask, KVCache* cache,
                                  const std::optional<ulysses::SequenceSlice>& slice) {
  auto [cos, sin] = rotary(config_, positions);
  if (cos.dim() == 3) cos = cos.unsqueeze(1), sin = sin.unsqueeze(1);  // [B, 1, T, head_dim]
  if (slice) {
    tokens = tokens.narrow(1, slice->begin, slice->local_length);
    cos = cos.narrow(-2, slice->begin, slice->local_length);
    sin = sin.narrow(-2, slice->begin, slice->local_length);
  }
  auto x = embed_tokens(tokens);
  // The mask as SDPA adds it to the scores, built once for every layer: SDPA would convert a
  // bool mask in each layer's call, and each layer's flash kernel would keep its own copy for
  // backward.
  if (mask.allowed.defined()) {
    mask.allowed = torch::zeros(mask.allowed.sizes(), x.options())
                       .masked_fill(~mask.allowed, -std::numeric_limits<float>::infinity());
  }
  for (auto& layer : layers) x = layer(x, cos, sin, mask, cache);
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
  if (!next_tokens.defined()) {
    auto& group = *model->sequence_parallel;
    auto logits = ulysses::gather_outputs_and_unpad(head(h), 1, T, group);
    return keep < T ? logits.narrow(1, T - keep, keep) : logits;
  }
  return log_probs_at(h, T, torch::arange(T - keep, T, torch::dtype(torch::kLong)), next_tokens,
                      temperature);
}

torch::Tensor LlamaForCausalLMImpl::forward(const PackedSequences& packed, torch::Tensor scored,
                                            torch::Tensor next_tokens, double temperature) {
  TORCH_CHECK(scored.dim() == 1 && next_tokens.sizes() == scored.sizes(),
              "LlamaForCausalLM: scored positions and next_tokens must both be [K], got ",
              scored.sizes(), " and ", next_tokens.sizes());
  auto h = model->forward_packed(packed);
  return log_probs_at(h, packed.tokens.size(1), scored, next_tokens.unsqueeze(0), temperature)
      .squeeze(0);
}

torch::Tensor LlamaForCausalLMImpl::log_probs_at(const torch::Tensor& h, int64_t T,
                                                 const torch::Tensor& positions,
                                                 const torch::Tensor& next_tokens,
                                                 double temperature) {
  const auto group = model->sequence_parallel;
  std::optional<ulysses::SequenceSlice> slice;
  if (group) slice = ulysses::sequence_slice(T, *group);
  const int64_t begin = slice ? slice->begin : 0, local_length = slice ? slice->local_length : T;
  // The head runs on this rank's scored entries only, so no rank holds more than its share of
  // the logits. A rank with none runs it on one position at weight 0: every rank must run every
  // FSDP unit and every all-to-all of the backward, whatever its slice holds.
  const auto scored = positions.to(h.device());
  const auto here = (scored >= begin) & (scored < begin + local_length);
  const auto local_positions = scored.masked_select(here) - begin;
  const auto targets = next_tokens.to(h.device()).index({torch::indexing::Slice(), here});
  torch::Tensor local;
  if (local_positions.numel() > 0) {
    local = target_log_probs(head(h.index_select(1, local_positions)), targets, temperature);
  } else {
    const auto unused = target_log_probs(head(h.narrow(1, 0, 1)),
                                         targets.new_zeros({next_tokens.size(0), 1}), temperature);
    local = torch::zeros({h.size(0), 0}, unused.options()) + 0.0 * unused.sum();
  }
  if (!slice) return local;
  // Gathered per entry, not per position: a position may score several entries (a shared
  // prompt's last token, once for each answer). Each rank's entries, in order, padded to the
  // most any rank has; entry k then sits at column owner * most + its rank among the owner's.
  const int64_t ranks = group->size();
  const auto owner = scored.div(local_length, "floor");
  const auto owned =
      owner.unsqueeze(1) == torch::arange(ranks, owner.options()).unsqueeze(0);  // [K, ranks]
  const auto counts = owned.sum(0);
  const int64_t most = std::max<int64_t>(1, counts.numel() ? counts.max().item<int64_t>() : 0);
  const auto order = (owned.to(torch::kLong).cumsum(0) - 1).gather(1, owner.unsqueeze(1));
  const auto column = owner * most + order.squeeze(1);
  const auto padded = at::constant_pad_nd(local, {0, most - local.size(1)}, 0);
  return ulysses::gather_outputs_and_unpad(padded, 1, ranks * most, *group).index_select(1, column);
}

PackedSequences pack_sequences(const torch::Tensor& tokens, const torch::Tensor& valid_in,
                               int64_t shared_prefix_length) {
  if (tokens.dim() != 2 || valid_in.sizes() != tokens.sizes()) {
    throw std::invalid_argument(
        fmt::format("pack_sequences: tokens and valid must both be [B, T], got {} and {}",
                    c10::str(tokens.sizes()), c10::str(valid_in.sizes())));
  }
  const int64_t rows = tokens.size(0), T = tokens.size(1);
  if (shared_prefix_length < 0 || shared_prefix_length > T) {
    throw std::invalid_argument(
        fmt::format("pack_sequences: shared_prefix_length must be in [0, {}], got {}", T,
                    shared_prefix_length));
  }
  const auto valid = valid_in.to(torch::kBool);
  const auto device = tokens.device();
  // A row shares its prompt when its first P columns repeat the row's before it (a GRPO group's
  // answers are consecutive rows) and that prompt has a token to share.
  std::vector<bool> shares(static_cast<size_t>(rows), false);
  std::vector<int64_t> prompt_tokens(static_cast<size_t>(rows), 0);
  const int64_t P = shared_prefix_length;
  if (P > 0 && rows > 1) {
    const auto prompt = tokens.narrow(1, 0, P), prompt_valid = valid.narrow(1, 0, P);
    const auto same = ((prompt.narrow(0, 1, rows - 1) == prompt.narrow(0, 0, rows - 1)) &
                       (prompt_valid.narrow(0, 1, rows - 1) == prompt_valid.narrow(0, 0, rows - 1)))
                          .all(1)
                          .cpu();
    const auto counts = prompt_valid.sum(1).to(torch::kLong).cpu().contiguous();
    for (int64_t row = 1; row < rows; ++row) {
      prompt_tokens[row] = counts.data_ptr<int64_t>()[row];
      shares[row] = same[row - 1].item<bool>() && prompt_tokens[row] > 0;
    }
  }
  // What each row packs: all its valid tokens, or only those after a shared prompt.
  auto packs = valid.clone();
  for (int64_t row = 0; row < rows; ++row) {
    if (shares[row]) packs[row].narrow(0, 0, P).fill_(false);
  }
  const auto lengths = packs.sum(1).to(torch::kLong).cpu().contiguous();
  PackedSequences packed;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t length = lengths.data_ptr<int64_t>()[row];
    if (length == 0 && !shares[row]) {
      throw std::invalid_argument(fmt::format("pack_sequences: row {} has no valid token", row));
    }
    if (length == 0) continue;
    packed.lengths.push_back(length);
    if (P > 0) packed.shared_prefix.push_back(shares[row] ? prompt_tokens[row] : 0);
  }
  packed.indices = packs.flatten().nonzero().squeeze(1);
  packed.tokens = tokens.flatten().index_select(0, packed.indices).unsqueeze(0);
  // Each token's position in its sequence: HF's position_ids of the padded row,
  // cumsum(mask) - 1, at the valid tokens.
  packed.position_ids =
      (valid.to(torch::kLong).cumsum(1) - 1).flatten().index_select(0, packed.indices).unsqueeze(0);
  auto packed_index = torch::full({rows, T}, -1, torch::dtype(torch::kLong).device(device));
  packed_index.view({-1}).index_put_(
      {packed.indices}, torch::arange(packed.indices.numel(), packed.indices.options()));
  // A sharing row's prompt is its leader's (equal rows back to the first of the run, copied in
  // order so each points at the first).
  for (int64_t row = 1; row < rows; ++row) {
    if (shares[row]) packed_index[row].narrow(0, 0, P).copy_(packed_index[row - 1].narrow(0, 0, P));
  }
  packed.packed_index = packed_index.view({-1});
  return packed;
}

void LlamaModelImpl::set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group) {
  if (group) {
    ulysses::check_heads(config_.num_attention_heads, config_.num_key_value_heads, group->size());
  }
  sequence_parallel = group && group->size() > 1 ? group : nullptr;
  for (auto& layer : layers) layer->self_attn->set_sequence_parallel(sequence_parallel.get());
}

void LlamaModelImpl::set_activation_checkpointing(bool enabled) {
  for (auto& layer : layers) layer->checkpoint_activations = enabled;
}

void LlamaForCausalLMImpl::set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group) {
  model->set_sequence_parallel(std::move(group));
}

void LlamaForCausalLMImpl::set_activation_checkpointing(bool enabled) {
  model->set_activation_checkpointing(enabled);
}

LlamaForTokenClassificationImpl::LlamaForTokenClassificationImpl(const LlamaConfig& c)
    : config_(c) {
  c.validate();
  model = register_module("model", LlamaModel(c));
  score = register_module("score", Linear(torch::nn::LinearOptions(c.hidden_size, 1).bias(true)));
}

torch::Tensor LlamaForTokenClassificationImpl::values(const torch::Tensor& hidden, int64_t length) {
  auto v = score(hidden).squeeze(-1).to(torch::kFloat);  // [B, local length]
  if (!model->sequence_parallel) return v;
  return ulysses::gather_outputs_and_unpad(v, 1, length, *model->sequence_parallel);
}

torch::Tensor LlamaForTokenClassificationImpl::forward(torch::Tensor tokens,
                                                       torch::Tensor attention_mask) {
  return values(model(tokens, nullptr, attention_mask), tokens.size(1));
}

torch::Tensor LlamaForTokenClassificationImpl::forward(const PackedSequences& packed) {
  return values(model->forward_packed(packed), packed.tokens.size(1)).squeeze(0);
}

void init_value_head(LinearImpl& score, double initializer_range, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto w = score.weight;
  w.copy_(at::normal(0.0, initializer_range, w.sizes(), generator, torch::dtype(torch::kFloat)));
  if (score.bias.defined()) score.bias.zero_();
}

nlohmann::json value_model_config_json(const LlamaConfig& config) {
  auto j = config.to_json();
  auto architecture = j["architectures"][0].get<std::string>();
  architecture.replace(architecture.find("ForCausalLM"), std::string("ForCausalLM").size(),
                       "ForTokenClassification");
  j["architectures"] = {architecture};
  j["id2label"] = {{"0", "LABEL_0"}};
  j["label2id"] = {{"LABEL_0", 0}};
  return j;
}

void shard_llama(LlamaForCausalLM& model, const dist::DeviceMesh& mesh, const WrapPolicy& policy) {
  auto& decoder = *model->model;
  if (model->config().tie_word_embeddings) {
    shard_by_block(model, decoder.layers, mesh, policy);
  } else {
    shard_by_block(model, decoder.layers, mesh, policy, decoder.embed_tokens, model->lm_head);
  }
}

void shard_llama(LlamaForTokenClassification& model, const dist::DeviceMesh& mesh,
                 const WrapPolicy& policy) {
  auto& decoder = *model->model;
  shard_by_block(model, decoder.layers, mesh, policy, decoder.embed_tokens);
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
  const int64_t hd = c.attention_head_dim();
  if (c.qk_norm()) check_dim(l0 + "self_attn.q_norm.weight", 0, hd, "head_dim", hd);
  const auto q = shapes.find(l0 + "self_attn.q_proj.weight");
  if (q != shapes.end() && !q->second.empty() && q->second[0] != c.num_attention_heads * hd) {
    throw std::invalid_argument(fmt::format(
        "config fields num_attention_heads = {} and head_dim = {} disagree with tensor {} of "
        "shape [{}] ({} rows expected)",
        c.num_attention_heads, hd, q->first, fmt::join(q->second, ", "),
        c.num_attention_heads * hd));
  }
  check_dim(l0 + "self_attn.k_proj.weight", 0, c.num_key_value_heads * hd, "num_key_value_heads",
            c.num_key_value_heads);
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
