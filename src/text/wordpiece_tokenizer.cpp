#include "shardrl/text/wordpiece_tokenizer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "text/generated/bert_unicode.h"
#include "text/utf8.h"

namespace shardrl::text {
namespace {

namespace bu = bert_unicode;

constexpr char32_t kHangulFirst = 0xAC00, kHangulLast = 0xD7A3;

// NFD of one character, appended: the table's full decomposition, or Hangul's arithmetic one.
void decompose(char32_t c, std::u32string& out) {
  if (c >= kHangulFirst && c <= kHangulLast) {
    const char32_t s = c - kHangulFirst;
    out += static_cast<char32_t>(0x1100 + s / 588);
    out += static_cast<char32_t>(0x1161 + (s % 588) / 28);
    if (s % 28) out += static_cast<char32_t>(0x11A7 + s % 28);
  } else if (const auto* m = bu::decomposition(c)) {
    out.append(m->to, m->length);
  } else {
    out += c;
  }
}

// tokenizers' strip_accents: NFD (decomposition, then each run of marks sorted by combining
// class, stably), then nonspacing marks dropped.
std::u32string strip_accents(const std::u32string& text) {
  std::u32string d;
  d.reserve(text.size());
  for (char32_t c : text) decompose(c, d);
  for (size_t i = 0; i < d.size();) {
    if (bu::combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i + 1;
    while (end < d.size() && bu::combining_class(d[end]) != 0) ++end;
    std::stable_sort(d.begin() + i, d.begin() + end, [](char32_t a, char32_t b) {
      return bu::combining_class(a) < bu::combining_class(b);
    });
    i = end;
  }
  std::u32string out;
  out.reserve(d.size());
  for (char32_t c : d) {
    if (!bu::is_nonspacing_mark(c)) out += c;
  }
  return out;
}

// A special token's name in tokenizer_config.json: a string, or (newer files) {"content": ...}.
void read_token(const nlohmann::json& config, const char* field, std::string& token,
                const std::string& path) {
  if (!config.contains(field) || config[field].is_null()) return;
  const auto& value = config[field];
  if (value.is_string()) {
    token = value.get<std::string>();
  } else if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    token = value["content"].get<std::string>();
  } else {
    throw std::invalid_argument(
        fmt::format("{}: field {} must be a token string, got {}", path, field, value.dump()));
  }
}

template <class T>
void read_option(const nlohmann::json& config, const char* field, T& value,
                 const std::string& path) {
  if (!config.contains(field) || config[field].is_null()) return;
  try {
    value = config[field].get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument(
        fmt::format("{}: field {} has the wrong type ({})", path, field, config[field].dump()));
  }
}

}  // namespace

struct WordPieceTokenizer::Impl {
  Options options;
  bool strip = true;
  std::vector<std::string> vocab;
  std::unordered_map<std::string, int64_t> ids;
  std::vector<std::pair<std::string, int64_t>> specials;  // matched whole in the raw text
  int64_t cls = 0, sep = 0, pad = 0, unk = 0;

