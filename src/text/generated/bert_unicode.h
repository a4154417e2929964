// Per-character tables of BERT's WordPiece pipeline as Hugging Face tokenizers implements it
// (BertNormalizer, BertPreTokenizer), generated from tokenizers itself by
// scripts/gen-bert-unicode.py: its classes mix Unicode versions, so no single Unicode database
// gives them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace shardrl::text::bert_unicode {

// clean_text drops it: NUL, U+FFFD and "other" characters (control, format, private use,
// unassigned in the reference's Unicode version) except \t \n \r.
bool is_removed(char32_t c);
// clean_text turns it into ' ' (\t \n \r and Unicode white space).
bool is_clean_space(char32_t c);
// handle_chinese_chars puts spaces around it (the CJK ideograph blocks).
bool is_chinese(char32_t c);
// strip_accents drops it after NFD (category Mn, in the reference's Unicode version).
bool is_nonspacing_mark(char32_t c);
// BertPreTokenizer splits at it and drops it.
bool is_split_space(char32_t c);
// BertPreTokenizer makes it a word of its own.
bool is_punctuation(char32_t c);

// Canonical combining class (0 for most characters), which orders marks in NFD.
uint8_t combining_class(char32_t c);

// A character's replacement: its full canonical decomposition, or its lowercase.
struct Mapping {
  char32_t from;
  uint8_t length;
  char32_t to[4];
};
struct CombiningRange {
  char32_t first, last;  // inclusive
  uint8_t value;
};
// Null when the character maps to itself. Hangul syllables are not in the table: NFD splits them
// arithmetically (hangul_decomposition).
const Mapping* decomposition(char32_t c);
const Mapping* lowercase(char32_t c);

template <size_t N>
const Mapping* find_mapping(const Mapping (&table)[N], char32_t c) {
  auto it = std::lower_bound(std::begin(table), std::end(table), c,
                             [](const Mapping& m, char32_t v) { return m.from < v; });
  return it != std::end(table) && it->from == c ? &*it : nullptr;
}

}  // namespace shardrl::text::bert_unicode
