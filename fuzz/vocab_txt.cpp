// Fuzzes a BERT tokenizer's vocab.txt (text::WordPieceTokenizer::load: one token a line, the
// special tokens looked up in it), beside the tokenizer_config.json transformers wrote for it, or
// the input's second NUL-separated part in its place (its special tokens may name any line).
// A vocabulary it accepts must encode fixed texts (accents, CJK, punctuation, special tokens,
// bytes that are not UTF-8) into ids it holds, and pad a batch.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "shardrl/text/wordpiece_tokenizer.h"
#include "text/utf8.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string dir = fuzz::scratch_dir() + "/bert";
  static const std::string config = [] {
    fuzz::copy_data("wordpiece", dir);
    return shardrl::text::detail::read_file("fuzz", dir + "/tokenizer_config.json");
  }();
  const auto parts = fuzz::split_parts(data, size);
  fuzz::write_file(dir + "/vocab.txt", parts[0]);
  fuzz::write_file(dir + "/tokenizer_config.json", parts.size() > 1 ? parts[1] : config);
  fuzz::expect_clear_errors({dir}, [&] {
    const auto tokenizer = text::WordPieceTokenizer::load(dir);
    for (const std::string text : {"[CLS] Hello world, this is a tiny corpus![SEP] [PAD][MASK]",
                                   "na\xc3\xafve caf\xc3\xa9 \xc3\x87"
                                   "a va? \xe6\x9d\xb1\xe4\xba\xac 123 4\xc2\xbd",
                                   "\xff\xfe unbelievably-long-wordpieceable-words ##ing \t\r\n"}) {
      for (const int64_t id : tokenizer.encode(text)) tokenizer.id_to_token(id);
    }
    const auto batch = tokenizer.encode_batch({"hello", "a photo of a cat"}, 6, 8);
    if (batch.input_ids.size(1) != 8) fuzz::finding("WordPiece", "a batch of another length");
  });
  return 0;
}
