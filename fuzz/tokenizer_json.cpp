// Fuzzes the tokenizer.json reader (text::ByteLevelBpeTokenizer::load_tokenizer_json: the model's
// vocab and merges, added tokens, the normalizer, pre-tokenizer and post-processor it checks).
// A file it accepts must encode and decode: a few fixed texts, chat markup and bytes that are not
// UTF-8 among them, decoding back to the text where no added token is in it and the vocabulary
// holds each of its bytes (tokenizers drops a byte it lacks); and it must save
// (save_tokenizer_json) into a file that loads as the same tokenizer.
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "fuzz_util.h"
#include "shardrl/text/bpe_tokenizer.h"

namespace {

const std::vector<std::string>& texts() {
  using namespace std::string_literals;
  static const std::vector<std::string> t = {
      "Hello world, this is a tiny corpus. It's 2024; we'll see what they've got.",
      "na\xc3\xafve caf\xc3\xa9 \xe6\x9d\xb1\xe4\xba\xac 123  \t\n x",
      "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n",
      "\xff\xfe\x80 bytes\0 not UTF-8 \xc3"s};
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string path = fuzz::scratch_dir() + "/tokenizer.json";
  static const std::string saved = fuzz::scratch_dir() + "/saved.json";
  fuzz::write_file(path, data, size);
  fuzz::expect_clear_errors({path}, [&] {
    const auto tokenizer = text::ByteLevelBpeTokenizer::load_tokenizer_json(path);
    tokenizer.save_tokenizer_json(saved);
    const auto again = text::ByteLevelBpeTokenizer::load_tokenizer_json(saved);
    // The bytes the vocabulary holds: those that decode back alone.
    std::array<bool, 256> held{}, seen{};
    for (const auto& text : texts()) {
      for (const unsigned char byte : text) {
        if (std::exchange(seen[byte], true)) continue;
        const std::string alone(1, static_cast<char>(byte));
        held[byte] = tokenizer.decode(tokenizer.encode(alone)) == alone;
      }
    }
    for (const auto& text : texts()) {
      const auto ids = tokenizer.encode(text);
      if (again.encode(text) != ids) fuzz::finding("tokenizer", "the saved file encodes otherwise");
      const std::string decoded = tokenizer.decode(ids);
      bool plain = true;
      for (const auto& added : tokenizer.added_tokens()) {
        plain = plain && text.find(added.content) == std::string::npos;
      }
      for (const unsigned char byte : text) plain = plain && held[byte];
      if (plain && decoded != text) fuzz::finding("tokenizer", "decode(encode(text)) != text");
    }
  });
  return 0;
}
