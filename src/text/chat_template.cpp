#include "shardrl/text/chat_template.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace shardrl::text {
namespace {

constexpr const char* kStart = "<|im_start|>";
constexpr const char* kEnd = "<|im_end|>";
constexpr const char* kBos = "<|begin_of_text|>";
constexpr const char* kHeaderStart = "<|start_header_id|>";
constexpr const char* kHeaderEnd = "<|end_header_id|>";
constexpr const char* kEot = "<|eot_id|>";

// Jinja's trim: the text without leading and trailing whitespace.
std::string trimmed(const std::string& text) {
  const char* space = " \t\n\r\f\v";
  const size_t begin = text.find_first_not_of(space);
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(space) - begin + 1);
}

// A Jinja string literal's text: '\n' escapes become newlines (a template may also hold a literal
// newline, which stays as it is).
std::string unescape(const std::string& literal) {
  std::string out;
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal[i] == '\\' && i + 1 < literal.size()) {
      const char next = literal[++i];
      out += next == 'n' ? '\n' : next == 't' ? '\t' : next;
    } else {
      out += literal[i];
    }
  }
  return out;
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& jinja, const std::string& source) {
  const auto has = [&](const char* text) { return jinja.find(text) != std::string::npos; };
  if (has(kHeaderStart) && has(kHeaderEnd) && has(kEot)) {
    if (has("Cutting Knowledge Date") || has("Today Date")) {
      throw std::invalid_argument(fmt::format(
          "{}: a Llama 3.1-style chat template, whose system turn carries the date it runs on; "
          "ShardRL renders Llama 3's header template without it (give the model a template of "
          "<|start_header_id|> turns alone)",
          source));
    }
    format_ = Format::kLlama3;
    bos_ = has("bos_token") || has(kBos);
    std::string compact;
    for (char c : jinja) {
      if (c != ' ') compact += c;
    }
    trim_ = compact.find("|trim") != std::string::npos;
    return;
  }
  if (!has(kStart) || !has(kEnd)) {
    throw std::invalid_argument(fmt::format(
        "{}: the chat template is neither ChatML (<|im_start|> / <|im_end|>) nor Llama 3's "
        "(<|start_header_id|> / <|end_header_id|> / <|eot_id|>); ShardRL renders those two only",
        source));
  }
  // The default system turn is a literal in the template: '<|im_start|>system\n...<|im_end|>\n'.
  for (const std::string opening : {"'<|im_start|>system\\n", "'<|im_start|>system\n"}) {
    const size_t at = jinja.find(opening);
    if (at == std::string::npos) continue;
    const size_t begin = at + opening.size();
    const size_t end = jinja.find(kEnd, begin);
    const size_t quote = jinja.find('\'', begin);
    // Only a literal that closes its turn inside the quotes is a fixed message; one built from
    // a variable (messages[0]['content']) is not.
    if (end != std::string::npos && quote != std::string::npos && end < quote) {
      default_system_ = unescape(jinja.substr(begin, end - begin));
    }
    break;
  }
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) const {
  std::string out;
  if (format_ == Format::kLlama3) {
    if (bos_) out += kBos;
    for (const auto& m : messages) {
      out += fmt::format("{}{}{}\n\n{}{}", kHeaderStart, m.role, kHeaderEnd,
                         trim_ ? trimmed(m.content) : m.content, kEot);
    }
    if (add_generation_prompt) out += fmt::format("{}assistant{}\n\n", kHeaderStart, kHeaderEnd);
    return out;
  }
  if (default_system_ && (messages.empty() || messages.front().role != "system")) {
    out += fmt::format("{}system\n{}{}\n", kStart, *default_system_, kEnd);
  }
  for (const auto& m : messages)
    out += fmt::format("{}{}\n{}{}\n", kStart, m.role, m.content, kEnd);
  if (add_generation_prompt) out += fmt::format("{}assistant\n", kStart);
  return out;
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const auto read = [](const fs::path& path) {
    std::ifstream in(path);
    if (!in) throw std::invalid_argument(fmt::format("{}: cannot be read", path.string()));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const fs::path jinja = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja)) return {read(jinja), jinja.string()};
  const fs::path path = fs::path(dir) / "tokenizer_config.json";
  if (!fs::exists(path)) {
    throw std::invalid_argument(fmt::format(
        "{}: no chat template (neither chat_template.jinja nor tokenizer_config.json)", dir));
  }
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(read(path));
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: not valid JSON: {}", path.string(), e.what()));
  }
  if (!config.contains("chat_template") || !config["chat_template"].is_string()) {
    throw std::invalid_argument(
        fmt::format("{} has no chat_template (nor is there a chat_template.jinja)", path.string()));
  }
  return {config["chat_template"].get<std::string>(), path.string() + ": chat_template"};
}

}  // namespace shardrl::text
