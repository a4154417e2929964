// Fuzzes tokenizer_config.json, read two ways: for its chat template (text::ChatTemplate::
// from_model_dir; the input's optional second NUL-separated part is a chat_template.jinja beside
// it, which transformers 5 writes and which wins), rendering a fixed conversation; and as a BERT
// tokenizer's config beside a fixed vocab.txt (text::WordPieceTokenizer::load), encoding fixed
// texts.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "fuzz_util.h"
#include "shardrl/text/chat_template.h"
#include "shardrl/text/wordpiece_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  namespace fs = std::filesystem;
  static const std::string chat_dir = fuzz::scratch_dir() + "/chat";
  static const std::string bert_dir = [] {
    const std::string dir = fuzz::scratch_dir() + "/bert";
    fuzz::copy_data("wordpiece", dir);
    fs::create_directories(chat_dir);
    return dir;
  }();
  const auto parts = fuzz::split_parts(data, size);
  fuzz::write_file(chat_dir + "/tokenizer_config.json", parts[0]);
  const std::string jinja = chat_dir + "/chat_template.jinja";
  if (parts.size() > 1) {
    fuzz::write_file(jinja, parts[1]);
  } else {
    fs::remove(jinja);
  }
  fuzz::expect_clear_errors({chat_dir}, [&] {
    const auto chat = text::ChatTemplate::from_model_dir(chat_dir);
    chat.render({{"user", "What is 47 + 38?"}, {"assistant", "85"}}, false);
    chat.render({{"system", "Be brief."}, {"user", "Hi"}}, true);
  });
  fuzz::write_file(bert_dir + "/tokenizer_config.json", parts[0]);
  fuzz::expect_clear_errors({bert_dir}, [&] {
    const auto tokenizer = text::WordPieceTokenizer::load(bert_dir);
    tokenizer.encode("[CLS] Hello world, na\xc3\xafve caf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac![SEP]");
    tokenizer.encode_batch({"a photo of a cat", "\xff \xe2\x80\x8b [MASK]"}, 8);
  });
  return 0;
}
