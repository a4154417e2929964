// The GPT-2 tokenizer against Hugging Face tokenizers' byte-level BPE over the same vocabulary
// files (data/gpt2-bpe): the same ids for the same text, and decode(encode(s)) == s. SmolLM2's
// tokenizer.json, as transformers builds it from the GGUF, against tokenizers and transformers on
// real text (Debian's KJV, fortunes and licence texts) and on ChatML with its special tokens
// (tests/python/tokenizer_reference.py).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "shardrl/text/bpe_tokenizer.h"
#include "shardrl/text/chat_template.h"
#include "test_util.h"
#include "text/utf8.h"
#include "text_corpus.h"

namespace shardrl::testing {
namespace {

using text::ByteLevelBpeTokenizer;

std::string vocabulary_dir() {
  return std::string(SHARDRL_SOURCE_DIR "/data/gpt2-bpe");
}

using text::detail::utf8;

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
  auto tok = ByteLevelBpeTokenizer::load(vocabulary_dir());
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 50256);
  // Well-known GPT-2 ids.
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int64_t>{15496, 995}));
  EXPECT_EQ(tok.decode({50256}), "<|endoftext|>");
}

TEST(Tokenizer, PretokenizationFollowsTheGpt2Regex) {
  using V = std::vector<std::string>;
  EXPECT_EQ(ByteLevelBpeTokenizer::pretokenize("I'm here  now\n\nok "),
            (V{"I", "'m", " here", " ", " now", "\n", "\n", "ok", " "}));
  EXPECT_EQ(ByteLevelBpeTokenizer::pretokenize("12+34=46"), (V{"12", "+", "34", "=", "46"}));
  EXPECT_EQ(ByteLevelBpeTokenizer::pretokenize("caf\u00e9 \u4e2d\u6587!?"),
            (V{"caf\u00e9", " \u4e2d\u6587", "!?"}));
  EXPECT_EQ(ByteLevelBpeTokenizer::pretokenize("a\tb"), (V{"a", "\t", "b"}));
  EXPECT_EQ(ByteLevelBpeTokenizer::pretokenize(""), V{});
}

TEST(Tokenizer, EncodeEqualsHuggingFaceTokenizersExactly) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"tokenizers"}));
  auto tok = ByteLevelBpeTokenizer::load(vocabulary_dir());
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
  auto tok = ByteLevelBpeTokenizer::load(vocabulary_dir());
  auto texts = sample_texts();
  texts.push_back("bad \xff\xfe bytes \xc3 and \xed\xa0\x80 surrogate");
  for (const auto& text : texts) EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

TEST(Tokenizer, BadInputNamesTheFileOrId) {
  auto tok = ByteLevelBpeTokenizer::load(vocabulary_dir());
  try {
    tok.decode({15496, 50257});
    ADD_FAILURE() << "expected an error";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("id 50257 at position 1"), std::string::npos) << e.what();
  }
  const std::string dir = make_temp_dir("tokenizer-bad");
  try {
    ByteLevelBpeTokenizer::load(dir);
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/encoder.json"), std::string::npos) << e.what();
  }
  std::ofstream(dir + "/encoder.json") << R"({"a": 0, "<|endoftext|>": 1})";
  std::ofstream(dir + "/vocab.bpe") << "#version: 0.2\na b\nc\n";
  try {
    ByteLevelBpeTokenizer::load(dir);
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab.bpe' line 3"), std::string::npos) << e.what();
  }
}

// ---- SmolLM2's tokenizer.json on real text ----------------------------------------------------

std::string reference_script() {
  return std::string(SHARDRL_SOURCE_DIR "/tests/python/tokenizer_reference.py");
}

// Runs tokenizer_reference.py `command` on one {"tokenizer", "texts"} job per tokenizer; the
// texts are written once, and the results come back in the jobs' order.
nlohmann::json run_reference(const std::string& command, const std::vector<std::string>& tokenizers,
                             const std::vector<std::string>& texts) {
  const std::string dir = make_temp_dir("tokenizer-" + command);
  write_json(dir + "/texts.json", texts);
  nlohmann::json jobs = nlohmann::json::array();
  for (const auto& path : tokenizers) {
    jobs.push_back({{"tokenizer", path}, {"texts", dir + "/texts.json"}});
  }
  write_json(dir + "/jobs.json", jobs);
  const auto ran = run_process(
      {SHARDRL_PYTHON, reference_script(), command, dir + "/jobs.json", dir + "/out.json"});
  if (ran.exit_code != 0) throw std::runtime_error("tokenizer_reference.py: " + ran.output);
  return nlohmann::json::parse(read_text(dir + "/out.json"));
}

