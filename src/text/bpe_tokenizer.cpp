#include "shardrl/text/bpe_tokenizer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "checkpoint/io.h"
#include "text/generated/unicode_classes.h"
#include "text/utf8.h"

namespace shardrl::text {
namespace {

using detail::kInvalid;
using detail::next_code_point;
using detail::utf8;

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

// Keeps the BPE cache of a long-running process bounded (tokenizers caps its at 10,000 words).
constexpr size_t kMaxCachedWords = 100000;

}  // namespace

struct ByteLevelBpeTokenizer::Impl {
  std::unordered_map<std::string, int64_t> encoder;  // BPE model token -> id
  std::vector<std::string> decoder;                  // id -> token (added tokens: their content)
  std::vector<std::pair<std::string, std::string>> merges;
  std::unordered_map<std::string, int64_t> merge_ranks;  // "first second" -> rank
  bool ignore_merges = false;  // tokenizers' BPE option: a piece in the vocabulary is one token
  std::vector<AddedToken> added;
  std::vector<bool> added_normalized;               // tokenizers matches these after the others
  std::unordered_map<int64_t, size_t> added_index;  // id -> index into `added`
  std::array<std::string, 256> byte_encoder;        // byte -> token character (UTF-8)
  std::unordered_map<char32_t, unsigned char> byte_decoder;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;

  void init(std::vector<std::string> tokens, std::vector<std::pair<std::string, std::string>> m,
            std::vector<AddedToken> a, std::vector<bool> normalized);
  std::vector<int64_t> bpe(const std::string& piece) const;
  void encode_text(const std::string& text, std::vector<int64_t>& ids) const;
  void encode_added(const std::string& text, size_t pass, std::vector<int64_t>& ids) const;
};

// `tokens` may hold "" for ids that only an added token fills.
void ByteLevelBpeTokenizer::Impl::init(std::vector<std::string> tokens,
                                       std::vector<std::pair<std::string, std::string>> m,
                                       std::vector<AddedToken> a, std::vector<bool> normalized) {
  // Ids are dense, so no added token's id reaches the count of all tokens.
  const size_t total = tokens.size() + a.size();
  for (const auto& token : a) {
    if (token.id < 0 || token.id >= static_cast<int64_t>(total)) {
      throw std::invalid_argument(
          fmt::format("added token '{}' has id {}, outside [0, {}) (the count of all tokens)",
                      token.content, token.id, total));
    }
    if (token.content.empty()) {
      throw std::invalid_argument(fmt::format("added token {} is empty", token.id));
    }
    if (token.id >= static_cast<int64_t>(tokens.size())) tokens.resize(token.id + 1);
    if (!tokens[token.id].empty() && tokens[token.id] != token.content) {
      throw std::invalid_argument(fmt::format("added token '{}' has id {}, which is the token '{}'",
                                              token.content, token.id, tokens[token.id]));
    }
    if (!added_index.emplace(token.id, added_index.size()).second) {
      throw std::invalid_argument(fmt::format("two added tokens have id {}", token.id));
    }
  }
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (tokens[id].empty()) {
      if (added_index.count(static_cast<int64_t>(id))) continue;
      throw std::invalid_argument(fmt::format("no token has id {}", id));
    }
    auto [it, inserted] = encoder.emplace(tokens[id], static_cast<int64_t>(id));
    if (!inserted) {
      throw std::invalid_argument(
          fmt::format("the token '{}' has two ids, {} and {}", tokens[id], it->second, id));
    }
  }
  decoder = std::move(tokens);
  for (const auto& token : a) decoder[token.id] = token.content;
  // As tokenizers' BPE: a merge of tokens the vocabulary lacks, or into one, is refused (bpe()
  // then finds every merged token).
  for (size_t k = 0; k < m.size(); ++k) {
    const auto& [first, second] = m[k];
    for (const std::string& token : {first, second, first + second}) {
      if (!encoder.count(token)) {
        throw std::invalid_argument(fmt::format(
            "merges[{}] ('{}', '{}'): '{}' is not in the vocabulary", k, first, second, token));
      }
    }
    merge_ranks.emplace(first + ' ' + second, static_cast<int64_t>(merge_ranks.size()));
  }
  merges = std::move(m);
  added = std::move(a);
  added_normalized = std::move(normalized);
  added_normalized.resize(added.size(), false);

