#include "shardrl/models/text_encoder.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>

#include "checkpoint/io.h"
#include "models/json_fields.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/layers.h"
#include "shardrl/models/weights.h"
#include "text/utf8.h"

namespace shardrl::models {
namespace {

namespace fs = std::filesystem;

// ---- transformers' BertModel, named as its state dict -------------------------------------------

// BertSelfOutput and BertOutput: LayerNorm(dense(x) + residual).
class DenseNormImpl : public torch::nn::Module {
 public:
  DenseNormImpl(int64_t in, int64_t out, double eps)
      : dense(register_module("dense", Linear(in, out))),
        norm(register_module("LayerNorm", LayerNorm(out, eps))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& residual) {
    return norm(dense(x) + residual);
  }
  Linear dense;
  LayerNorm norm;
};
TORCH_MODULE(DenseNorm);

class SelfAttentionImpl : public torch::nn::Module {
 public:
  explicit SelfAttentionImpl(const BertConfig& c)
      : query(register_module("query", Linear(c.hidden_size, c.hidden_size))),
        key(register_module("key", Linear(c.hidden_size, c.hidden_size))),
        value(register_module("value", Linear(c.hidden_size, c.hidden_size))),
        heads_(c.num_attention_heads) {}
  // `attend` [B, 1, 1, L] bool: true on the keys a query may see (the row's tokens).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& attend) {
    const int64_t B = x.size(0), L = x.size(1), D = x.size(2);
    const auto split = [&](const torch::Tensor& t) {
      return t.view({B, L, heads_, D / heads_}).transpose(1, 2);
    };
    auto out =
        at::scaled_dot_product_attention(split(query(x)), split(key(x)), split(value(x)), attend);
    return out.transpose(1, 2).reshape({B, L, D});
  }
  Linear query, key, value;

 private:
  int64_t heads_;
};
TORCH_MODULE(SelfAttention);

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const BertConfig& c)
      : self(register_module("self", SelfAttention(c))),
        output(
            register_module("output", DenseNorm(c.hidden_size, c.hidden_size, c.layer_norm_eps))) {}
  SelfAttention self;
  DenseNorm output;
};
TORCH_MODULE(Attention);

class IntermediateImpl : public torch::nn::Module {
 public:
  explicit IntermediateImpl(const BertConfig& c)
      : dense(register_module("dense", Linear(c.hidden_size, c.intermediate_size))) {}
  Linear dense;
};
TORCH_MODULE(Intermediate);

// Post-LayerNorm: x = LN(x + attention(x)); x = LN(x + W2 gelu(W1 x)).
class LayerImpl : public torch::nn::Module {
 public:
  explicit LayerImpl(const BertConfig& c)
      : attention(register_module("attention", Attention(c))),
        intermediate(register_module("intermediate", Intermediate(c))),
        output(register_module("output",
                               DenseNorm(c.intermediate_size, c.hidden_size, c.layer_norm_eps))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& attend) {
    auto h = attention->output(attention->self(x, attend), x);
    return output(torch::gelu(intermediate->dense(h)), h);
  }
  Attention attention;
  Intermediate intermediate;
  DenseNorm output;
};
TORCH_MODULE(Layer);

class EmbeddingsImpl : public torch::nn::Module {
 public:
  explicit EmbeddingsImpl(const BertConfig& c)
      : word_embeddings(register_module("word_embeddings", Embedding(c.vocab_size, c.hidden_size))),
        position_embeddings(register_module("position_embeddings",
                                            Embedding(c.max_position_embeddings, c.hidden_size))),
        token_type_embeddings(
            register_module("token_type_embeddings", Embedding(c.type_vocab_size, c.hidden_size))),
        norm(register_module("LayerNorm", LayerNorm(c.hidden_size, c.layer_norm_eps))) {}
  // One sentence: every token has type 0 and positions count from 0.
  torch::Tensor forward(const torch::Tensor& ids) {
    const int64_t L = ids.size(1);
    // transformers' order: (words + token types) + positions.
    auto x = word_embeddings(ids) + token_type_embeddings->weight[0] +
             position_embeddings->weight.narrow(0, 0, L);
    return norm(x);
  }
  Embedding word_embeddings, position_embeddings, token_type_embeddings;
  LayerNorm norm;
};
TORCH_MODULE(Embeddings);