// ChatML as SmolLM2's chat template writes it, special tokens next to each other and glued to
// words, near misses that must stay text, and every added token alone, in a sentence and all of
// them in a row. The variant's tokens (tokenizer_reference.py) overlap these.
void add_special_token_texts(Corpus& corpus, const std::vector<std::string>& added) {
  const std::vector<std::string> texts = {
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
      "2+2 is 4.<|im_end|>\n<|im_start|>user\nAnd x?<|im_end|>\n<|im_start|>assistant\n",
      "<|im_end|><|im_start|>",
      "<|im_start|><|im_start|><|im_end|><|im_end|><|endoftext|>",
      "word<|im_end|>word Amen.<|im_start|>user <|im_start|> spaced <|im_end|>\n\n<|im_start|>\t",
      "<|im_end",
      "<|im_start|",
      "|im_end|>",
      "<im_end|>",
      "<|im_end |>",
      "<|IM_END|>",
      "<<|im_end|>>",
      "<|im_start|<|im_end|>",
      "<|im_end<|im_start|>|>",
      "<|endoftext|",
      "<|im_start|>assistant\nx<|im_end|>",
      "<|im_start|>assistan<|im_start|>assistant",
      "end|><|im_start",
      "<|im_endend|><|im_start|>",
      "x<|im_end",
      "Amen. Amen.<|im_end|> Amen.x<|im_end",
  };
  for (size_t k = 0; k < texts.size(); ++k) {
    corpus.add("ChatML text " + std::to_string(k), texts[k]);
  }
  std::string all;
  for (const auto& token : added) {
    corpus.add("added token " + token, token);
    corpus.add("added token " + token + " in a sentence",
               "Say " + token + " twice:" + token + token);
    all += token;
  }
  corpus.add("every added token in a row", all);
}

// SmolLM2's tokenizer.json and the variant, with the added tokens read from the file (not from
// the tokenizer under test).
struct SmolLm2Files {
  std::string smollm2_json, variant_json;
  std::vector<std::string> added;
  std::string error;  // why they could not be made
};

// The KJV, the fortunes, the licence texts and the special-token texts for smollm2.json; the
// special-token texts and the KJV's Revelation (" Amen.") for variant.json.
Corpus real_texts(const SmolLm2Files& files) {
  Corpus corpus;
  add_bible(corpus, "gen1:1-rev22:21");
  add_files(corpus, "/usr/share/games/fortunes", {".dat", ".u8"});
  add_files(corpus, "/usr/share/common-licenses", {});
  add_special_token_texts(corpus, files.added);
  return corpus;
}

Corpus variant_texts(const SmolLm2Files& files) {
  Corpus corpus;
  add_special_token_texts(corpus, files.added);
  add_bible(corpus, "rev1:1-rev22:21");
  return corpus;
}

// tokenizers' results on a corpus (tokenizer_reference.py reference).
struct Reference {
  Corpus corpus;
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::string> decoded, decoded_skip;
  std::vector<int64_t> added_differs;
  std::string error;  // why it could not be made
};

Reference make_reference(const std::string& tokenizer_json, Corpus corpus) {
  Reference r;
  const auto out = run_reference("reference", {tokenizer_json}, corpus.texts).at(0);
  out.at("ids").get_to(r.ids);
  out.at("decoded").get_to(r.decoded);
  out.at("decoded_skip").get_to(r.decoded_skip);
  out.at("added_differs").get_to(r.added_differs);
  r.corpus = std::move(corpus);
  return r;
}

// Made at most once per test process (ctest runs each test in its own): transformers' GGUF
// conversion and tokenizers' pass over ~7 MB of text take seconds. A failure becomes `error`,
// reported by every test that needs the result.
template <typename T>
T made_or_error(const std::function<T()>& make) {
  try {
    return make();
  } catch (const std::exception& e) {
    T failed;
    failed.error = e.what();
    return failed;
  }
}