  const auto code_points = byte_to_code_point();
  for (int b = 0; b < 256; ++b) {
    byte_encoder[b] = utf8(code_points[b]);
    byte_decoder[code_points[b]] = static_cast<unsigned char>(b);
  }
}

std::vector<int64_t> ByteLevelBpeTokenizer::Impl::bpe(const std::string& piece) const {
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto hit = cache.find(piece);
    if (hit != cache.end()) return hit->second;
  }
  if (ignore_merges) {
    std::string whole;
    for (unsigned char b : piece) whole += byte_encoder[b];
    auto it = encoder.find(whole);
    if (it != encoder.end()) return {it->second};
  }
  // A byte whose character the vocabulary lacks is dropped, as tokenizers drops it (with no
  // unk_token); the rest merge across the gap.
  std::vector<std::string> word;
  for (unsigned char b : piece) {
    if (encoder.count(byte_encoder[b])) word.push_back(byte_encoder[b]);
  }
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
          fmt::format("tokenizer: merged token '{}' is not in the vocabulary", token));
    }
    ids.push_back(it->second);
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kMaxCachedWords) cache.clear();
  cache.emplace(piece, ids);
  return ids;
}

void ByteLevelBpeTokenizer::Impl::encode_text(const std::string& text,
                                              std::vector<int64_t>& ids) const {
  for (const auto& piece : pretokenize(text)) {
    auto piece_ids = bpe(piece);
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
  }
}

// tokenizers' AddedVocabulary: the tokens matched on the raw text (normalized: false) split it
// first (pass 0), then the normalized ones split what is left (pass 1; with no normalizer the
// text is the same). Within a pass the leftmost match wins, the longest at that position.
void ByteLevelBpeTokenizer::Impl::encode_added(const std::string& text, size_t pass,
                                               std::vector<int64_t>& ids) const {
  if (pass == 2) return encode_text(text, ids);
  size_t from = 0;
  // Each token's next match at or after `from`, found again only once `from` passes it: a scan
  // of the text per token rather than per match.
  std::vector<size_t> next(added.size(), 0);
  std::vector<bool> searched(added.size(), false);
  while (from < text.size()) {
    size_t best_at = std::string::npos, best = 0;
    for (size_t k = 0; k < added.size(); ++k) {
      if (added_normalized[k] != (pass == 1)) continue;
      if (!searched[k] || (next[k] != std::string::npos && next[k] < from)) {
        next[k] = text.find(added[k].content, from);
        searched[k] = true;
      }
      const size_t at = next[k];
      if (at == std::string::npos) continue;
      if (at < best_at || (at == best_at && added[k].content.size() > added[best].content.size())) {
        best_at = at, best = k;
      }
    }
    if (best_at == std::string::npos) break;
    encode_added(text.substr(from, best_at - from), pass + 1, ids);
    ids.push_back(added[best].id);
    from = best_at + added[best].content.size();
  }
  encode_added(text.substr(from), pass + 1, ids);
}

ByteLevelBpeTokenizer::ByteLevelBpeTokenizer() : impl_(std::make_unique<Impl>()) {}

ByteLevelBpeTokenizer ByteLevelBpeTokenizer::load(const std::string& dir) {
  return ByteLevelBpeTokenizer(dir + "/encoder.json", dir + "/vocab.bpe");
}

ByteLevelBpeTokenizer::ByteLevelBpeTokenizer(const std::string& encoder_json_path,
                                             const std::string& vocab_bpe_path)
    : impl_(std::make_unique<Impl>()) {
  nlohmann::json entries;
  try {
    entries = nlohmann::json::parse(detail::read_file("tokenizer", encoder_json_path));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(
        fmt::format("tokenizer: '{}' is not valid JSON: {}", encoder_json_path, e.what()));
  }
  if (!entries.is_object() || entries.empty()) {
    throw std::runtime_error(
        fmt::format("tokenizer: '{}' must be a JSON object of token -> id", encoder_json_path));
  }
  std::vector<std::string> tokens(entries.size());
  for (const auto& [token, id] : entries.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() >= static_cast<int64_t>(entries.size()) || token.empty()) {
      throw std::runtime_error(
          fmt::format("tokenizer: '{}': entry '{}' has id {}, expected an integer in [0, {})",
                      encoder_json_path, token, id.dump(), entries.size()));
    }
    tokens[id.get<int64_t>()] = token;
  }

  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream lines(detail::read_file("tokenizer", vocab_bpe_path));
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
      throw std::runtime_error(
          fmt::format("tokenizer: '{}' line {}: expected two tokens", vocab_bpe_path, line_number));
    }
    merges.emplace_back(first, second);
  }
  try {
    impl_->init(std::move(tokens), std::move(merges), {}, {});
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(fmt::format("tokenizer: '{}': {}", encoder_json_path, e.what()));
  }
}

