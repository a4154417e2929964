// Regressions for what fuzzing the parsers found (fuzz/): each input here once crashed, leaked,
// allocated what the file's size did not justify, or escaped as a library's exception naming no
// file. Through the public entry points, as a user's file reaches them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "shardrl/checkpoint.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/sd3.h"
#include "shardrl/models/text_encoder.h"
#include "shardrl/text/bpe_tokenizer.h"
#include "shardrl/text/wordpiece_tokenizer.h"
#include "shardrl/trainer.h"
#include "test_util.h"
#include "text_corpus.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Runs fn, which must throw E with a message holding every one of `words`.
template <class E>
void expect_error_naming(const std::function<void()>& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no error was raised";
  } catch (const E& e) {
    for (const auto& w : words) {
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos)
          << "'" << w << "' not in " << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "another exception than expected: " << e.what();
  }
}

// ---- safetensors -------------------------------------------------------------------------------

// A safetensors file of this JSON header and data, as a writer would lay it out.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string text = header;
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t length = text.size();
  std::string out(reinterpret_cast<const char*>(&length), 8);
  return out + text + data;
}

int open_descriptors() {
  int n = 0;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) n += entry.exists() ? 1 : 0;
  return n;
}

TEST(ParserFindings, SafetensorsDamagedHeaderLeavesNoDescriptorOpen) {
  const std::string path = make_temp_dir("pf-st-fd") + "/bad.safetensors";
  write_bytes(path, safetensors_bytes("{\"t\": {\"dtype\": \"F32\"", ""));
  const int before = open_descriptors();
  for (int i = 0; i < 64; ++i) {
    EXPECT_THROW(checkpoint::SafetensorsReader reader(path), std::runtime_error);
  }
  EXPECT_EQ(open_descriptors(), before);
}

TEST(ParserFindings, SafetensorsNegativeOrOverflowingShapeIsAnErrorNamingIt) {
  const std::string dir = make_temp_dir("pf-st-shape");
  struct Case {
    std::string shape, offsets, says;
  };
  const std::vector<Case> cases = {
      // 4 elements, 16 bytes, as the offsets say.
      {"[-1, -4]", "[0, 16]", "sizes must be >= 0"},
      // Wraps to 0 elements.
      {"[4294967296, 4294967296]", "[0, 0]", "at most 2^48 elements"},
      // Not an integer: converting it to int64_t was undefined behaviour.
      {"[1e30]", "[0, 16]", "shape must be a list of integers"},
      {"[4]", "[0, 1.6e1]", "data_offsets must be a list of integers"},
  };
  for (const auto& c : cases) {
    const std::string path = dir + "/shape.safetensors";
    write_bytes(path, safetensors_bytes("{\"t\": {\"dtype\": \"F32\", \"shape\": " + c.shape +
                                            ", \"data_offsets\": " + c.offsets + "}}",
                                        std::string(16, '\0')));
    expect_error_naming<std::runtime_error>([&] { checkpoint::SafetensorsReader reader(path); },
                                            {path, "'t'", c.says});
  }
}

TEST(ParserFindings, SafetensorsChecksumBlockLargerThanAnyFileReads) {
  const std::string path = make_temp_dir("pf-st-blocks") + "/t.safetensors";
  const torch::Tensor t = torch::arange(6, torch::kFloat).view({2, 3});
  checkpoint::SafetensorsWriter writer(path, {{"t", torch::kFloat, {2, 3}}});
  writer.write("t", t);
  const auto summary = writer.close();
  // One block of the largest size holds the whole file: its checksum is the file's.
  checkpoint::BlockChecksums blocks;
  blocks.block_bytes = std::numeric_limits<int64_t>::max();
  blocks.crc32 = {summary.crc32};
  checkpoint::SafetensorsReader reader(path, blocks);
  EXPECT_TRUE(torch::equal(reader.read("t"), t));
}

// ---- checkpoint index --------------------------------------------------------------------------

// A copy of the checkpoint fuzz/ seeds with (a 1-step `shardrl train` of a tiny GPT), its index
// changed by `edit`.
std::string checkpoint_with_index(const std::string& tag, const std::function<void(json&)>& edit) {
  const fs::path src = fs::path(SHARDRL_SOURCE_DIR) / "fuzz";
  const std::string dir = make_temp_dir(tag);
  for (const auto& file : fs::directory_iterator(src / "data" / "checkpoint")) {
    fs::copy_file(file.path(), fs::path(dir) / file.path().filename());
  }
  json index = json::parse(std::ifstream(src / "corpus" / "index" / "index.json"));
  edit(index);
  std::ofstream(fs::path(dir) / "index.json") << index.dump(1);
  return dir;
}