// What SmolLM2's reference tokenizer needs: transformers converts the GGUF's tokenizer (with gguf)
// and tokenizers encodes with it.
std::string missing_smollm2_reference() {
  std::string missing = missing_python_modules({"tokenizers", "transformers", "gguf"});
  return missing.empty() ? missing_smollm2_gguf() : missing;
}

// The real texts' sources: Debian's KJV, fortunes and licence texts.
std::string missing_real_texts() {
  for (const auto& missing :
       {missing_program("bible", "the Debian package bible-kjv"),
        missing_file("/usr/share/games/fortunes", "the Debian packages fortunes, fortunes-min"),
        missing_file("/usr/share/common-licenses", "the Debian package base-files")}) {
    if (!missing.empty()) return missing;
  }
  return "";
}

const SmolLm2Files& smollm2_files() {
  static const SmolLm2Files files = made_or_error<SmolLm2Files>([] {
    SmolLm2Files f;
    const std::string dir = make_temp_dir("tokenizer-smollm2");
    const auto made = run_process({SHARDRL_PYTHON, reference_script(), "smollm2", dir});
    if (made.exit_code != 0) throw std::runtime_error("tokenizer_reference.py: " + made.output);
    f.smollm2_json = dir + "/smollm2.json";
    f.variant_json = dir + "/variant.json";
    const auto file = nlohmann::json::parse(read_text(f.smollm2_json));
    for (const auto& token : file.at("added_tokens")) f.added.push_back(token.at("content"));
    return f;
  });
  return files;
}

const Reference& real_text_reference() {
  static const Reference reference = made_or_error<Reference>([] {
    const auto& files = smollm2_files();
    if (!files.error.empty()) throw std::runtime_error(files.error);
    return make_reference(files.smollm2_json, real_texts(files));
  });
  return reference;
}

const Reference& variant_reference() {
  static const Reference reference = made_or_error<Reference>([] {
    const auto& files = smollm2_files();
    if (!files.error.empty()) throw std::runtime_error(files.error);
    return make_reference(files.variant_json, variant_texts(files));
  });
  return reference;
}

void expect_same_ids(const ByteLevelBpeTokenizer& tok, const std::vector<int64_t>& got,
                     const std::vector<int64_t>& want, const std::string& name) {
  expect_same_id_sequences(got, want, name, tok.vocab_size(),
                           [&](int64_t id) { return tok.decode({id}); });
}

void expect_same_text(const std::string& got, const std::string& want, const std::string& name) {
  if (got == want) return;
  const size_t at =
      std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first - got.begin();
  const size_t from = at < 40 ? 0 : at - 40;
  ADD_FAILURE() << name << ": " << got.size() << " bytes where " << want.size()
                << " were expected; first difference at byte " << at
                << "\n  got:  " << quoted(got.substr(from, 80))
                << "\n  want: " << quoted(want.substr(from, 80));
}

// Every text encodes to tokenizers' ids, and tokenizers' ids decode to its text, with and
// without the special tokens.
void expect_encode_and_decode_as(const ByteLevelBpeTokenizer& tok, const Reference& reference) {
  const Corpus& corpus = reference.corpus;
  ASSERT_EQ(reference.ids.size(), corpus.texts.size());
  // add_special_tokens=True adds nothing in tokenizers either, so the ids equal both ways.
  EXPECT_EQ(reference.added_differs, std::vector<int64_t>{});
  for (size_t k = 0; k < corpus.texts.size(); ++k) {
    const std::string name = "ShardRL against tokenizers on " + corpus.names[k];
    expect_same_ids(tok, tok.encode(corpus.texts[k]), reference.ids[k], name);
    expect_same_text(tok.decode(reference.ids[k]), reference.decoded[k], name);
    expect_same_text(tok.decode(reference.ids[k], true), reference.decoded_skip[k],
                     name + " (skip_special_tokens)");
  }
}

// How many of `ids` are the added token `content`: a comparison that never met one proves little.
size_t count_added(const ByteLevelBpeTokenizer& tok, const std::vector<std::vector<int64_t>>& ids,
                   const std::string& content) {
  size_t n = 0;
  for (const auto& text : ids) n += std::count(text.begin(), text.end(), tok.token_to_id(content));
  return n;
}