class EncoderImpl : public torch::nn::Module {
 public:
  explicit EncoderImpl(const BertConfig& c)
      : layer(register_module("layer", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) layer->push_back(Layer(c));
  }
  torch::nn::ModuleList layer;
};
TORCH_MODULE(Encoder);

class BertImpl : public torch::nn::Module {
 public:
  explicit BertImpl(const BertConfig& c)
      : embeddings(register_module("embeddings", Embeddings(c))),
        encoder(register_module("encoder", Encoder(c))) {}
  // ids, mask [B, L] int64 -> last hidden state [B, L, hidden].
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& mask) {
    auto attend = mask.to(torch::kBool).view({mask.size(0), 1, 1, mask.size(1)});
    auto x = embeddings(ids);
    for (const auto& layer : *encoder->layer) x = layer->as<LayerImpl>()->forward(x, attend);
    return x;
  }
  Embeddings embeddings;
  Encoder encoder;
};
TORCH_MODULE(Bert);

// Tensors all-MiniLM-L6-v2's file holds that the encoder leaves unused: position_ids (a buffer
// older transformers saved) and BertModel's [CLS] pooler, which mean pooling does not use.
const std::set<std::string> kUnusedTensors = {"embeddings.position_ids", "pooler.dense.weight",
                                              "pooler.dense.bias"};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape(const torch::Tensor& t) {
  return fmt::format("[{}]", fmt::join(t.sizes(), ", "));
}

std::string hex(uint64_t v, int digits) {
  return fmt::format("{:0{}x}", v, digits);
}

uint32_t crc32_of(const std::string& s) {
  return checkpoint::crc32_update(0, s.data(), static_cast<int64_t>(s.size()));
}

}  // namespace

// ---- config ------------------------------------------------------------------------------------

BertConfig BertConfig::from_json(const nlohmann::json& j) {
  BertConfig c;
  std::string model_type = "bert";
  detail::read_field(j, "model_type", model_type, false);
  if (model_type != "bert") {
    throw std::invalid_argument(
        fmt::format("config.json: field model_type is '{}' (expected bert)", model_type));
  }
  detail::read_field(j, "vocab_size", c.vocab_size, true);
  detail::read_field(j, "hidden_size", c.hidden_size, true);
  detail::read_field(j, "num_hidden_layers", c.num_hidden_layers, true);
  detail::read_field(j, "num_attention_heads", c.num_attention_heads, true);
  detail::read_field(j, "intermediate_size", c.intermediate_size, true);
  detail::read_field(j, "max_position_embeddings", c.max_position_embeddings, false);
  detail::read_field(j, "type_vocab_size", c.type_vocab_size, false);
  detail::read_field(j, "layer_norm_eps", c.layer_norm_eps, false);
  detail::read_field(j, "hidden_act", c.hidden_act, false);
  detail::read_field(j, "position_embedding_type", c.position_embedding_type, false);
  const std::pair<int64_t, const char*> sizes[] = {
      {c.vocab_size, "vocab_size"},
      {c.hidden_size, "hidden_size"},
      {c.num_hidden_layers, "num_hidden_layers"},
      {c.num_attention_heads, "num_attention_heads"},
      {c.intermediate_size, "intermediate_size"},
      {c.max_position_embeddings, "max_position_embeddings"},
      {c.type_vocab_size, "type_vocab_size"}};
  for (const auto& [value, field] : sizes) detail::require_positive(value, field);
  if (c.hidden_size % c.num_attention_heads != 0) {
    throw std::invalid_argument(
        fmt::format("config.json: hidden_size {} does not split into num_attention_heads {}",
                    c.hidden_size, c.num_attention_heads));
  }
  if (c.hidden_act != "gelu") {
    throw std::invalid_argument(fmt::format(
        "config.json: field hidden_act is '{}'; only gelu (erf) is supported", c.hidden_act));
  }
  if (c.position_embedding_type != "absolute") {
    throw std::invalid_argument(fmt::format(
        "config.json: field position_embedding_type is '{}'; only absolute is supported",
        c.position_embedding_type));
  }
  if (!(c.layer_norm_eps > 0)) {
    throw std::invalid_argument("config.json: field layer_norm_eps must be positive");
  }
  return c;
}