  int64_t special_id(const std::string& token, const char* field) const {
    // An empty one would match everywhere in encode's scan for special tokens, without advancing.
    if (token.empty())
      throw std::invalid_argument(fmt::format("WordPiece: the {} is empty", field));
    auto it = ids.find(token);
    if (it == ids.end()) {
      throw std::invalid_argument(
          fmt::format("WordPiece: the {} '{}' is not in the vocabulary", field, token));
    }
    return it->second;
  }
  std::u32string normalize(const std::string& text, size_t begin, size_t end) const;
  void encode_word(const std::u32string& word, std::vector<int64_t>& out) const;
  void encode_text(const std::string& text, size_t begin, size_t end,
                   std::vector<int64_t>& out) const;
};

// clean_text, handle_chinese_chars, strip_accents and lowercase, in BertNormalizer's order.
std::u32string WordPieceTokenizer::Impl::normalize(const std::string& text, size_t begin,
                                                   size_t end) const {
  std::u32string chars;
  chars.reserve(end - begin);
  for (size_t i = begin; i < end;) {
    char32_t c = 0;
    i += detail::next_code_point(text, i, c);
    if (c == detail::kInvalid) continue;
    if (options.clean_text) {
      if (bu::is_removed(c)) continue;
      if (bu::is_clean_space(c)) c = U' ';
    }
    if (options.tokenize_chinese_chars && bu::is_chinese(c)) {
      chars += U' ';
      chars += c;
      chars += U' ';
    } else {
      chars += c;
    }
  }
  if (strip) chars = strip_accents(chars);
  if (!options.do_lower_case) return chars;
  std::u32string lowered;
  lowered.reserve(chars.size());
  for (char32_t c : chars) {
    if (const auto* m = bu::lowercase(c)) {
      lowered.append(m->to, m->length);
    } else {
      lowered += c;
    }
  }
  return lowered;
}

// Greedy longest-match-first: the longest vocabulary entry at the word's start, then the
// longest "##" entry at each following position; one [UNK] for the whole word when no entry fits
// somewhere or the word is too long.
void WordPieceTokenizer::Impl::encode_word(const std::u32string& word,
                                           std::vector<int64_t>& out) const {
  if (static_cast<int64_t>(word.size()) > options.max_input_chars_per_word) {
    out.push_back(unk);
    return;
  }
  std::string bytes;
  std::vector<size_t> offset;  // byte offset of each character, and of the end
  for (char32_t c : word) {
    offset.push_back(bytes.size());
    bytes += detail::utf8(c);
  }
  offset.push_back(bytes.size());
  const size_t first = out.size();
  std::string piece;
  for (size_t start = 0; start < word.size();) {
    size_t end = word.size();
    int64_t id = -1;
    for (; end > start; --end) {
      piece.assign(start > 0 ? "##" : "");
      piece.append(bytes, offset[start], offset[end] - offset[start]);
      auto it = ids.find(piece);
      if (it != ids.end()) {
        id = it->second;
        break;
      }
    }
    if (id < 0) {
      out.resize(first);
      out.push_back(unk);
      return;
    }
    out.push_back(id);
    start = end;
  }
}

// BertPreTokenizer: words end at white space (dropped) and at punctuation, each punctuation
// character a word of its own.
void WordPieceTokenizer::Impl::encode_text(const std::string& text, size_t begin, size_t end,
                                           std::vector<int64_t>& out) const {
  const std::u32string chars = normalize(text, begin, end);
  std::u32string word;
  for (char32_t c : chars) {
    const bool space = bu::is_split_space(c);
    if (space || bu::is_punctuation(c)) {
      if (!word.empty()) encode_word(word, out);
      word.clear();
      if (!space) encode_word(std::u32string(1, c), out);
    } else {
      word += c;
    }
  }
  if (!word.empty()) encode_word(word, out);
}

WordPieceTokenizer::WordPieceTokenizer(std::vector<std::string> vocab, Options options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.options = std::move(options);
  if (m.options.strip_accents < -1 || m.options.strip_accents > 1) {
    throw std::invalid_argument(
        fmt::format("WordPiece: strip_accents must be -1 (null), 0 or 1, "
                    "got {}",
                    m.options.strip_accents));
  }
  if (m.options.max_input_chars_per_word <= 0) {
    throw std::invalid_argument(
        fmt::format("WordPiece: max_input_chars_per_word must be positive, got {}",
                    m.options.max_input_chars_per_word));
  }
  m.strip = m.options.strip_accents < 0 ? m.options.do_lower_case : m.options.strip_accents == 1;
  m.vocab = std::move(vocab);
  for (size_t id = 0; id < m.vocab.size(); ++id) {
    auto [it, inserted] = m.ids.emplace(m.vocab[id], static_cast<int64_t>(id));
    if (!inserted) {
      throw std::invalid_argument(fmt::format("WordPiece: the token '{}' has two ids, {} and {}",
                                              m.vocab[id], it->second, id));
    }
  }
  m.unk = m.special_id(m.options.unk_token, "unk_token");
  m.cls = m.special_id(m.options.cls_token, "cls_token");
  m.sep = m.special_id(m.options.sep_token, "sep_token");
  m.pad = m.special_id(m.options.pad_token, "pad_token");
  const int64_t mask = m.special_id(m.options.mask_token, "mask_token");
  m.specials = {{m.options.pad_token, m.pad},
                {m.options.unk_token, m.unk},
                {m.options.cls_token, m.cls},
                {m.options.sep_token, m.sep},
                {m.options.mask_token, mask}};
  // The longest first, so the first that matches at a position is the longest there.
  std::stable_sort(m.specials.begin(), m.specials.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

WordPieceTokenizer WordPieceTokenizer::load(const std::string& dir) {
  const std::string vocab_path = dir + "/vocab.txt";
  if (!std::filesystem::is_regular_file(vocab_path)) {
    throw std::invalid_argument(fmt::format("WordPiece: {} is missing", vocab_path));
  }
  std::vector<std::string> vocab;
  std::istringstream lines(detail::read_file("WordPiece", vocab_path));
  for (std::string line; std::getline(lines, line);) {
    // tokenizers trims trailing white space (a Windows file's \r) off each line.
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
    vocab.push_back(std::move(line));
  }
  if (vocab.empty()) throw std::invalid_argument(fmt::format("WordPiece: {} is empty", vocab_path));

  Options options;
  const std::string config_path = dir + "/tokenizer_config.json";
  if (std::filesystem::exists(config_path)) {
    nlohmann::json config;
    try {
      config = nlohmann::json::parse(detail::read_file("WordPiece", config_path));
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(fmt::format("{}: not valid JSON: {}", config_path, e.what()));
    }
    read_option(config, "do_lower_case", options.do_lower_case, config_path);
    read_option(config, "tokenize_chinese_chars", options.tokenize_chinese_chars, config_path);
    if (config.contains("strip_accents") && !config["strip_accents"].is_null()) {
      bool strip = false;
      read_option(config, "strip_accents", strip, config_path);
      options.strip_accents = strip ? 1 : 0;
    }
    bool basic = true;
    read_option(config, "do_basic_tokenize", basic, config_path);
    if (!basic) {
      throw std::invalid_argument(fmt::format(
          "{}: do_basic_tokenize false is not supported (BertTokenizerFast ignores it too)",
          config_path));
    }
    read_token(config, "unk_token", options.unk_token, config_path);
    read_token(config, "sep_token", options.sep_token, config_path);
    read_token(config, "pad_token", options.pad_token, config_path);
    read_token(config, "cls_token", options.cls_token, config_path);
    read_token(config, "mask_token", options.mask_token, config_path);
  }
  try {
    return WordPieceTokenizer(std::move(vocab), std::move(options));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{} ({}): {}", vocab_path, config_path, e.what()));
  }
}

WordPieceTokenizer::~WordPieceTokenizer() = default;
WordPieceTokenizer::WordPieceTokenizer(WordPieceTokenizer&&) noexcept = default;
WordPieceTokenizer& WordPieceTokenizer::operator=(WordPieceTokenizer&&) noexcept = default;

std::vector<int64_t> WordPieceTokenizer::encode(const std::string& text) const {
  const auto& m = *impl_;
  std::vector<int64_t> out;
  size_t begin = 0;
  for (size_t i = 0; i < text.size();) {
    const auto match = std::find_if(m.specials.begin(), m.specials.end(), [&](const auto& s) {
      return text.compare(i, s.first.size(), s.first) == 0;
    });
    if (match == m.specials.end()) {
      ++i;
      continue;
    }
    m.encode_text(text, begin, i, out);
    out.push_back(match->second);
    i += match->first.size();
    begin = i;
  }
  m.encode_text(text, begin, text.size(), out);
  return out;
}

WordPieceTokenizer::Batch WordPieceTokenizer::encode_batch(const std::vector<std::string>& texts,
                                                           int64_t max_length,
                                                           int64_t pad_to) const {
  if (max_length < 2) {
    throw std::invalid_argument(fmt::format(
        "WordPiece: max_length must be at least 2 ([CLS] and [SEP]), got {}", max_length));
  }
  std::vector<std::vector<int64_t>> rows;
  int64_t longest = 0;
  for (const auto& text : texts) {
    auto pieces = encode(text);
    // One sentence, truncation longest_first: its pieces lose their tail.
    if (static_cast<int64_t>(pieces.size()) > max_length - 2) pieces.resize(max_length - 2);
    std::vector<int64_t> row = {impl_->cls};
    row.insert(row.end(), pieces.begin(), pieces.end());
    row.push_back(impl_->sep);
    longest = std::max(longest, static_cast<int64_t>(row.size()));
    rows.push_back(std::move(row));
  }
  const int64_t length = std::max(longest, pad_to);
  const auto batch = static_cast<int64_t>(rows.size());
  Batch out{torch::full({batch, length}, impl_->pad, torch::kLong),
            torch::zeros({batch, length}, torch::kLong)};
  auto ids = out.input_ids.accessor<int64_t, 2>();
  auto mask = out.attention_mask.accessor<int64_t, 2>();
  for (int64_t b = 0; b < batch; ++b) {
    for (size_t t = 0; t < rows[b].size(); ++t) {
      ids[b][t] = rows[b][t];
      mask[b][t] = 1;
    }
  }
  return out;
}

int64_t WordPieceTokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->vocab.size());
}

int64_t WordPieceTokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->ids.find(token);
  return it == impl_->ids.end() ? -1 : it->second;
}

const std::string& WordPieceTokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= vocab_size()) {
    throw std::out_of_range(
        fmt::format("WordPiece: id {} is outside the vocabulary of {}", id, vocab_size()));
  }
  return impl_->vocab[id];
}

int64_t WordPieceTokenizer::cls_id() const {
  return impl_->cls;
}
int64_t WordPieceTokenizer::sep_id() const {
  return impl_->sep;
}
int64_t WordPieceTokenizer::pad_id() const {
  return impl_->pad;
}
int64_t WordPieceTokenizer::unk_id() const {
  return impl_->unk;
}
const WordPieceTokenizer::Options& WordPieceTokenizer::options() const {
  return impl_->options;
}

}  // namespace shardrl::text