TEST(ParserFindings, CheckpointIndexSeedReads) {
  const std::string dir = checkpoint_with_index("pf-index-ok", [](json&) {});
  const auto weight = checkpoint::read_full_tensor(dir, "model", "tok_emb.weight");
  EXPECT_EQ(weight.sizes(), (std::vector<int64_t>{256, 4}));
  const auto moment = checkpoint::read_full_tensor(dir, "optimizer", "tok_emb.weight.exp_avg");
  EXPECT_EQ(moment.sizes(), weight.sizes());
  for (const auto& f : checkpoint::verify(dir)) EXPECT_TRUE(f.ok) << f.problem;
}

TEST(ParserFindings, CheckpointIndexFieldMissingOrMistypedIsAnErrorNamingIt) {
  struct Case {
    std::function<void(json&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](json& i) { i["model"]["tok_emb.weight"]["shards"][0].erase("rows"); },
       "model.tok_emb.weight.shards[0].rows"},
      {[](json& i) { i["model"]["tok_emb.weight"]["shards"][0]["row_offset"] = "0"; },
       "model.tok_emb.weight.shards[0].row_offset"},
      {[](json& i) { i["model"]["tok_emb.weight"]["shards"][0]["file"] = "../index.json"; },
       "model.tok_emb.weight.shards[0].file"},
      {[](json& i) { i["files"]["model_rank0.safetensors"]["crc32"] = -1; },
       "files.model_rank0.safetensors.crc32"},
      {[](json& i) { i["optimizer"]["state"]["tok_emb.weight"].erase("step"); },
       "optimizer.state.tok_emb.weight.step"},
      {[](json& i) {
         i["scheduler"] = {{"last_step", "1"}};
       },
       "scheduler.last_step"},
      {[](json& i) { i["rng"][0] = 0; }, "rng[0].file"},
  };
  for (const auto& c : cases) {
    const std::string dir = checkpoint_with_index("pf-index-field", c.edit);
    expect_error_naming<std::runtime_error>(
        [&] { checkpoint::read_full_tensor(dir, "model", "tok_emb.weight"); },
        {dir + "/index.json", c.field});
  }
}

TEST(ParserFindings, CheckpointTensorLargerThanItsFilesIsAnErrorBeforeAllocating) {
  // 2^40 x 4 floats: 16 TiB, from a 10 KB file.
  const std::string dir = checkpoint_with_index("pf-index-huge", [](json& i) {
    i["model"]["tok_emb.weight"]["shape"] = {int64_t{1} << 40, 4};
  });
  expect_error_naming<std::runtime_error>(
      [&] { checkpoint::read_full_tensor(dir, "model", "tok_emb.weight"); },
      {dir, "'tok_emb.weight'", "more than its shard files hold"});
}

TEST(ParserFindings, CheckpointRowsOfAnotherSizeThanTheFilesAreAnError) {
  // The file holds 256 x 4 floats; the index claims 256 x 2 doubles (as many bytes), so the rows
  // are converted, and would be viewed as rows of 2.
  const std::string dir = checkpoint_with_index("pf-index-rows", [](json& i) {
    i["model"]["tok_emb.weight"]["shape"] = {256, 2};
    i["model"]["tok_emb.weight"]["dtype"] = "F64";
  });
  expect_error_naming<std::runtime_error>(
      [&] { checkpoint::read_full_tensor(dir, "model", "tok_emb.weight"); },
      {dir, "'tok_emb.weight'", "rows of 4 elements"});
}

// ---- GGUF --------------------------------------------------------------------------------------