BertConfig BertConfig::load(const std::string& path) {
  return detail::with_path(path, [](const nlohmann::json& j) { return from_json(j); });
}

// ---- encoder -----------------------------------------------------------------------------------

struct TextEncoder::Impl {
  std::string dir;
  BertConfig config;
  text::WordPieceTokenizer tokenizer;
  int64_t max_seq_length = 0;
  bool normalize = false;
  std::string fingerprint;
  mutable Bert bert{nullptr};  // forward-only: its forward is not const, but changes nothing

  Impl(std::string d, BertConfig c, text::WordPieceTokenizer t)
      : dir(std::move(d)), config(std::move(c)), tokenizer(std::move(t)) {}
};

TextEncoder TextEncoder::load(const std::string& dir) {
  // modules.json: the Transformer in the folder itself, a Pooling, then optionally a Normalize.
  const std::string modules_path = dir + "/modules.json";
  std::string pooling_dir;
  bool normalize = false;
  detail::with_path(modules_path, [&](const nlohmann::json& modules) {
    if (!modules.is_array()) throw std::invalid_argument("must be a list of modules");
    std::vector<std::string> kinds;
    for (const auto& m : modules) {
      const std::string type = m.value("type", std::string());
      const std::string path = m.value("path", std::string());
      if (ends_with(type, ".Transformer") && kinds.empty() && path.empty()) {
        kinds.push_back("Transformer");
      } else if (ends_with(type, ".Pooling") && kinds.size() == 1) {
        kinds.push_back("Pooling");
        pooling_dir = dir + "/" + path;
      } else if (ends_with(type, ".Normalize") && kinds.size() == 2) {
        kinds.push_back("Normalize");
        normalize = true;
      } else {
        throw std::invalid_argument(fmt::format(
            "module {} (type '{}', path '{}') is not supported: a Transformer in the folder "
            "itself, a Pooling and optionally a Normalize are",
            m.value("idx", -1), type, path));
      }
    }
    if (kinds.size() < 2) throw std::invalid_argument("needs a Transformer and a Pooling module");
    return 0;
  });
  detail::with_path(pooling_dir + "/config.json", [](const nlohmann::json& j) {
    bool mean = j.value("pooling_mode", std::string()) == "mean";
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& key = it.key();
      const auto& value = it.value();
      if (key.rfind("pooling_mode_", 0) != 0) continue;
      if (!value.is_boolean()) throw std::invalid_argument("field " + key + " must be a boolean");
      const bool is_mean = key == "pooling_mode_mean_tokens";
      if (value.get<bool>() && !is_mean) {
        throw std::invalid_argument("field " + key + " is true; only mean pooling is supported");
      }
      mean = mean || (is_mean && value.get<bool>());
    }
    if (!mean)
      throw std::invalid_argument("only mean pooling (pooling_mode_mean_tokens) is supported");
    return 0;
  });

  auto config = BertConfig::load(dir + "/config.json");
  int64_t max_seq_length = config.max_position_embeddings;
  const std::string st_config = dir + "/sentence_bert_config.json";
  if (fs::exists(st_config)) {
    detail::with_path(st_config, [&](const nlohmann::json& j) {
      detail::read_field(j, "max_seq_length", max_seq_length, false);
      bool lower = false;
      detail::read_field(j, "do_lower_case", lower, false);
      if (lower) {
        throw std::invalid_argument(
            "field do_lower_case true (Python's str.lower before the tokenizer) is not supported");
      }
      return 0;
    });
  }
  if (max_seq_length < 2 || max_seq_length > config.max_position_embeddings) {
    throw std::invalid_argument(
        fmt::format("{}: field max_seq_length {} must be in [2, max_position_embeddings {}]",
                    st_config, max_seq_length, config.max_position_embeddings));
  }
  auto tokenizer = text::WordPieceTokenizer::load(dir);
  if (tokenizer.vocab_size() > config.vocab_size) {
    throw std::invalid_argument(
        fmt::format("{}/vocab.txt has {} tokens, config.json's vocab_size is {}", dir,
                    tokenizer.vocab_size(), config.vocab_size));
  }

  auto impl = std::make_shared<Impl>(dir, config, std::move(tokenizer));
  impl->max_seq_length = max_seq_length;
  impl->normalize = normalize;
  const std::string weights = dir + "/model.safetensors";
  if (!fs::is_regular_file(weights)) {
    throw std::invalid_argument(fmt::format("text encoder: {} is missing", weights));
  }
  impl->bert = Bert(config);
  LoadWeightsOptions options;
  options.unused = kUnusedTensors;
  load_weights(*impl->bert, weights, options);
  impl->bert->eval();
  for (auto& p : impl->bert->parameters()) p.set_requires_grad(false);

  // What encode() depends on besides the prompts: the weights, the vocabulary and every setting.
  std::string settings =
      fmt::format("{}|{}|{}|{}|{}", text::detail::read_file("text encoder", dir + "/vocab.txt"),
                  detail::read_json_file(dir + "/config.json").dump(), max_seq_length, normalize,
                  fs::file_size(weights));
  const auto& o = impl->tokenizer.options();
  settings += fmt::format("|{}|{}|{}|{}|{}|{}{}{}{}{}", o.do_lower_case, o.strip_accents,
                          o.tokenize_chinese_chars, o.clean_text, o.max_input_chars_per_word,
                          o.unk_token, o.sep_token, o.pad_token, o.cls_token, o.mask_token);
  impl->fingerprint = hex(checkpoint::file_crc32(weights), 8) + hex(crc32_of(settings), 8);

  TextEncoder encoder;
  encoder.impl_ = std::move(impl);
  return encoder;
}