ByteLevelBpeTokenizer ByteLevelBpeTokenizer::from_vocab(
    std::vector<std::string> tokens, std::vector<std::pair<std::string, std::string>> merges,
    std::vector<AddedToken> added) {
  ByteLevelBpeTokenizer tokenizer;
  tokenizer.impl_->init(std::move(tokens), std::move(merges), std::move(added), {});
  return tokenizer;
}

namespace {

using json = nlohmann::json;

// tokenizer.json fields ShardRL's encode does not implement must hold their neutral value.
void require_field(const json& object, const std::string& key, const json& neutral,
                   const std::string& where, const std::string& path) {
  if (!object.contains(key) || object[key] == neutral) return;
  if (neutral.is_null() && object[key].is_string() && object[key].get<std::string>().empty()) {
    return;
  }
  throw std::invalid_argument(
      fmt::format("tokenizer: '{}': {}.{} is {}; ShardRL's byte-level BPE implements only {}", path,
                  where, key, object[key].dump(), neutral.dump()));
}

// object.key when present and not null, else `fallback`; a value of another type than the
// fallback's is an error naming the field (nlohmann's value() would throw its own type_error).
template <class T>
T optional_field(const json& object, const std::string& key, T fallback, const std::string& where,
                 const std::string& path) {
  if (!object.is_object() || !object.contains(key) || object[key].is_null()) return fallback;
  const json& value = object[key];
  if constexpr (std::is_same_v<T, bool>) {
    if (value.is_boolean()) return value.get<bool>();
  } else {
    if (value.is_string()) return value.get<std::string>();
  }
  throw std::invalid_argument(fmt::format("tokenizer: '{}': {}{} is {}, expected a {}", path, where,
                                          key, value.dump(),
                                          std::is_same_v<T, bool> ? "boolean" : "string"));
}

void require_byte_level_pre_tokenizer(const json& pre, const std::string& path) {
  const std::string type = optional_field<std::string>(pre, "type", "", "pre_tokenizer.", path);
  if (type == "Sequence" && pre.contains("pretokenizers") && pre["pretokenizers"].is_array() &&
      pre["pretokenizers"].size() == 1) {
    return require_byte_level_pre_tokenizer(pre["pretokenizers"][0], path);
  }
  if (!pre.is_object() || type != "ByteLevel") {
    throw std::invalid_argument(fmt::format(
        "tokenizer: '{}': pre_tokenizer is {}; ShardRL reads the ByteLevel pre-tokenizer "
        "(GPT-2's regex)",
        path, pre.dump()));
  }
  require_field(pre, "add_prefix_space", false, "pre_tokenizer", path);
  require_field(pre, "use_regex", true, "pre_tokenizer", path);
}

// ByteLevel only trims offsets; transformers' GGUF conversion writes a TemplateProcessing whose
// single-sequence template is the sequence alone. Either leaves encode's ids as they are.
bool adds_no_tokens(const json& post, const std::string& path) {
  if (post.is_null()) return true;
  if (!post.is_object()) return false;
  const auto type = optional_field<std::string>(post, "type", "", "post_processor.", path);
  if (type == "ByteLevel") return true;
  if (type != "TemplateProcessing" || !post.contains("single") || !post["single"].is_array()) {
    return false;
  }
  return std::all_of(post["single"].begin(), post["single"].end(),
                     [](const json& piece) { return piece.contains("Sequence"); });
}

}  // namespace