// A GGUF v3 file with no tensors and one metadata value of `type` (raw bytes).
std::string gguf_with(const std::string& key, uint32_t type, const std::string& value) {
  std::string out = "GGUF";
  auto put = [&](auto v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(uint32_t{3});
  put(uint64_t{0});  // tensors
  put(uint64_t{1});  // metadata
  put(static_cast<uint64_t>(key.size()));
  out += key;
  put(type);
  return out + value;
}

TEST(ParserFindings, GgufNonUtf8AlignmentIsAnErrorNamingIt) {
  const std::string path = make_temp_dir("pf-gguf-align") + "/a.gguf";
  const uint64_t length = 1;
  write_bytes(path, gguf_with("general.alignment", 8,
                              std::string(reinterpret_cast<const char*>(&length), 8) + "\xff"));
  expect_error_naming<std::invalid_argument>([&] { checkpoint::GgufFile gguf(path); },
                                             {path, "general.alignment"});
}

// ---- YAML config -------------------------------------------------------------------------------

const json kDefaults = {{"trainer", {{"task", "lm_pretrain"}, {"total_training_steps", 100}}},
                        {"data", nullptr}};

std::string config_file(const std::string& tag, const std::string& text) {
  const std::string path = make_temp_dir(tag) + "/config.yaml";
  write_bytes(path, text);
  return path;
}

TEST(ParserFindings, YamlConfigNotUtf8IsAnErrorNamingTheFile) {
  const std::string path = config_file("pf-yaml-utf8", "trainer:\n  task: lm\xff\n");
  expect_error_naming<std::invalid_argument>([&] { trainer::load_config(path, {}, kDefaults); },
                                             {path, "line 2", "UTF-8"});
}

TEST(ParserFindings, YamlConfigAliasesExpandBounded) {
  // Five levels of ten aliases: a million nodes from 300 bytes.
  std::string bomb = "data:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int level = 1; level <= 5; ++level) {
    const std::string prev = "*a" + std::to_string(level - 1);
    bomb += "  a" + std::to_string(level) + ": &a" + std::to_string(level) + " [";
    for (int i = 0; i < 10; ++i) bomb += (i ? ", " : "") + prev;
    bomb += "]\n";
  }
  const std::string path = config_file("pf-yaml-bomb", bomb);
  expect_error_naming<std::invalid_argument>([&] { trainer::load_config(path, {}, kDefaults); },
                                             {path, "aliases expand to too many nodes"});
  // A few aliases, as a config uses them, still expand.
  const std::string reuse =
      config_file("pf-yaml-alias", "data:\n  a: &betas [0.9, 0.95]\n  b: *betas\n");
  EXPECT_EQ(trainer::load_config(reuse, {}, kDefaults)["data"]["b"], json({0.9, 0.95}));
}

TEST(ParserFindings, YamlConfigEmptySectionKeepsItsDefaults) {
  const std::string path = config_file("pf-yaml-empty", "trainer:\n  # task: arithmetic\n");
  const json config = trainer::load_config(path, {}, kDefaults);
  EXPECT_EQ(trainer::get<std::string>(config, "trainer.task"), "lm_pretrain");
  EXPECT_EQ(trainer::get<int64_t>(config, "trainer.total_training_steps"), 100);
}

TEST(ParserFindings, YamlConfigNullOverAValueIsAnErrorNamingTheKey) {
  const std::string path = config_file("pf-yaml-null", "trainer:\n  total_training_steps:\n");
  expect_error_naming<std::invalid_argument>([&] { trainer::load_config(path, {}, kDefaults); },
                                             {path, "'trainer.total_training_steps'", "null"});
}

// ---- a model folder's config.json -------------------------------------------------------------

// A config.json of this text in a fresh folder; returns its path.
std::string model_file(const std::string& tag, const std::string& name, const std::string& text) {
  const std::string path = make_temp_dir(tag) + "/" + name;
  write_bytes(path, text);
  return path;
}

constexpr const char* kLlamaConfig = R"({"model_type": "llama", "vocab_size": 64,
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2})";

TEST(ParserFindings, ModelConfigErrorsNameTheFile) {
  // LlamaConfig::load said "config.json: missing field vocab_size": which folder's, it did not say.
  const std::string llama =
      model_file("pf-config-llama", "config.json", R"({"model_type": "qwen2"})");
  expect_error_naming<std::invalid_argument>([&] { models::LlamaConfig::load(llama); },
                                             {llama, "vocab_size"});
  const std::string sd3 = model_file("pf-config-sd3", "config.json", R"({"patch_size": 0})");
  expect_error_naming<std::invalid_argument>([&] { models::SD3Config::load(sd3); },
                                             {sd3, "patch_size"});
  const std::string bert = model_file("pf-config-bert", "config.json", R"({"hidden_act": 1})");
  expect_error_naming<std::invalid_argument>([&] { models::BertConfig::load(bert); },
                                             {bert, "vocab_size"});
  // The seed reads.
  const std::string good = model_file("pf-config-good", "config.json", kLlamaConfig);
  EXPECT_EQ(models::LlamaConfig::load(good).num_key_value_heads, 2);
}