TextEncoding TextEncoder::encode(const std::vector<std::string>& prompts, int64_t pad_to) const {
  auto batch = impl_->tokenizer.encode_batch(prompts, impl_->max_seq_length, pad_to);
  return encode_ids(batch.input_ids, batch.attention_mask);
}

TextEncoding TextEncoder::encode_ids(const torch::Tensor& input_ids,
                                     const torch::Tensor& attention_mask) const {
  const auto& c = impl_->config;
  if (input_ids.dim() != 2 || attention_mask.sizes() != input_ids.sizes()) {
    throw std::invalid_argument(
        fmt::format("text encoder: input_ids {} and attention_mask {} must both be [batch, length]",
                    shape(input_ids), shape(attention_mask)));
  }
  if (input_ids.size(1) > c.max_position_embeddings) {
    throw std::invalid_argument(
        fmt::format("text encoder: {} tokens exceed max_position_embeddings {}", input_ids.size(1),
                    c.max_position_embeddings));
  }
  if (input_ids.numel() > 0 &&
      (input_ids.min().item<int64_t>() < 0 || input_ids.max().item<int64_t>() >= c.vocab_size)) {
    throw std::invalid_argument(
        fmt::format("text encoder: a token id is outside [0, vocab_size {})", c.vocab_size));
  }
  torch::NoGradGuard no_grad;
  TextEncoding out;
  out.attention_mask = attention_mask.to(torch::kLong);
  out.prompt_embeds = impl_->bert->forward(input_ids.to(torch::kLong), out.attention_mask);
  // sentence-transformers' mean pooling: the sum over the row's tokens over their count.
  auto mask = out.attention_mask.unsqueeze(-1).to(out.prompt_embeds.scalar_type());
  out.pooled = (out.prompt_embeds * mask).sum(1) / mask.sum(1).clamp_min(1e-9);
  if (impl_->normalize) {
    out.pooled = torch::nn::functional::normalize(
        out.pooled, torch::nn::functional::NormalizeFuncOptions().p(2).dim(1));
  }
  return out;
}