TEST(SmolLm2Tokenizer, EncodesAndDecodesRealTextAsHuggingFace) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_smollm2_reference());
  SHARDRL_REQUIRE_DEPENDENCY(missing_real_texts());
  const auto& ref = real_text_reference();
  ASSERT_EQ(ref.error, "");
  const auto tok = ByteLevelBpeTokenizer::load_tokenizer_json(smollm2_files().smollm2_json);
  EXPECT_EQ(tok.vocab_size(), 49152);
  EXPECT_EQ(tok.added_tokens().size(), 17u);
  expect_encode_and_decode_as(tok, ref);
  // The whole KJV, the fortunes and the licences were compared.
  EXPECT_EQ(std::count_if(ref.corpus.names.begin(), ref.corpus.names.end(),
                          [](const std::string& name) { return name.rfind("KJV ", 0) == 0; }),
            66);
  size_t ids = 0;
  for (const auto& text : ref.ids) ids += text.size();
  EXPECT_GT(ids, 1900000u);
  for (const auto& token : tok.added_tokens()) {
    EXPECT_GE(count_added(tok, ref.ids, token.content), 4u) << token.content;
  }
}

// SmolLM2's ChatML tokens, and the variant's tokens that overlap them and each other.
TEST(SmolLm2Tokenizer, SplitsAtAddedTokensAsHuggingFace) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_smollm2_reference());
  SHARDRL_REQUIRE_DEPENDENCY(missing_program("bible", "the Debian package bible-kjv"));
  const auto& files = smollm2_files();
  ASSERT_EQ(files.error, "");
  const auto smollm2 = ByteLevelBpeTokenizer::load_tokenizer_json(files.smollm2_json);
  const int64_t im_start = smollm2.token_to_id("<|im_start|>");
  const int64_t im_end = smollm2.token_to_id("<|im_end|>");
  EXPECT_EQ(smollm2.encode("<|im_end|><|im_start|>"), (std::vector<int64_t>{im_end, im_start}));
  for (const char* partial : {"<|im_end", "<|im_start|", "<|im_end |>", "<|IM_END|>"}) {
    const auto ids = smollm2.encode(partial);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), im_start), 0) << partial;
    EXPECT_EQ(std::count(ids.begin(), ids.end(), im_end), 0) << partial;
    EXPECT_EQ(smollm2.decode(ids, true), partial);
  }
  const auto ids = smollm2.encode("<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_EQ(ids.front(), im_start);
  EXPECT_EQ(smollm2.decode(ids), "<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_EQ(smollm2.decode(ids, true), "user\nHi\n");

  const auto& ref = variant_reference();
  ASSERT_EQ(ref.error, "");
  const auto variant = ByteLevelBpeTokenizer::load_tokenizer_json(files.variant_json);
  expect_encode_and_decode_as(variant, ref);
  for (const char* token : {"<|im_start|>assistant", "end|><|im", "x<|im_end", " Amen."}) {
    EXPECT_GE(count_added(variant, ref.ids, token), 2u) << token;
  }
}

// tokenizers and transformers read ShardRL's tokenizer.json as the tokenizer ShardRL has: the
// same ids as ShardRL's encode, which the tests above hold to tokenizers' on the original files.
TEST(SmolLm2Tokenizer, SavedTokenizerJsonLoadsInTokenizersAndTransformers) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_smollm2_reference());
  SHARDRL_REQUIRE_DEPENDENCY(missing_real_texts());
  const auto& files = smollm2_files();
  ASSERT_EQ(files.error, "");
  const std::string dir = make_temp_dir("tokenizer-saved");
  const std::pair<std::string, Corpus> cases[] = {{files.smollm2_json, real_texts(files)},
                                                  {files.variant_json, variant_texts(files)}};
  for (const auto& [original, corpus] : cases) {
    const auto tok = ByteLevelBpeTokenizer::load_tokenizer_json(original);
    const std::string saved = dir + "/" + std::filesystem::path(original).filename().string();
    tok.save_tokenizer_json(saved);
    const auto out = run_reference("load", {saved}, corpus.texts).at(0);
    for (const char* library : {"tokenizers", "transformers"}) {
      const auto ids = out.at(library).get<std::vector<std::vector<int64_t>>>();
      ASSERT_EQ(ids.size(), corpus.texts.size());
      for (size_t k = 0; k < ids.size(); ++k) {
        expect_same_ids(
            tok, ids[k], tok.encode(corpus.texts[k]),
            std::string(library) + " on " + saved + " against ShardRL on " + corpus.names[k]);
      }
    }
  }
}

