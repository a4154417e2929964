// A frozen sentence-transformers text encoder in C++: a BERT (Hugging Face transformers'
// BertModel, its tensor names and config.json) behind its WordPiece tokenizer, mean pooling and
// the optional Normalize module, as sentence-transformers' all-MiniLM-L6-v2 folder lays them out.
// It conditions the diffusion models: per-token hidden states are their `prompt_embeds`, the
// pooled embedding their pooled text input, and the empty prompt CFG's unconditional branch.
// Forward-only, in fp32, without autograd.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "shardrl/text/wordpiece_tokenizer.h"

namespace shardrl::models {

// config.json of a BertModel; field names are transformers'.
struct BertConfig {
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  double layer_norm_eps = 1e-12;
  std::string hidden_act = "gelu";                   // erf GELU; the only one supported
  std::string position_embedding_type = "absolute";  // the only one supported

  // Required fields missing, wrong types and unsupported values are errors naming the field.
  static BertConfig from_json(const nlohmann::json& j);
  static BertConfig load(const std::string& config_json_path);
};

// One batch of prompts, encoded.
struct TextEncoding {
  // [B, L, hidden] float: the last hidden state of each token, transformers' last_hidden_state.
  // A padding position holds the encoder's output there too; it depends only on its row's prompt
  // and its position, never on the rest of the batch.
  torch::Tensor prompt_embeds;
  torch::Tensor
      attention_mask;  // [B, L] int64: 1 on a token ([CLS] and [SEP] included), 0 on padding
  // [B, hidden] float: the mean over each row's tokens, unit length when the model normalizes:
  // sentence-transformers' encode().
  torch::Tensor pooled;
};

class TextEncoder {
 public:
  // A sentence-transformers folder: modules.json (a Transformer, a mean Pooling, optionally a
  // Normalize), sentence_bert_config.json (max_seq_length), the Pooling's config.json, and the
  // BERT's config.json, model.safetensors, vocab.txt and tokenizer_config.json. A missing file,
  // a module or pooling mode other than these, and a missing, unexpected or misshapen tensor are
  // errors naming the file (and the tensor or field).
  static TextEncoder load(const std::string& dir);

  // Tokenizes (text::WordPieceTokenizer::encode_batch, truncated to max_seq_length) and encodes.
  // pad_to > 0 pads every row to that length (at least the longest row): a fixed text length.
  TextEncoding encode(const std::vector<std::string>& prompts, int64_t pad_to = 0) const;
  // The same from token ids: input_ids and attention_mask [B, L] int64.
  TextEncoding encode_ids(const torch::Tensor& input_ids,
                          const torch::Tensor& attention_mask) const;

  const text::WordPieceTokenizer& tokenizer() const;
  const BertConfig& config() const;
  int64_t max_seq_length() const;
  bool normalizes() const;  // modules.json has a Normalize
  const std::string& dir() const;
  // Identifies what encode() computes: a hash of the weights file, the tokenizer's and the
  // model's configuration (16 hex digits). A changed model or vocabulary changes it.
  const std::string& fingerprint() const;

 private:
  TextEncoder() = default;
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// The embeddings of a prompt set, encoded once and kept in a safetensors file next to the run
// (prompt_embeds, attention_mask and pooled, as encode gives them, and the key in its metadata).
// The key hashes the prompts, pad_to and the encoder's fingerprint: a file written for other
// prompts or another model is encoded anew and replaced (atomically); one with the same key is
// read back, bit for bit what encode gave. A damaged file is an error naming it.
struct CachedEncoding {
  TextEncoding encoding;
  bool from_cache = false;  // read back, not encoded
};
CachedEncoding encode_cached(const TextEncoder& encoder, const std::vector<std::string>& prompts,
                             const std::string& cache_path, int64_t pad_to = 0);

}  // namespace shardrl::models
