// GGUF -> Hugging Face model folder for LLaMA-architecture models: what llama.cpp's
// convert_hf_to_gguf.py does, undone. Names go back to transformers', the Q and K projections
// back to transformers' rotary layout, quantized tensors to floats, and the tokenizer metadata to
// tokenizer.json, so the folder loads in ShardRL and in transformers alike.
#include <fmt/format.h>

#include <filesystem>
#include <regex>

#include "checkpoint/io.h"
#include "shardrl/checkpoint.h"
#include "shardrl/convert/gguf_import.h"
#include "shardrl/models/llama.h"
#include "shardrl/text/bpe_tokenizer.h"

namespace shardrl::convert {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// llama.cpp's pre-tokenizer names whose split is GPT-2's regex (transformers' GGUF loader gives
// these the ByteLevel pre-tokenizer with its regex; others have their own split).
bool gpt2_split(const std::string& pre) {
  return pre == "default" || pre == "gpt2" || pre == "smollm";
}

int64_t metadata_int(const checkpoint::GgufFile& gguf, const std::string& key) {
  const json& value = gguf.at(key);
  if (!value.is_number_integer()) {
    throw std::invalid_argument(fmt::format("GGUF {}: metadata '{}' must be an integer, got {}",
                                            gguf.path(), key,
                                            value.is_string() ? "a string" : value.dump()));
  }
  return value.get<int64_t>();
}

double metadata_number(const checkpoint::GgufFile& gguf, const std::string& key) {
  const json& value = gguf.at(key);
  if (!value.is_number()) {
    throw std::invalid_argument(
        fmt::format("GGUF {}: metadata '{}' must be a number", gguf.path(), key));
  }
  return value.get<double>();
}

const json& metadata_array(const checkpoint::GgufFile& gguf, const std::string& key) {
  const json& value = gguf.at(key);
  if (!value.is_array()) {
    throw std::invalid_argument(
        fmt::format("GGUF {}: metadata '{}' must be an array", gguf.path(), key));
  }
  return value;
}

// LlamaConfig::validate() and check_config_against_weights() name transformers' config fields and
// tensors; this adds the names the GGUF file has for those the message mentions.
std::string in_gguf_terms(const std::string& message,
                          const std::map<std::string, std::string>& keys,
                          const std::map<std::string, std::string>& source) {
  std::vector<std::string> names;
  for (const auto& [field, key] : keys) {
    if (message.find(" " + field + " ") != std::string::npos) {
      names.push_back(fmt::format("metadata '{}'", key));
    }
  }
  for (const auto& [hf, gguf] : source) {
    if (message.find(hf) != std::string::npos) names.push_back(fmt::format("tensor '{}'", gguf));
  }
  if (names.empty()) return message;
  return fmt::format("{} (in the GGUF: {})", message, fmt::join(names, ", "));
}

// The config the metadata describes. `keys` gets, for each of transformers' config fields read,
// the metadata key it came from: errors about the field then name what the file calls it.
models::LlamaConfig config_from_gguf(const checkpoint::GgufFile& gguf,
                                     std::map<std::string, std::string>& keys) {
  const json& arch_value = gguf.at("general.architecture");
  const std::string arch = arch_value.is_string() ? arch_value.get<std::string>() : "";
  if (arch != "llama") {
    throw std::invalid_argument(fmt::format(
        "GGUF {}: metadata 'general.architecture' is '{}'; shardrl import reads 'llama'",
        gguf.path(), arch_value.is_string() ? arch : arch_value.dump()));
  }
  const std::string p = arch + ".";
  auto read_int = [&](const std::string& field, const std::string& key) {
    keys[field] = key;
    return metadata_int(gguf, key);
  };
  models::LlamaConfig c;
  c.model_type = "llama";
  c.num_hidden_layers = read_int("num_hidden_layers", p + "block_count");
  c.hidden_size = read_int("hidden_size", p + "embedding_length");
  c.intermediate_size = read_int("intermediate_size", p + "feed_forward_length");
  c.num_attention_heads = read_int("num_attention_heads", p + "attention.head_count");
  // Without head_count_kv every head has its own K and V (no GQA).
  const std::string kv_key = gguf.metadata().contains(p + "attention.head_count_kv")
                                 ? p + "attention.head_count_kv"
                                 : p + "attention.head_count";
  c.num_key_value_heads = read_int("num_key_value_heads", kv_key);
  c.max_position_embeddings = metadata_int(gguf, p + "context_length");
  c.rms_norm_eps = metadata_number(gguf, p + "attention.layer_norm_rms_epsilon");
  c.rope_parameters.rope_theta = gguf.metadata().contains(p + "rope.freq_base")
                                     ? metadata_number(gguf, p + "rope.freq_base")
                                     : 10000.0;
  if (gguf.metadata().contains(p + "vocab_size")) {
    c.vocab_size = read_int("vocab_size", p + "vocab_size");
  } else {
    keys["vocab_size"] = "tokenizer.ggml.tokens";
    c.vocab_size = static_cast<int64_t>(metadata_array(gguf, "tokenizer.ggml.tokens").size());
  }
  c.tie_word_embeddings = !gguf.contains("output.weight");
  c.attention_bias = gguf.contains("blk.0.attn_q.bias");
  if (c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0) {
    throw std::invalid_argument(
        fmt::format("GGUF {}: metadata '{}attention.head_count' = {} does not divide "
                    "'{}embedding_length' = {}",
                    gguf.path(), p, c.num_attention_heads, p, c.hidden_size));
  }
  // ShardRL's attention has head_dim = hidden / heads and plain RoPE over all of it.
  for (const char* key : {"rope.dimension_count", "attention.key_length"}) {
    if (gguf.metadata().contains(p + key) &&
        metadata_int(gguf, p + key) != c.attention_head_dim()) {
      throw std::invalid_argument(fmt::format(
          "GGUF {}: metadata '{}{}' = {} differs from head_dim {} ('{}embedding_length' {} / "
          "'{}attention.head_count' {}), which ShardRL's attention requires",
          gguf.path(), p, key, metadata_int(gguf, p + key), c.attention_head_dim(), p,
          c.hidden_size, p, c.num_attention_heads));
    }
  }
  if (gguf.metadata().contains(p + "rope.scaling.type") &&
      gguf.at(p + "rope.scaling.type") != "none") {
    throw std::invalid_argument(
        fmt::format("GGUF {}: metadata '{}rope.scaling.type' = {}: RoPE scaling is not supported",
                    gguf.path(), p, gguf.at(p + "rope.scaling.type").dump()));
  }
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        fmt::format("GGUF {}: {}", gguf.path(), in_gguf_terms(e.what(), keys, {})));
  }
  return c;
}

