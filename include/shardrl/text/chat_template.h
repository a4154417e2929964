// Chat prompts in a model's own format, for the two template families instruct models on the Hub
// most often use: ChatML (`<|im_start|>role\ncontent<|im_end|>\n`: SmolLM2, Qwen2, Qwen2.5, Qwen3)
// and Llama 3's headers (`<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>` after
// `<|begin_of_text|>`: Llama 3 and 3.2's base form).
//
// A chat template is Jinja code; ShardRL runs no Jinja. It recognises those families and takes
// from the template text the default system message some insert when the conversation has none
// (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."), and whether contents are
// trimmed (Llama 3's `| trim`). The result equals transformers' apply_chat_template for those
// templates (tests/python/gguf_reference.py and the Chat tests check it); any other template,
// and Llama 3.1's, which adds a system turn dated by the day it runs, is an error rather than a
// silently different prompt.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace shardrl::text {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  // `source` names the template in errors (e.g. the tokenizer_config.json path).
  ChatTemplate(const std::string& jinja, const std::string& source);
  // A Hugging Face model directory's template: chat_template.jinja (transformers 5), else
  // tokenizer_config.json's chat_template (earlier versions, and `shardrl import`). Neither is
  // an error naming the directory.
  static ChatTemplate from_model_dir(const std::string& dir);
  // The prompt text; with add_generation_prompt it ends with the assistant's turn opened.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  // The system message inserted when the first message is not one, if the template has one.
  const std::optional<std::string>& default_system() const { return default_system_; }

 private:
  enum class Format { kChatML, kLlama3 };
  Format format_ = Format::kChatML;
  bool bos_ = false;   // Llama 3: the prompt opens with <|begin_of_text|>
  bool trim_ = false;  // Llama 3: each content trimmed of surrounding whitespace
  std::optional<std::string> default_system_;
};

}  // namespace shardrl::text
