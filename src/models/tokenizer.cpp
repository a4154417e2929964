#include "shardrl/models/tokenizer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "models/unicode_classes.h"

namespace shardrl::models {
namespace {

// Stands for a byte that is not valid UTF-8: a character of no class.
constexpr char32_t kInvalid = 0xFFFFFFFF;

std::string utf8(char32_t c) {
  std::string out;
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
  return out;
}

// Decodes the code point at s[i]; returns its length in bytes. A malformed, overlong or
// surrogate sequence decodes as kInvalid of length 1.
size_t next_code_point(const std::string& s, size_t i, char32_t& c) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  size_t len = 0;
  char32_t min = 0;
  if (b0 < 0x80) {
    c = b0;
    return 1;
  } else if ((b0 & 0xE0) == 0xC0) {
    len = 2, c = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, c = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, c = b0 & 0x07, min = 0x10000;
  } else {
    c = kInvalid;
    return 1;
  }
  if (i + len > s.size()) {
    c = kInvalid;
    return 1;
  }
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) {
      c = kInvalid;
      return 1;
    }
    c = (c << 6) | (byte(i + k) & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
    c = kInvalid;
    return 1;
  }
  return len;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

CharClass classify(char32_t c) {
  if (c == kInvalid) return CharClass::kOther;
  if (unicode::is_letter(c)) return CharClass::kLetter;
  if (unicode::is_number(c)) return CharClass::kNumber;
  if (unicode::is_space(c)) return CharClass::kSpace;
  return CharClass::kOther;
}

struct Char {
  char32_t code;
  CharClass cls;
  size_t byte_offset;
};

// Length (in characters) of the regex alternative that matches at `i`, tried in the pattern's
// order: 's|'t|'re|'ve|'m|'ll|'d, then ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` (the three
// classes are disjoint, so the character after the optional space picks one), then
// `\s+(?!\S)` and `\s+`.
size_t match_length(const std::vector<Char>& chars, size_t i) {
  const size_t n = chars.size();
  const auto is = [&](size_t k, char32_t c) { return k < n && chars[k].code == c; };
  if (is(i, U'\'')) {
    if (is(i + 1, U's') || is(i + 1, U't') || is(i + 1, U'm') || is(i + 1, U'd')) return 2;
    if ((is(i + 1, U'r') && is(i + 2, U'e')) || (is(i + 1, U'v') && is(i + 2, U'e')) ||
        (is(i + 1, U'l') && is(i + 2, U'l'))) {
      return 3;
    }
  }
  const size_t start =
      is(i, U' ') && i + 1 < n && chars[i + 1].cls != CharClass::kSpace ? i + 1 : i;
  const CharClass cls = chars[start].cls;
  size_t end = start + 1;
  while (end < n && chars[end].cls == cls) ++end;
  if (cls != CharClass::kSpace) return end - i;
  // A whitespace run: all of it at the end of the text; else all but its last character, which
  // then starts the next piece (" word"); a single one before a non-space stands alone.
  if (end == n) return end - i;
  return end - i >= 2 ? end - i - 1 : 1;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256, 257, ...
std::array<char32_t, 256> byte_to_code_point() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    map[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("Gpt2Tokenizer: cannot read '{}'", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace

struct Gpt2Tokenizer::Impl {
  std::unordered_map<std::string, int64_t> encoder;
  std::vector<std::string> decoder;                      // id -> token
  std::unordered_map<std::string, int64_t> merge_ranks;  // "first second" -> rank
  std::array<std::string, 256> byte_encoder;             // byte -> token character (UTF-8)
  std::unordered_map<char32_t, unsigned char> byte_decoder;
  int64_t eos = -1;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;

  std::vector<int64_t> bpe(const std::string& piece) const;
};

std::vector<int64_t> Gpt2Tokenizer::Impl::bpe(const std::string& piece) const {
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto hit = cache.find(piece);
    if (hit != cache.end()) return hit->second;
  }
  std::vector<std::string> word;
  for (unsigned char b : piece) word.push_back(byte_encoder[b]);
  while (word.size() > 1) {
    int64_t best = std::numeric_limits<int64_t>::max();
    size_t at = 0;
    for (size_t k = 0; k + 1 < word.size(); ++k) {
      auto it = merge_ranks.find(word[k] + ' ' + word[k + 1]);
      if (it != merge_ranks.end() && it->second < best) best = it->second, at = k;
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    // Merge every occurrence of the best pair, left to right.
    const std::string first = word[at], second = word[at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < word.size(); ++k) {
      if (k + 1 < word.size() && word[k] == first && word[k + 1] == second) {
        merged.push_back(first + second);
        ++k;
      } else {
        merged.push_back(word[k]);
      }
    }
    word = std::move(merged);
  }
  std::vector<int64_t> ids;
  for (const auto& token : word) {
    auto it = encoder.find(token);
    if (it == encoder.end()) {
      throw std::runtime_error(
          fmt::format("Gpt2Tokenizer: merged token '{}' is not in encoder.json", token));
    }
    ids.push_back(it->second);
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  cache.emplace(piece, ids);
  return ids;
}

Gpt2Tokenizer Gpt2Tokenizer::load(const std::string& dir) {
  return Gpt2Tokenizer(dir + "/encoder.json", dir + "/vocab.bpe");
}

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& encoder_json_path,
                             const std::string& vocab_bpe_path)
    : impl_(std::make_unique<Impl>()) {
  nlohmann::json entries;
  try {
    entries = nlohmann::json::parse(read_file(encoder_json_path));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(
        fmt::format("Gpt2Tokenizer: '{}' is not valid JSON: {}", encoder_json_path, e.what()));
  }
  if (!entries.is_object() || entries.empty()) {
    throw std::runtime_error(
        fmt::format("Gpt2Tokenizer: '{}' must be a JSON object of token -> id", encoder_json_path));
  }
  impl_->decoder.resize(entries.size());
  for (const auto& [token, id] : entries.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() >= static_cast<int64_t>(entries.size())) {
      throw std::runtime_error(
          fmt::format("Gpt2Tokenizer: '{}': entry '{}' has id {}, expected an integer in [0, {})",
                      encoder_json_path, token, id.dump(), entries.size()));
    }
    impl_->encoder.emplace(token, id.get<int64_t>());
    impl_->decoder[id.get<int64_t>()] = token;
  }
  auto eos = impl_->encoder.find("<|endoftext|>");
  if (eos == impl_->encoder.end()) {
    throw std::runtime_error(
        fmt::format("Gpt2Tokenizer: '{}' has no '<|endoftext|>' entry", encoder_json_path));
  }
  impl_->eos = eos->second;

  std::istringstream lines(read_file(vocab_bpe_path));
  std::string line;
  int64_t line_number = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    if (line_number == 1 && line.rfind("#version", 0) == 0) continue;
    std::istringstream fields(line);
    std::string first, second, extra;
    fields >> first >> second;
    if (first.empty()) continue;
    if (second.empty() || (fields >> extra)) {
      throw std::runtime_error(fmt::format("Gpt2Tokenizer: '{}' line {}: expected two tokens",
                                           vocab_bpe_path, line_number));
    }
    impl_->merge_ranks.emplace(first + ' ' + second,
                               static_cast<int64_t>(impl_->merge_ranks.size()));
  }

  const auto code_points = byte_to_code_point();
  for (int b = 0; b < 256; ++b) {
    impl_->byte_encoder[b] = utf8(code_points[b]);
    impl_->byte_decoder[code_points[b]] = static_cast<unsigned char>(b);
  }
}

Gpt2Tokenizer::~Gpt2Tokenizer() = default;
Gpt2Tokenizer::Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept = default;
Gpt2Tokenizer& Gpt2Tokenizer::operator=(Gpt2Tokenizer&&) noexcept = default;

std::vector<std::string> Gpt2Tokenizer::pretokenize(const std::string& text) {
  std::vector<Char> chars;
  for (size_t i = 0; i < text.size();) {
    char32_t code;
    const size_t len = next_code_point(text, i, code);
    chars.push_back({code, classify(code), i});
    i += len;
  }
  std::vector<std::string> pieces;
  for (size_t i = 0; i < chars.size();) {
    const size_t end = i + match_length(chars, i);
    const size_t from = chars[i].byte_offset;
    const size_t to = end < chars.size() ? chars[end].byte_offset : text.size();
    pieces.push_back(text.substr(from, to - from));
    i = end;
  }
  return pieces;
}

std::vector<int64_t> Gpt2Tokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  for (const auto& piece : pretokenize(text)) {
    auto piece_ids = impl_->bpe(piece);
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
  }
  return ids;
}

std::string Gpt2Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string bytes;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0 || ids[k] >= vocab_size()) {
      throw std::out_of_range(
          fmt::format("Gpt2Tokenizer::decode: id {} at position {} is outside "
                      "the vocabulary [0, {})",
                      ids[k], k, vocab_size()));
    }
    const std::string& token = impl_->decoder[ids[k]];
    for (size_t i = 0; i < token.size();) {
      char32_t code;
      i += next_code_point(token, i, code);
      auto it = impl_->byte_decoder.find(code);
      // encoder.json's tokens are made of byte characters only; guard against a foreign file.
      if (it == impl_->byte_decoder.end()) {
        throw std::runtime_error(fmt::format(
            "Gpt2Tokenizer::decode: token {} ('{}') is not byte-level BPE", ids[k], token));
      }
      bytes += static_cast<char>(it->second);
    }
  }
  return bytes;
}

int64_t Gpt2Tokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->decoder.size());
}

int64_t Gpt2Tokenizer::eos_token_id() const {
  return impl_->eos;
}

}  // namespace shardrl::models