TEST(Tokenizer, LoadTokenizerJsonNamesTheFileAndTheField) {
  const std::string dir = make_temp_dir("tokenizer-json-bad");
  const std::string good = dir + "/good.json";
  ByteLevelBpeTokenizer::from_vocab({"a", "b", "ab"}, {{"a", "b"}}, {{3, "<s>", true}})
      .save_tokenizer_json(good);
  EXPECT_EQ(ByteLevelBpeTokenizer::load_tokenizer_json(good).encode("ab<s>"),
            (std::vector<int64_t>{2, 3}));
  const auto with = [&](const std::string& name, const nlohmann::json::json_pointer& field,
                        const nlohmann::json& value) {
    auto file = nlohmann::json::parse(read_text(good));
    file[field] = value;
    const std::string path = dir + "/" + name + ".json";
    write_json(path, file);
    return path;
  };
  // A post-processor that adds a BOS: ShardRL's encode adds none.
  const auto bos = R"({"type": "TemplateProcessing", "pair": [], "single": [
      {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [3], "tokens": ["<s>"]}}})"_json;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {with("wordpiece", "/model/type"_json_pointer, "WordPiece"), "model.type"},
      {with("normalizer", "/normalizer"_json_pointer, R"({"type": "NFC"})"_json), "normalizer"},
      {with("split", "/pre_tokenizer"_json_pointer, R"({"type": "Whitespace"})"_json),
       "pre_tokenizer"},
      {with("prefix", "/pre_tokenizer/add_prefix_space"_json_pointer, true),
       "pre_tokenizer.add_prefix_space"},
      {with("bos", "/post_processor"_json_pointer, bos), "post_processor"},
      {dir + "/missing.json", "cannot read"},
  };
  for (const auto& [file, field] : bad) {
    const std::string& path = file;  // clang before 16 cannot capture a structured binding
    expect_invalid_argument_naming([&] { ByteLevelBpeTokenizer::load_tokenizer_json(path); },
                                   "'" + path + "'", field);
  }
  std::ofstream(dir + "/broken.json") << R"({"model": {"type": "BPE", "vocab": {)";
  expect_invalid_argument_naming(
      [&] { ByteLevelBpeTokenizer::load_tokenizer_json(dir + "/broken.json"); },
      "'" + dir + "/broken.json'", "not valid JSON");
}

// Llama 3's header template, in Meta's Llama-3-8B-Instruct form (bos_token, contents trimmed)
// and in bench/make_real_models.py's (a literal <|begin_of_text|>, no trim). The expected texts
// are what transformers' apply_chat_template rendered from these templates (5.x, with
// bos_token <|begin_of_text|>), not this code's output.
TEST(ChatTemplate, Llama3HeadersRenderAsTransformersDoes) {
  const std::string meta =
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
      "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
      "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
      "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
      "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
  const std::string literal =
      "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + "
      "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% "
      "endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>"
      "\\n\\n' }}{% endif %}";
  const std::vector<text::ChatMessage> user = {{"user", " What is 3+4? "}};
  const std::vector<text::ChatMessage> system = {{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(text::ChatTemplate(meta, "meta").render(user, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is "
            "3+4?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(text::ChatTemplate(literal, "literal").render(user, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n What is 3+4? "
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  const std::string with_system =
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe "
      "brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>"
      "assistant<|end_header_id|>\n\n";
  for (const auto& jinja : {meta, literal}) {
    EXPECT_EQ(text::ChatTemplate(jinja, "t").render(system, true), with_system);
  }

  // Llama 3.1's dated system turn, and a template of neither family, are errors naming the source.
  expect_invalid_argument_naming(
      [&] {
        text::ChatTemplate(meta + "{{ 'Cutting Knowledge Date: December 2023' }}", "3.1.json");
      },
      "3.1.json", "the date it runs on");
  expect_invalid_argument_naming(
      [&] { text::ChatTemplate("{{ messages[0]['content'] }}", "other.json"); }, "other.json",
      "neither ChatML");
}

}  // namespace
}  // namespace shardrl::testing
