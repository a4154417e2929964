// The GPT-2 tokenizer against Hugging Face tokenizers' byte-level BPE over the same vocabulary
// files (data/gpt2-bpe): the same ids for the same text, and decode(encode(s)) == s.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "shardrl/models/tokenizer.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

using models::Gpt2Tokenizer;

std::string vocabulary_dir() {
  return std::string(SHARDRL_SOURCE_DIR) + "/data/gpt2-bpe";
}

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

// Text that exercises every branch of the pre-tokenisation regex.
std::vector<std::string> sample_texts() {
  std::vector<std::string> texts = {
      "Hello, world!",
      "In the beginning God created the heaven and the earth.",
      "And the earth was without form, and void; and darkness was upon the face of the deep. "
      "And the Spirit of God moved upon the face of the waters.\n\n"
      "Genesis 1:3 And God said, Let there be light: and there was light.",
      "I'm sure they've said we'll go, but you're late and it's 'd or 'll; DON'T 'S",
      "12+34=46  and 3.14159, 1,000,000 or 0x1F; 2024-05-01",
      "   leading spaces, trailing spaces   ",
      "tabs\tand\n\nnewlines \n  indented\r\nwindows line\n",
      "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
      "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
      "\ud55c\uad6d\uc5b4",
      "emoji \U0001F389\U0001F680 and \U0001F468\u200D\U0001F469\u200D\U0001F467 family",
      "\u0391\u03b8\u03ae\u03bd\u03b1 \u041c\u043e\u0441\u043a\u0432\u0430 "
      "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0663\u0664\u0665 \u216b",
      "e\u0301 combining, nbsp\u00a0here, ideographic\u3000space, <|endoftext|>",
      "!!!??? ... --- *** ''' \"quoted\" (paren) [bracket] {brace} @#$%^&",
      "",
      " ",
      "\n",
      "a",
  };
  // Random code points from several scripts and classes, seeded: a fuzz of the regex's edges.
  std::mt19937 gen(7);
  const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E},   {0x09, 0x0D},     {0xA0, 0x17F},    {0x300, 0x36F},   {0x370, 0x3FF},
      {0x600, 0x6FF}, {0x2000, 0x206F}, {0x3000, 0x303F}, {0x4E00, 0x4E80}, {0x1F300, 0x1F64F},
      {0x20, 0x20},   {0x27, 0x27},     {0x30, 0x39}};
  for (int t = 0; t < 20; ++t) {
    std::string text;
    for (int k = 0; k < 200; ++k) {
      const auto& r = ranges[gen() % ranges.size()];
      text += utf8(r.first + static_cast<char32_t>(gen() % (r.second - r.first + 1)));
    }
    texts.push_back(text);
  }
  return texts;
}

// Token ids from Hugging Face tokenizers: a BPE model over the same two files with GPT-2's
// byte-level pre-tokenizer (its regex) and no special tokens, as GPT-2's own encoder has.
std::vector<std::vector<int64_t>> reference_encode(const std::vector<std::string>& texts) {
  const std::string dir = make_temp_dir("tokenizer");
  const std::string input = dir + "/texts.json";
  std::ofstream(input) << nlohmann::json(texts).dump();
  const std::string script =
      "import json, sys\n"
      "from tokenizers import Tokenizer, models, pre_tokenizers\n"
      "vocab = json.load(open(sys.argv[1] + '/encoder.json', encoding='utf-8'))\n"
      "lines = open(sys.argv[1] + '/vocab.bpe', encoding='utf-8').read().split('\\n')[1:]\n"
      "merges = [tuple(l.split(' ')) for l in lines if l]\n"
      "tok = Tokenizer(models.BPE(vocab, merges))\n"
      "tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)\n"
      "texts = json.load(open(sys.argv[2], encoding='utf-8'))\n"
      "print(json.dumps([tok.encode(t).ids for t in texts]))\n";
  auto result = run_process({SHARDRL_PYTHON, "-c", script, vocabulary_dir(), input});
  if (result.exit_code != 0) {
    ADD_FAILURE() << "the tokenizers reference failed: " << result.output;
    return {};
  }
  return nlohmann::json::parse(result.output).get<std::vector<std::vector<int64_t>>>();
}

TEST(Tokenizer, LoadsTheFullGpt2Vocabulary) {
  auto tok = Gpt2Tokenizer::load(vocabulary_dir());
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eos_token_id(), 50256);
  // Well-known GPT-2 ids.
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int64_t>{15496, 995}));
  EXPECT_EQ(tok.decode({tok.eos_token_id()}), "<|endoftext|>");
}

TEST(Tokenizer, PretokenizationFollowsTheGpt2Regex) {
  using V = std::vector<std::string>;
  EXPECT_EQ(Gpt2Tokenizer::pretokenize("I'm here  now\n\nok "),
            (V{"I", "'m", " here", " ", " now", "\n", "\n", "ok", " "}));
  EXPECT_EQ(Gpt2Tokenizer::pretokenize("12+34=46"), (V{"12", "+", "34", "=", "46"}));
  EXPECT_EQ(Gpt2Tokenizer::pretokenize("caf\u00e9 \u4e2d\u6587!?"),
            (V{"caf\u00e9", " \u4e2d\u6587", "!?"}));
  EXPECT_EQ(Gpt2Tokenizer::pretokenize("a\tb"), (V{"a", "\t", "b"}));
  EXPECT_EQ(Gpt2Tokenizer::pretokenize(""), V{});
}

TEST(Tokenizer, EncodeEqualsHuggingFaceTokenizersExactly) {
  auto tok = Gpt2Tokenizer::load(vocabulary_dir());
  const auto texts = sample_texts();
  const auto expected = reference_encode(texts);
  ASSERT_EQ(expected.size(), texts.size());
  int64_t total = 0;
  for (size_t k = 0; k < texts.size(); ++k) {
    EXPECT_EQ(tok.encode(texts[k]), expected[k]) << "text " << k << ": '" << texts[k] << "'";
    total += static_cast<int64_t>(expected[k].size());
  }
  EXPECT_GT(total, 3000);  // the comparison covered real work
}

TEST(Tokenizer, DecodeInvertsEncodeEvenForInvalidUtf8) {
  auto tok = Gpt2Tokenizer::load(vocabulary_dir());
  auto texts = sample_texts();
  texts.push_back("bad \xff\xfe bytes \xc3 and \xed\xa0\x80 surrogate");
  for (const auto& text : texts) EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

TEST(Tokenizer, BadInputNamesTheFileOrId) {
  auto tok = Gpt2Tokenizer::load(vocabulary_dir());
  try {
    tok.decode({15496, 50257});
    ADD_FAILURE() << "expected an error";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("id 50257 at position 1"), std::string::npos) << e.what();
  }
  const std::string dir = make_temp_dir("tokenizer-bad");
  try {
    Gpt2Tokenizer::load(dir);
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/encoder.json"), std::string::npos) << e.what();
  }
  std::ofstream(dir + "/encoder.json") << R"({"a": 0, "<|endoftext|>": 1})";
  std::ofstream(dir + "/vocab.bpe") << "#version: 0.2\na b\nc\n";
  try {
    Gpt2Tokenizer::load(dir);
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab.bpe' line 3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardrl::testing