const text::WordPieceTokenizer& TextEncoder::tokenizer() const {
  return impl_->tokenizer;
}
const BertConfig& TextEncoder::config() const {
  return impl_->config;
}
int64_t TextEncoder::max_seq_length() const {
  return impl_->max_seq_length;
}
bool TextEncoder::normalizes() const {
  return impl_->normalize;
}
const std::string& TextEncoder::dir() const {
  return impl_->dir;
}
const std::string& TextEncoder::fingerprint() const {
  return impl_->fingerprint;
}

// ---- cache -------------------------------------------------------------------------------------

CachedEncoding encode_cached(const TextEncoder& encoder, const std::vector<std::string>& prompts,
                             const std::string& cache_path, int64_t pad_to) {
  const std::string prompts_json = nlohmann::json(prompts).dump();
  const std::string key =
      fmt::format("{}-{}-{}", encoder.fingerprint(), pad_to, hex(crc32_of(prompts_json), 8));
  const int64_t n = static_cast<int64_t>(prompts.size()), hidden = encoder.config().hidden_size;
  if (fs::exists(cache_path)) {
    checkpoint::SafetensorsReader reader(cache_path);
    const auto& meta = reader.metadata();
    const auto at = [&](const char* field) {
      auto it = meta.find(field);
      return it == meta.end() ? std::string() : it->second;
    };
    // The prompts themselves are compared too: a hash collision cannot hand back other prompts'
    // embeddings.
    if (at("key") == key && at("prompts") == prompts_json) {
      CachedEncoding cached;
      cached.from_cache = true;
      auto& e = cached.encoding;
      for (const char* name : {"prompt_embeds", "attention_mask", "pooled"}) {
        if (!reader.contains(name)) {
          throw std::invalid_argument(
              fmt::format("text embedding cache {}: missing tensor {}", cache_path, name));
        }
      }
      e.prompt_embeds = reader.read("prompt_embeds");
      e.attention_mask = reader.read("attention_mask");
      e.pooled = reader.read("pooled");
      const bool shapes_ok = e.prompt_embeds.dim() == 3 && e.prompt_embeds.size(0) == n &&
                             e.prompt_embeds.size(2) == hidden &&
                             e.attention_mask.sizes() == e.prompt_embeds.sizes().slice(0, 2) &&
                             e.pooled.sizes() == torch::IntArrayRef({n, hidden});
      if (!shapes_ok) {
        throw std::invalid_argument(fmt::format(
            "text embedding cache {}: tensors prompt_embeds {}, attention_mask {}, pooled {} do "
            "not fit {} prompts of width {}",
            cache_path, shape(e.prompt_embeds), shape(e.attention_mask), shape(e.pooled), n,
            hidden));
      }
      return cached;
    }
  }
  CachedEncoding fresh;
  fresh.encoding = encoder.encode(prompts, pad_to);
  const auto& e = fresh.encoding;
  const std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"prompt_embeds", e.prompt_embeds.contiguous()},
      {"attention_mask", e.attention_mask.contiguous()},
      {"pooled", e.pooled.contiguous()}};
  std::vector<checkpoint::TensorInfo> infos;
  for (const auto& [name, t] : tensors) {
    checkpoint::TensorInfo info;
    info.name = name;
    info.dtype = t.scalar_type();
    info.shape = t.sizes().vec();
    infos.push_back(std::move(info));
  }
  // Written beside and renamed over: a reader never sees half a file.
  const std::string tmp = cache_path + ".tmp";
  {
    checkpoint::SafetensorsWriter writer(
        tmp, infos,
        {{"format", "pt"}, {"key", key}, {"prompts", prompts_json}, {"encoder", encoder.dir()}});
    for (const auto& [name, t] : tensors) writer.write(name, t);
    writer.close();
  }
  fs::rename(tmp, cache_path);
  return fresh;
}

}  // namespace shardrl::models
