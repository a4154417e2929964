// Byte-level BPE tokenizers: GPT-2's (its published encoder.json / vocab.bpe, shipped in
// data/gpt2-bpe/) and any Hugging Face tokenizer.json of that kind (SmolLM2, GPT-2, ...), plus
// the ones `shardrl import` rebuilds from a GGUF's metadata.
//
// encode() gives Hugging Face tokenizers' ids: added tokens ("<|im_end|>") are cut out of the text
// first, leftmost and longest match first; the text between them is split by GPT-2's
// pre-tokenisation regex ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|
// \s+) with the Unicode classes of JavaScript's regex engine, each piece's UTF-8 bytes are mapped
// to printable characters (bytes_to_unicode) and merged pair by pair, lowest merge rank first.
// No BOS or EOS is added. decode(encode(s)) == s for every byte string without added tokens in
// it, valid UTF-8 or not, when the vocabulary holds all 256 byte characters (byte-level
// vocabularies do); a byte it lacks is dropped, as tokenizers drops it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardrl::text {

class ByteLevelBpeTokenizer {
 public:
  // A token matched whole in the text before the BPE split (tokenizers' "added_tokens").
  struct AddedToken {
    int64_t id = 0;
    std::string content;
    bool special = false;  // decode(..., skip_special_tokens=true) leaves it out
  };

  // GPT-2's files: `dir`/encoder.json and `dir`/vocab.bpe, no added tokens (as GPT-2's own
  // encoder: "<|endoftext|>" in the text is text). A missing or malformed file is an error naming
  // it (and the line or entry at fault).
  static ByteLevelBpeTokenizer load(const std::string& dir);
  ByteLevelBpeTokenizer(const std::string& encoder_json_path, const std::string& vocab_bpe_path);
  // `tokens` in id order (byte-level characters, as tokenizer.json's vocab holds them), merges
  // by rank, added tokens by id. Duplicate tokens, a merge of or into a token not in `tokens`, or
  // an added token whose id names another token, are std::invalid_argument.
  static ByteLevelBpeTokenizer from_vocab(std::vector<std::string> tokens,
                                          std::vector<std::pair<std::string, std::string>> merges,
                                          std::vector<AddedToken> added);
  // A Hugging Face tokenizer.json with a BPE model, a ByteLevel pre-tokenizer (GPT-2's regex, no
  // prefix space) and no normalizer. Anything else is an error naming the file and the field.
  static ByteLevelBpeTokenizer load_tokenizer_json(const std::string& path);
  // Writes a tokenizer.json that Hugging Face tokenizers / transformers load as this tokenizer.
  void save_tokenizer_json(const std::string& path) const;

  ~ByteLevelBpeTokenizer();
  ByteLevelBpeTokenizer(ByteLevelBpeTokenizer&&) noexcept;
  ByteLevelBpeTokenizer& operator=(ByteLevelBpeTokenizer&&) noexcept;

  // Thread-safe: the BPE cache is guarded. Invalid UTF-8 bytes are taken one at a time, as
  // non-letter, non-number characters, so every byte string encodes and round-trips.
  std::vector<int64_t> encode(const std::string& text) const;
  // Ids outside the vocabulary are an error naming the id and its position.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;
  int64_t token_to_id(const std::string& token) const;  // -1 when absent
  const std::vector<AddedToken>& added_tokens() const;

  // The pieces the pre-tokenisation regex splits `text` into (before byte mapping and BPE).
  static std::vector<std::string> pretokenize(const std::string& text);

 private:
  ByteLevelBpeTokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardrl::text
