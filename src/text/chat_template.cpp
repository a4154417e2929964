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
  if (jinja.find(kStart) == std::string::npos || jinja.find(kEnd) == std::string::npos) {
    throw std::invalid_argument(fmt::format(
        "{}: the chat template is not ChatML (no <|im_start|> / <|im_end|>); ShardRL renders "
        "ChatML templates only",
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