ByteLevelBpeTokenizer ByteLevelBpeTokenizer::load_tokenizer_json(const std::string& path) {
  json file;
  try {
    file = json::parse(detail::read_file("tokenizer", path));
  } catch (const json::exception& e) {
    throw std::invalid_argument(
        fmt::format("tokenizer: '{}' is not valid JSON: {}", path, e.what()));
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(e.what());
  }
  const auto field = [&](const json& object, const std::string& key, const std::string& where,
                         json::value_t type) -> const json& {
    if (!object.is_object() || !object.contains(key) || object[key].type() != type) {
      throw std::invalid_argument(
          fmt::format("tokenizer: '{}': {}{} is missing or of the wrong type", path, where, key));
    }
    return object[key];
  };
  const json& model = field(file, "model", "", json::value_t::object);
  const auto type = optional_field<std::string>(model, "type", "BPE", "model.", path);
  if (type != "BPE") {
    throw std::invalid_argument(
        fmt::format("tokenizer: '{}': model.type is '{}'; ShardRL reads BPE", path, type));
  }
  require_field(model, "dropout", nullptr, "model", path);
  require_field(model, "continuing_subword_prefix", nullptr, "model", path);
  require_field(model, "end_of_word_suffix", nullptr, "model", path);
  require_field(model, "byte_fallback", false, "model", path);
  require_field(file, "normalizer", nullptr, "", path);
  if (!file.contains("pre_tokenizer")) {
    throw std::invalid_argument(fmt::format("tokenizer: '{}': no pre_tokenizer", path));
  }
  require_byte_level_pre_tokenizer(file["pre_tokenizer"], path);
  if (file.contains("post_processor") && !adds_no_tokens(file["post_processor"], path)) {
    throw std::invalid_argument(fmt::format(
        "tokenizer: '{}': post_processor is {}; ShardRL's encode adds no tokens, so it reads "
        "none or ByteLevel",
        path, file["post_processor"].dump()));
  }

  // Ids are dense: every id below the largest is a vocab entry or an added token. So none is
  // beyond their count, which bounds what the table of tokens allocates.
  const json& vocab = field(model, "vocab", "model.", json::value_t::object);
  const size_t max_tokens =
      vocab.size() + (file.contains("added_tokens") && file["added_tokens"].is_array()
                          ? file["added_tokens"].size()
                          : 0);
  std::vector<std::string> tokens;
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || token.empty() ||
        id.get<uint64_t>() >= max_tokens) {
      throw std::invalid_argument(fmt::format(
          "tokenizer: '{}': model.vocab entry '{}' has id {}, expected an integer in [0, {}) (the "
          "number of entries and added tokens)",
          path, token, id.dump(), max_tokens));
    }
    const auto i = static_cast<size_t>(id.get<int64_t>());
    if (i >= tokens.size()) tokens.resize(i + 1);
    tokens[i] = token;
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const auto& merge : field(model, "merges", "model.", json::value_t::array)) {
    if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
      continue;
    }
    const std::string text = merge.is_string() ? merge.get<std::string>() : "";
    const size_t space = text.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == text.size() ||
        text.find(' ', space + 1) != std::string::npos) {
      throw std::invalid_argument(fmt::format(
          "tokenizer: '{}': model.merges entry {} is {}, expected \"a b\" or [\"a\", \"b\"]", path,
          merges.size(), merge.dump()));
    }
    merges.emplace_back(text.substr(0, space), text.substr(space + 1));
  }
  std::vector<AddedToken> added;
  std::vector<bool> normalized;
  if (file.contains("added_tokens") && !file["added_tokens"].is_null()) {
    for (const auto& token : field(file, "added_tokens", "", json::value_t::array)) {
      const std::string where = fmt::format("added_tokens[{}].", added.size());
      for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
        require_field(token, flag, false, "added_tokens[" + std::to_string(added.size()) + "]",
                      path);
      }
      added.push_back({field(token, "id", where, json::value_t::number_unsigned).get<int64_t>(),
                       field(token, "content", where, json::value_t::string).get<std::string>(),
                       optional_field(token, "special", false, where, path)});
      normalized.push_back(optional_field(token, "normalized", !added.back().special, where, path));
    }
  }
  ByteLevelBpeTokenizer tokenizer;
  tokenizer.impl_->ignore_merges = optional_field(model, "ignore_merges", false, "model.", path);
  try {
    tokenizer.impl_->init(std::move(tokens), std::move(merges), std::move(added),
                          std::move(normalized));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("tokenizer: '{}': {}", path, e.what()));
  }
  return tokenizer;
}