// convert_hf_to_gguf.py's tensor names, GGUF -> transformers: outside the blocks, and inside
// block i (blk.i.<name>.weight / .bias for model.layers.i.<name>.weight / .bias).
const std::map<std::string, std::string> kTopNames = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"}};
const std::map<std::string, std::string> kBlockNames = {
    {"attn_norm", "input_layernorm"}, {"ffn_norm", "post_attention_layernorm"},
    {"attn_q", "self_attn.q_proj"},   {"attn_k", "self_attn.k_proj"},
    {"attn_v", "self_attn.v_proj"},   {"attn_output", "self_attn.o_proj"},
    {"ffn_gate", "mlp.gate_proj"},    {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"}};

// GGUF tensor name -> transformers' name; empty for a name that is not one of LLaMA's.
std::string hf_name(const std::string& gguf_name) {
  if (auto it = kTopNames.find(gguf_name); it != kTopNames.end()) return it->second;
  static const std::regex block_re(R"(blk\.(\d+)\.(\w+)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(gguf_name, m, block_re)) return "";
  auto it = kBlockNames.find(m[2].str());
  if (it == kBlockNames.end()) return "";
  return fmt::format("model.layers.{}.{}.{}", m[1].str(), it->second, m[3].str());
}

// The inverse: the name a tensor the file lacks would have had in it.
std::string gguf_name(const std::string& hf) {
  for (const auto& [gguf, name] : kTopNames) {
    if (name == hf) return gguf;
  }
  static const std::regex layer_re(R"(model\.layers\.(\d+)\.(.+)\.(weight|bias))");
  std::smatch m;
  if (std::regex_match(hf, m, layer_re)) {
    for (const auto& [gguf, name] : kBlockNames) {
      if (name == m[2].str()) return fmt::format("blk.{}.{}.{}", m[1].str(), gguf, m[3].str());
    }
  }
  return hf;
}

// convert_hf_to_gguf.py permutes the rows of q_proj / k_proj (weights and biases) per head from
// transformers' rotate-half layout to llama.cpp's interleaved one:
//   w.reshape(heads, 2, rows / heads / 2, ...).swapaxes(1, 2)
// This is its inverse.
torch::Tensor unpermute_rotary_rows(const torch::Tensor& w, int64_t heads) {
  std::vector<int64_t> split = {heads, w.size(0) / heads / 2, 2};
  for (int64_t d = 1; d < w.dim(); ++d) split.push_back(w.size(d));
  return w.reshape(split).transpose(1, 2).reshape(w.sizes()).contiguous();
}

text::ByteLevelBpeTokenizer tokenizer_from_gguf(const checkpoint::GgufFile& gguf) {
  const json& model = gguf.at("tokenizer.ggml.model");
  if (model != "gpt2") {
    throw std::invalid_argument(fmt::format(
        "GGUF {}: metadata 'tokenizer.ggml.model' is {}; shardrl import reads byte-level BPE "
        "('gpt2')",
        gguf.path(), model.dump()));
  }
  const std::string pre = gguf.metadata().value("tokenizer.ggml.pre", std::string("default"));
  if (!gpt2_split(pre)) {
    throw std::invalid_argument(fmt::format(
        "GGUF {}: metadata 'tokenizer.ggml.pre' is '{}', whose split is not GPT-2's; shardrl "
        "import reads 'default', 'gpt2' and 'smollm'",
        gguf.path(), pre));
  }
  std::vector<std::string> tokens;
  for (const auto& t : metadata_array(gguf, "tokenizer.ggml.tokens")) {
    if (!t.is_string()) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: metadata 'tokenizer.ggml.tokens' holds a non-string", gguf.path()));
    }
    tokens.push_back(t.get<std::string>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const auto& m : metadata_array(gguf, "tokenizer.ggml.merges")) {
    const std::string merge = m.is_string() ? m.get<std::string>() : "";
    const size_t space = merge.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == merge.size()) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: metadata 'tokenizer.ggml.merges' entry {} is not 'a b': {}",
                      gguf.path(), merges.size(), m.dump()));
    }
    merges.emplace_back(merge.substr(0, space), merge.substr(space + 1));
  }
  // As transformers' GGUF loader: CONTROL tokens (3) are special added tokens, USER_DEFINED (4)
  // plain added tokens; both are matched whole in the text.
  std::vector<text::ByteLevelBpeTokenizer::AddedToken> added;
  if (gguf.metadata().contains("tokenizer.ggml.token_type")) {
    const json& types = metadata_array(gguf, "tokenizer.ggml.token_type");
    if (types.size() != tokens.size()) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: metadata 'tokenizer.ggml.token_type' has {} entries for {} tokens",
                      gguf.path(), types.size(), tokens.size()));
    }
    for (size_t id = 0; id < tokens.size(); ++id) {
      const int64_t type = types[id].is_number_integer() ? types[id].get<int64_t>() : 0;
      if (type == 3 || type == 4) {
        added.push_back({static_cast<int64_t>(id), tokens[id], /*special=*/type == 3});
      }
    }
  }
  try {
    return text::ByteLevelBpeTokenizer::from_vocab(std::move(tokens), std::move(merges),
                                                   std::move(added));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("GGUF {}: tokenizer: {}", gguf.path(), e.what()));
  }
}