TEST(ParserFindings, ModelConfigNumberOutsideItsTypeIsAnErrorNamingTheField) {
  // get<int64_t>() of 1e30 was undefined behaviour (UBSan), of 2.5 a silent 2.
  for (const std::string value : {"1e30", "2.5", "-1e300", "18446744073709551615"}) {
    json config = json::parse(kLlamaConfig);
    config["hidden_size"] = json::parse(value);
    const std::string path = model_file("pf-config-float", "config.json", config.dump());
    expect_error_naming<std::invalid_argument>([&] { models::LlamaConfig::load(path); },
                                               {path, "hidden_size", "wrong type"});
  }
  const std::string sd3 =
      model_file("pf-config-sd3-float", "config.json", R"({"dual_attention_layers": [0, 1e30]})");
  expect_error_naming<std::invalid_argument>([&] { models::SD3Config::load(sd3); },
                                             {sd3, "dual_attention_layers", "wrong type"});
  // An integral float is the integer it writes.
  json config = json::parse(kLlamaConfig);
  config["hidden_size"] = 16.0;
  EXPECT_EQ(models::LlamaConfig::load(model_file("pf-config-16", "config.json", config.dump()))
                .hidden_size,
            16);
}

TEST(ParserFindings, LlamaConfigZeroHeadsIsAnErrorNotADivisionByZero) {
  // from_json computed head_dim() = hidden_size / num_attention_heads before validate() checked
  // the divisor (UBSan; SIGFPE without it). Found by fuzz_config_json after 334,664 inputs.
  json config = json::parse(kLlamaConfig);
  config["num_attention_heads"] = 0;
  const std::string path = model_file("pf-config-heads", "config.json", config.dump());
  expect_error_naming<std::invalid_argument>([&] { models::LlamaConfig::load(path); },
                                             {path, "num_attention_heads", "positive"});
}

TEST(ParserFindings, Sd3ConfigHeadsTimesHeadDimOverflowIsAnErrorNamingThem) {
  // num_attention_heads * attention_head_dim overflowed int64 (UBSan) in validate().
  const std::string path = model_file("pf-config-sd3-overflow", "config.json",
                                      R"({"num_attention_heads": 4611686018427387904,
                                          "attention_head_dim": 4})");
  expect_error_naming<std::invalid_argument>([&] { models::SD3Config::load(path); },
                                             {path, "num_attention_heads", "attention_head_dim"});
}

// ---- tokenizer.json ----------------------------------------------------------------------------

// The small byte-level BPE tokenizer.json that transformers wrote (fuzz/corpus), edited.
std::string tokenizer_json(const std::string& tag, const std::function<void(json&)>& edit) {
  json file = json::parse(
      read_text(std::string(SHARDRL_SOURCE_DIR) + "/fuzz/corpus/tokenizer_json/bpe.json"));
  edit(file);
  return model_file(tag, "tokenizer.json", file.dump());
}