void ByteLevelBpeTokenizer::save_tokenizer_json(const std::string& path) const {
  using ordered = nlohmann::ordered_json;
  ordered added = ordered::array();
  for (size_t k = 0; k < impl_->added.size(); ++k) {
    const AddedToken& token = impl_->added[k];
    added.push_back({{"id", token.id},
                     {"content", token.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", static_cast<bool>(impl_->added_normalized[k])},
                     {"special", token.special}});
  }
  ordered vocab = ordered::object();
  for (size_t id = 0; id < impl_->decoder.size(); ++id) {
    if (impl_->encoder.count(impl_->decoder[id])) vocab[impl_->decoder[id]] = id;
  }
  ordered merges = ordered::array();
  for (const auto& [first, second] : impl_->merges) merges.push_back({first, second});
  const ordered byte_level = {{"type", "ByteLevel"},
                              {"add_prefix_space", false},
                              {"trim_offsets", true},
                              {"use_regex", true}};
  const ordered file = {{"version", "1.0"},
                        {"truncation", nullptr},
                        {"padding", nullptr},
                        {"added_tokens", added},
                        {"normalizer", nullptr},
                        {"pre_tokenizer", byte_level},
                        {"post_processor", nullptr},
                        {"decoder", byte_level},
                        {"model",
                         {{"type", "BPE"},
                          {"dropout", nullptr},
                          {"unk_token", nullptr},
                          {"continuing_subword_prefix", nullptr},
                          {"end_of_word_suffix", nullptr},
                          {"fuse_unk", false},
                          {"byte_fallback", false},
                          {"ignore_merges", impl_->ignore_merges},
                          {"vocab", vocab},
                          {"merges", merges}}}};
  checkpoint::write_file_durably(path, file.dump(2));
}

ByteLevelBpeTokenizer::~ByteLevelBpeTokenizer() = default;
ByteLevelBpeTokenizer::ByteLevelBpeTokenizer(ByteLevelBpeTokenizer&&) noexcept = default;
ByteLevelBpeTokenizer& ByteLevelBpeTokenizer::operator=(ByteLevelBpeTokenizer&&) noexcept = default;

std::vector<std::string> ByteLevelBpeTokenizer::pretokenize(const std::string& text) {
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

std::vector<int64_t> ByteLevelBpeTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  impl_->encode_added(text, 0, ids);
  return ids;
}

// As tokenizers' ByteLevel decoder: a token's characters map back to bytes; a token with a
// character outside the byte alphabet (an added token such as "<think> ") is taken as its UTF-8.
std::string ByteLevelBpeTokenizer::decode(const std::vector<int64_t>& ids,
                                          bool skip_special_tokens) const {
  std::string bytes;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] < 0 || ids[k] >= vocab_size()) {
      throw std::out_of_range(
          fmt::format("tokenizer decode: id {} at position {} is outside the vocabulary [0, {})",
                      ids[k], k, vocab_size()));
    }
    if (skip_special_tokens) {
      auto added = impl_->added_index.find(ids[k]);
      if (added != impl_->added_index.end() && impl_->added[added->second].special) continue;
    }
    const std::string& token = impl_->decoder[ids[k]];
    std::string token_bytes;
    bool byte_level = true;
    for (size_t i = 0; i < token.size() && byte_level;) {
      char32_t code;
      i += next_code_point(token, i, code);
      auto it = impl_->byte_decoder.find(code);
      byte_level = it != impl_->byte_decoder.end();
      if (byte_level) token_bytes += static_cast<char>(it->second);
    }
    bytes += byte_level ? token_bytes : token;
  }
  return bytes;
}

int64_t ByteLevelBpeTokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->decoder.size());
}

int64_t ByteLevelBpeTokenizer::token_to_id(const std::string& token) const {
  for (const auto& added : impl_->added) {
    if (added.content == token) return added.id;
  }
  auto it = impl_->encoder.find(token);
  return it == impl_->encoder.end() ? -1 : it->second;
}

const std::vector<ByteLevelBpeTokenizer::AddedToken>& ByteLevelBpeTokenizer::added_tokens() const {
  return impl_->added;
}

}  // namespace shardrl::text