// The token text of metadata `key` (an id), or null when the file has none.
json token_of(const checkpoint::GgufFile& gguf, const std::string& key) {
  if (!gguf.metadata().contains(key)) return nullptr;
  const int64_t id = metadata_int(gguf, key);
  const json& tokens = gguf.at("tokenizer.ggml.tokens");
  if (id < 0 || id >= static_cast<int64_t>(tokens.size())) {
    throw std::invalid_argument(
        fmt::format("GGUF {}: metadata '{}' = {} is not a token id", gguf.path(), key, id));
  }
  return tokens[id];
}

}  // namespace

namespace {

std::vector<std::string> import_into(const std::string& gguf_path, const std::string& out_dir,
                                     torch::ScalarType dtype) {
  const checkpoint::GgufFile gguf(gguf_path);
  std::map<std::string, std::string> config_keys;  // config field -> metadata key
  const models::LlamaConfig config = config_from_gguf(gguf, config_keys);
  const text::ByteLevelBpeTokenizer tokenizer = tokenizer_from_gguf(gguf);

  // Every GGUF tensor maps to one of the model's, and every one of the model's is present.
  std::map<std::string, std::string> source;  // HF name -> GGUF name
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& t : gguf.tensors()) {
    const std::string name = hf_name(t.name);
    if (name.empty()) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: tensor '{}' is not one of a LLaMA model's", gguf.path(), t.name));
    }
    source[name] = t.name;
    shapes[name] = t.shape;
  }
  try {
    models::check_config_against_weights(config, shapes);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        fmt::format("GGUF {}: {}", gguf.path(), in_gguf_terms(e.what(), config_keys, source)));
  }
  std::vector<checkpoint::HfTensorPlan> plan;
  {
    fsdp::EmptyInit no_storage;
    models::LlamaForCausalLM expected(config);
    for (const auto& p : expected->named_parameters()) {
      auto it = source.find(p.key());
      if (it == source.end()) {
        throw std::invalid_argument(fmt::format("GGUF {}: tensor '{}' ({}) is missing", gguf.path(),
                                                gguf_name(p.key()), p.key()));
      }
      if (shapes[p.key()] != p.value().sizes().vec()) {
        throw std::invalid_argument(
            fmt::format("GGUF {}: tensor '{}' has shape [{}]; the config's {} needs [{}]",
                        gguf.path(), it->second, fmt::join(shapes[p.key()], ", "), p.key(),
                        fmt::join(p.value().sizes(), ", ")));
      }
      plan.push_back({p.key(), p.value().sizes().vec()});
    }
    if (plan.size() != source.size()) {
      for (const auto& [name, gguf_name] : source) {
        if (!expected->named_parameters().contains(name)) {
          throw std::invalid_argument(fmt::format(
              "GGUF {}: tensor '{}' ({}) has no place in the model the config describes",
              gguf.path(), gguf_name, name));
        }
      }
    }
  }

  json hf_config = config.to_json();
  for (const auto& [field, key] : std::vector<std::pair<std::string, std::string>>{
           {"bos_token_id", "tokenizer.ggml.bos_token_id"},
           {"eos_token_id", "tokenizer.ggml.eos_token_id"},
           {"pad_token_id", "tokenizer.ggml.padding_token_id"}}) {
    if (gguf.metadata().contains(key)) hf_config[field] = metadata_int(gguf, key);
  }
  std::vector<std::string> written = checkpoint::write_hf(
      out_dir, plan,
      [&](size_t i) {
        const std::string& name = plan[i].name;
        torch::Tensor t = gguf.read(source.at(name));
        if (name.find("self_attn.q_proj.") != std::string::npos)
          return unpermute_rotary_rows(t, config.num_attention_heads);
        if (name.find("self_attn.k_proj.") != std::string::npos)
          return unpermute_rotary_rows(t, config.num_key_value_heads);
        return t;
      },
      hf_config, dtype);

  const std::string tokenizer_path = (fs::path(out_dir) / "tokenizer.json").string();
  tokenizer.save_tokenizer_json(tokenizer_path);
  written.push_back(tokenizer_path);
  json tokenizer_config = {
      {"tokenizer_class", "PreTrainedTokenizerFast"},
      {"bos_token", token_of(gguf, "tokenizer.ggml.bos_token_id")},
      {"eos_token", token_of(gguf, "tokenizer.ggml.eos_token_id")},
      {"pad_token", token_of(gguf, "tokenizer.ggml.padding_token_id")},
      {"unk_token", token_of(gguf, "tokenizer.ggml.unknown_token_id")},
      {"add_bos_token", gguf.metadata().value("tokenizer.ggml.add_bos_token", false)},
      {"model_max_length", config.max_position_embeddings}};
  if (gguf.metadata().contains("tokenizer.chat_template")) {
    tokenizer_config["chat_template"] = gguf.at("tokenizer.chat_template");
  }
  const std::string tokenizer_config_path = (fs::path(out_dir) / "tokenizer_config.json").string();
  checkpoint::write_file_durably(tokenizer_config_path, tokenizer_config.dump(2));
  written.push_back(tokenizer_config_path);

  json generation = {{"do_sample", false}};
  for (const char* field : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (hf_config.contains(field)) generation[field] = hf_config[field];
  }
  const std::string generation_path = (fs::path(out_dir) / "generation_config.json").string();
  checkpoint::write_file_durably(generation_path, generation.dump(2));
  written.push_back(generation_path);
  return written;
}

}  // namespace

// The files are written into a staging folder next to out_dir and moved in only once all are
// written: a tensor that cannot be read halfway through leaves out_dir as it was.
std::vector<std::string> import_gguf(const std::string& gguf_path, const std::string& out_dir,
                                     torch::ScalarType dtype) {
  const fs::path target(out_dir);
  const fs::path staging = target.string() + ".tmp-import";
  fs::remove_all(staging);
  std::vector<std::string> written;
  try {
    written = import_into(gguf_path, staging.string(), dtype);
  } catch (...) {
    fs::remove_all(staging);
    throw;
  }
  fs::create_directories(target);
  for (auto& path : written) {
    const fs::path moved = target / fs::path(path).filename();
    fs::rename(path, moved);
    path = moved.string();
  }
  fs::remove_all(staging);
  checkpoint::fsync_path(target.string());
  return written;
}

}  // namespace shardrl::convert
