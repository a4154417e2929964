// BERT's WordPiece tokenizer, as Hugging Face's BertTokenizerFast (tokenizers' BertNormalizer,
// BertPreTokenizer and WordPiece model) reads a vocab.txt and tokenizer_config.json.
//
// encode() gives tokenizers' ids: the special tokens ([CLS], [MASK], ...) written in the text are
// cut out first, as tokenizers' added tokens (exact, leftmost and longest match first); the text
// between them is cleaned (control characters dropped, white space made ' '), CJK ideographs get
// spaces around them, accents are stripped (NFD, then nonspacing marks dropped) and the text
// lowercased, as tokenizer_config.json says; it is split at white space and around each
// punctuation character; each word becomes its longest vocabulary prefix, then "##"-continuations,
// greedily, or one [UNK] when a piece of it is in no entry or it has more than
// max_input_chars_per_word characters. Bytes that are not valid UTF-8 are dropped (clean_text
// drops U+FFFD too).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardrl::text {

class WordPieceTokenizer {
 public:
  // tokenizer_config.json's fields, with BertTokenizer's defaults.
  struct Options {
    bool do_lower_case = true;
    int strip_accents = -1;  // JSON null (-1): as do_lower_case; else 0 or 1
    bool tokenize_chinese_chars = true;
    bool clean_text = true;
    int64_t max_input_chars_per_word = 100;
    std::string unk_token = "[UNK]", sep_token = "[SEP]", pad_token = "[PAD]", cls_token = "[CLS]",
                mask_token = "[MASK]";
  };

  // `dir`/vocab.txt (one token a line, the line number its id) and, when present,
  // `dir`/tokenizer_config.json. A missing vocab.txt, a special token not in it, a duplicate token
  // or an option this tokenizer does not implement (do_basic_tokenize: false) is an error naming
  // the file and the field or line.
  static WordPieceTokenizer load(const std::string& dir);
  // Duplicate tokens, or special tokens not among them, are std::invalid_argument.
  WordPieceTokenizer(std::vector<std::string> vocab, Options options);

  ~WordPieceTokenizer();
  WordPieceTokenizer(WordPieceTokenizer&&) noexcept;
  WordPieceTokenizer& operator=(WordPieceTokenizer&&) noexcept;

  // The word pieces of `text`, without [CLS] / [SEP]. Thread-safe.
  std::vector<int64_t> encode(const std::string& text) const;

  // A batch as BertTokenizerFast(texts, padding=True, truncation=True, max_length=max_length)
  // gives it: each row [CLS] pieces [SEP], its pieces cut to max_length - 2, right-padded with
  // [PAD] to the longest row (or to pad_to, when larger: a fixed length). Both [B, L] int64;
  // attention_mask is 1 on a token and 0 on padding. token_type_ids are all 0 for one sentence.
  struct Batch {
    torch::Tensor input_ids, attention_mask;
  };
  Batch encode_batch(const std::vector<std::string>& texts, int64_t max_length,
                     int64_t pad_to = 0) const;

  int64_t vocab_size() const;
  int64_t token_to_id(const std::string& token) const;  // -1 when absent
  const std::string& id_to_token(int64_t id) const;     // out of range: std::out_of_range
  int64_t cls_id() const;
  int64_t sep_id() const;
  int64_t pad_id() const;
  int64_t unk_id() const;
  const Options& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardrl::text