TEST(ParserFindings, TokenizerJsonSeedLoadsAndRoundTrips) {
  const auto tok =
      text::ByteLevelBpeTokenizer::load_tokenizer_json(tokenizer_json("pf-tok", [](json&) {}));
  const std::string text = "Hello world, na\xc3\xafve caf\xc3\xa9 \xff!";
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

TEST(ParserFindings, TokenizerJsonIdBeyondTheTokensIsAnErrorBeforeAllocating) {
  // A vocab or added-token id of 10^12 resized the token table to 10^12 strings (32 TB).
  const std::string vocab = tokenizer_json(
      "pf-tok-vocab-id", [](json& f) { f["model"]["vocab"]["zzz"] = int64_t{1000000000000}; });
  expect_error_naming<std::invalid_argument>(
      [&] { text::ByteLevelBpeTokenizer::load_tokenizer_json(vocab); },
      {vocab, "model.vocab entry 'zzz'", "1000000000000"});
  const std::string added = tokenizer_json(
      "pf-tok-added-id", [](json& f) { f["added_tokens"][0]["id"] = int64_t{1000000000000}; });
  expect_error_naming<std::invalid_argument>(
      [&] { text::ByteLevelBpeTokenizer::load_tokenizer_json(added); },
      {added, "added token '<|endoftext|>'", "1000000000000"});
}

TEST(ParserFindings, TokenizerJsonMistypedFlagIsAnErrorNamingTheField) {
  // nlohmann's value() threw its own type_error, naming no file.
  const std::string special =
      tokenizer_json("pf-tok-special", [](json& f) { f["added_tokens"][1]["special"] = "yes"; });
  expect_error_naming<std::invalid_argument>(
      [&] { text::ByteLevelBpeTokenizer::load_tokenizer_json(special); },
      {special, "added_tokens[1].special", "boolean"});
  const std::string type = tokenizer_json("pf-tok-type", [](json& f) { f["model"]["type"] = 1; });
  expect_error_naming<std::invalid_argument>(
      [&] { text::ByteLevelBpeTokenizer::load_tokenizer_json(type); }, {type, "model.type"});
}

TEST(ParserFindings, TokenizerJsonMergeOutsideTheVocabularyIsAnErrorNamingIt) {
  // encode() failed later with "merged token 'Ġt' is not in the vocabulary", naming no file;
  // tokenizers refuses such a file when it loads it.
  std::string merged;
  const std::string path = tokenizer_json("pf-tok-merge", [&](json& f) {
    const json merge = f["model"]["merges"][0];
    merged = merge[0].get<std::string>() + merge[1].get<std::string>();
    const json id = f["model"]["vocab"][merged];
    f["model"]["vocab"].erase(merged);
    f["model"]["vocab"]["renamed"] = id;
  });
  expect_error_naming<std::invalid_argument>(
      [&] { text::ByteLevelBpeTokenizer::load_tokenizer_json(path); },
      {path, "merges[0]", "'" + merged + "' is not in the vocabulary"});
}

TEST(ParserFindings, TokenizerJsonByteMissingFromTheVocabularyIsDroppedAsTokenizersDropsIt) {
  // A vocabulary without 'Ġ' (the space byte) made encode() fail on any text with a space,
  // naming no file. tokenizers (no unk_token) drops the byte and merges across the gap.
  const std::string path = tokenizer_json("pf-tok-byte", [](json& f) {
    const json id = f["model"]["vocab"]["\xc4\xa0"];
    f["model"]["vocab"].erase("\xc4\xa0");
    f["model"]["vocab"]["renamed"] = id;
    json kept = json::array();
    for (const auto& merge : f["model"]["merges"]) {
      const std::string pair = merge[0].get<std::string>() + merge[1].get<std::string>();
      if (pair.find("\xc4\xa0") == std::string::npos) kept.push_back(merge);
    }
    f["model"]["merges"] = kept;
  });
  const auto tok = text::ByteLevelBpeTokenizer::load_tokenizer_json(path);
  EXPECT_EQ(tok.decode(tok.encode("is a")), "isa");
  EXPECT_EQ(tok.encode("is a"), tok.encode("isa"));
}

// ---- vocab.txt and tokenizer_config.json -------------------------------------------------------

TEST(ParserFindings, WordPieceEmptySpecialTokenIsAnErrorNotAHang) {
  // pad_token "" with a blank line in vocab.txt: encode() matched the empty special token at
  // every position without advancing, forever.
  const std::string dir = make_temp_dir("pf-wordpiece-empty");
  const std::string data = std::string(SHARDRL_SOURCE_DIR) + "/fuzz/data/wordpiece/";
  write_bytes(dir + "/vocab.txt", read_text(data + "vocab.txt") + "\n");
  json config = json::parse(read_text(data + "tokenizer_config.json"));
  config["pad_token"] = "";
  write_bytes(dir + "/tokenizer_config.json", config.dump());
  expect_error_naming<std::invalid_argument>(
      [&] { text::WordPieceTokenizer::load(dir); },
      {dir + "/tokenizer_config.json", "pad_token", "empty"});
}

// ---- adapter_config.json -----------------------------------------------------------------------

// PEFT's adapter_config.json for a small LLaMA (fuzz/corpus), edited.
std::string adapter_config(const std::string& tag, const std::function<void(json&)>& edit) {
  json file = json::parse(
      read_text(std::string(SHARDRL_SOURCE_DIR) + "/fuzz/corpus/adapter_config/lora.json"));
  edit(file);
  return model_file(tag, "adapter_config.json", file.dump());
}

TEST(ParserFindings, AdapterConfigSeedReads) {
  const auto config = models::lora::read_peft_config(adapter_config("pf-lora", [](json&) {}));
  EXPECT_EQ(config.r, 4);
  EXPECT_DOUBLE_EQ(config.scaling(), 2.0);
  EXPECT_TRUE(models::lora::is_target(config, "model.layers.0.self_attn.v_proj"));
  EXPECT_FALSE(models::lora::is_target(config, "model.layers.0.self_attn.k_proj"));
}

TEST(ParserFindings, AdapterConfigMistypedIsAnErrorNamingTheField) {
  const std::string array = model_file("pf-lora-array", "adapter_config.json", "[]");
  expect_error_naming<std::invalid_argument>([&] { models::lora::read_peft_config(array); },
                                             {array, "JSON object"});
  const std::string type = adapter_config("pf-lora-type", [](json& f) { f["peft_type"] = 1; });
  expect_error_naming<std::invalid_argument>([&] { models::lora::read_peft_config(type); },
                                             {type, "peft_type"});
  // get<int64_t>() of 1e30 was undefined behaviour (UBSan).
  const std::string r = adapter_config("pf-lora-r", [](json& f) { f["r"] = 1e30; });
  expect_error_naming<std::invalid_argument>([&] { models::lora::read_peft_config(r); },
                                             {r, "field r"});
  const std::string dropout =
      adapter_config("pf-lora-dropout", [](json& f) { f["lora_dropout"] = 1.5; });
  expect_error_naming<std::invalid_argument>([&] { models::lora::read_peft_config(dropout); },
                                             {dropout, "lora_dropout"});
}

TEST(ParserFindings, AdapterConfigBadRegexIsAnErrorNamingTheField) {
  // std::regex_error escaped from the first match, naming neither file nor field.
  const std::string path =
      adapter_config("pf-lora-regex", [](json& f) { f["target_modules"] = "(q_proj"; });
  expect_error_naming<std::invalid_argument>([&] { models::lora::read_peft_config(path); },
                                             {path, "target_modules", "regular expression"});
}

TEST(ParserFindings, AdapterConfigRegexMatchesInPolynomialTime) {
  // The backtracking matcher took longer than libFuzzer's 10 s timeout on each module name.
  const std::string path = adapter_config(
      "pf-lora-slow", [](json& f) { f["target_modules"] = "(.*)*(.*)*(.*)*(.*)*(.*)*x"; });
  const auto config = models::lora::read_peft_config(path);
  for (int layer = 0; layer < 30; ++layer) {
    EXPECT_FALSE(models::lora::is_target(
        config, "model.layers." + std::to_string(layer) + ".self_attn.q_proj_and_more_text"));
  }
  const std::string peft = adapter_config("pf-lora-peft-regex", [](json& f) {
    f["target_modules"] = R"(.*\.layers\.0\.self_attn\.(q|v)_proj)";
  });
  EXPECT_TRUE(models::lora::is_target(models::lora::read_peft_config(peft),
                                      "model.layers.0.self_attn.v_proj"));
}

TEST(ParserFindings, AdapterConfigFieldsShardRLDoesNotImplementAreRefused) {
  // Read as plain LoRA before: a rsLoRA adapter got alpha / r for alpha / sqrt(r), a DoRA one
  // lost its magnitudes, and so on, silently.
  const std::vector<std::pair<std::string, json>> cases = {{"use_rslora", true},
                                                           {"use_dora", true},
                                                           {"rank_pattern", {{"q_proj", 8}}},
                                                           {"bias", "all"},
                                                           {"modules_to_save", {"lm_head"}},
                                                           {"layers_to_transform", {0}}};
  for (const auto& item : cases) {
    const std::string& field = item.first;  // clang before 16 cannot capture a structured binding
    const std::string path =
        adapter_config("pf-lora-" + field, [&](json& f) { f[field] = item.second; });
    expect_error_naming<std::invalid_argument>([&] { models::lora::read_peft_config(path); },
                                               {path, "field " + field});
  }
  // PEFT's empty defaults are plain LoRA.
  const std::string empty = adapter_config("pf-lora-empty", [](json& f) {
    f["modules_to_save"] = json::array();
    f["exclude_modules"] = json::array();
  });
  EXPECT_EQ(models::lora::read_peft_config(empty).r, 4);
}

// ---- model.safetensors.index.json --------------------------------------------------------------

TEST(ParserFindings, HfIndexFileNameMustBeAFileInTheFolder) {
  // "." and ".." passed the check for a plain file name (no parent path).
  for (const std::string name : {"..", "."}) {
    const std::string dir = make_temp_dir("pf-hf-index");
    write_bytes(dir + "/model.safetensors.index.json",
                json({{"weight_map", {{"w", name}}}}).dump());
    expect_error_naming<std::runtime_error>([&] { checkpoint::HfWeights weights(dir); },
                                            {dir, "weight_map.w", "not a file name"});
  }
}

}  // namespace
}  // namespace shardrl::testing
