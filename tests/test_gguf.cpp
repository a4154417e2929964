// `shardrl import` of llama.cpp GGUF files, through the CLI as a user runs it: tiny models written
// by the gguf library in every type ShardRL reads import to gguf-py's dequantization bit for bit
// and run as transformers runs the GGUF; damaged files are errors naming the file and what is at
// fault; the real SmolLM2-135M-Instruct Q4_1 answers as transformers does on the GGUF
// (tests/python/gguf_reference.py holds the references).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string gguf_reference_script() {
  return std::string(SHARDRL_SOURCE_DIR "/tests/python/gguf_reference.py");
}

// Every process here, the reference script and the `shardrl generate` runs it starts included:
// no Hub, and one compute thread (as ctest gives), since a second one on a busy two-core machine
// makes torch several times slower.
const std::map<std::string, std::string> kEnv = {{"HF_HUB_OFFLINE", "1"}, {"OMP_NUM_THREADS", "1"}};

// The first line of `output` that starts with `{"key"`, parsed.
json json_line(const std::string& output, const std::string& key) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("{\"" + key + "\"", 0) == 0) return json::parse(line);
  }
  ADD_FAILURE() << "no {\"" << key << "\": ...} line in:\n" << output;
  return json::object();
}

// `shardrl import` of a file it must refuse: a clean error (the CLI's exit status 2, not a signal
// or an abort) that names the file and each of `names`, and no model folder left behind.
void expect_import_refused(const std::string& gguf, const std::string& out_dir,
                           const std::vector<std::string>& names) {
  const auto result = run_process({bin("shardrl"), "import", gguf, out_dir}, kEnv);
  EXPECT_EQ(result.exit_code, 2) << gguf << ":\n" << result.output;
  EXPECT_NE(result.output.find("shardrl: GGUF " + gguf + ": "), std::string::npos) << result.output;
  for (const auto& name : names) {
    EXPECT_NE(result.output.find(name), std::string::npos)
        << "the error does not name " << name << ":\n"
        << result.output;
  }
  EXPECT_FALSE(fs::exists(fs::path(out_dir) / "config.json")) << out_dir;
}

// F32, F16, BF16, Q8_0, Q4_0 and Q4_1 files (GQA, tied and untied embeddings, attention biases):
// every tensor is gguf-py's dequantization with llama.cpp's q/k permutation undone, config.json
// is transformers' config of the GGUF, and transformers on the GGUF, transformers on the import
// and `shardrl generate` on the import give the same logits and greedy tokens; the tokenizer and
// the chat template (--chat) render as transformers' reading of the GGUF.
TEST(Gguf, SyntheticFilesOfEveryTypeImportExactly) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"gguf", "numpy", "torch", "safetensors", "transformers"}));
  expect_checks_pass(run_process({SHARDRL_PYTHON, gguf_reference_script(), "synthetic",
                                  bin("shardrl"), make_temp_dir("gguf-synthetic")},
                                 kEnv, 600),
                     43);
}

// A type ShardRL does not dequantize, a tensor left out, and metadata that disagrees with the
// tensors' shapes: each an error naming the tensor and the metadata key as the file has them.
TEST(Gguf, ImportNamesTheTensorOrFieldAtFault) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"gguf", "numpy", "torch", "safetensors", "transformers"}));
  const std::string dir = make_temp_dir("gguf-broken");
  const auto written = run_process({SHARDRL_PYTHON, gguf_reference_script(), "broken", dir}, kEnv);
  ASSERT_EQ(written.exit_code, 0) << written.output;
  const auto good =
      run_process({bin("shardrl"), "import", dir + "/good.gguf", dir + "/good"}, kEnv);
  ASSERT_EQ(good.exit_code, 0) << "the faults below are the only ones:\n" << good.output;

  const std::vector<std::pair<std::string, std::vector<std::string>>> faults = {
      {"q5_0", {"'blk.0.attn_v.weight'", "Q5_0"}},
      {"q6_k", {"'blk.1.ffn_down.weight'", "Q6_K"}},
      {"missing", {"'blk.1.ffn_down.weight'", "missing"}},
      // Only the key changed: the head size it implies disagrees with llama.rope.dimension_count.
      {"embedding_length", {"'llama.embedding_length'"}},
      {"head_count", {"'llama.attention.head_count'"}},
      // The key and rope.dimension_count changed together: the tensors disagree.
      {"embedding_length_and_rope", {"'llama.embedding_length'", "'token_embd.weight'"}},
      // Fewer rows per head for the same K projection: its tensor is named.
      {"head_count_and_rope", {"'blk.0.attn_k.weight'"}},
      {"head_count_kv", {"'llama.attention.head_count_kv'", "'blk.0.attn_k.weight'"}},
      {"feed_forward_length", {"'llama.feed_forward_length'", "'blk.0.ffn_gate.weight'"}},
      {"block_count", {"'llama.block_count'"}},
      {"vocab_size", {"'llama.vocab_size'", "'token_embd.weight'"}},
  };
  for (const auto& [fault, names] : faults) {
    SCOPED_TRACE(fault);
    expect_import_refused(dir + "/" + fault + ".gguf", dir + "/out-" + fault, names);
  }

  // Over an earlier import, a file refused halfway through its tensors (blk.0 reads, blk.1 does
  // not) leaves that import as it was, and no staging folder.
  const auto contents = [](const std::string& folder) {
    std::map<std::string, std::string> files;
    for (const auto& entry : fs::directory_iterator(folder)) {
      std::ifstream in(entry.path(), std::ios::binary);
      files[entry.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
    return files;
  };
  const auto before = contents(dir + "/good");
  const auto over =
      run_process({bin("shardrl"), "import", dir + "/q6_k.gguf", dir + "/good"}, kEnv);
  EXPECT_EQ(over.exit_code, 2) << over.output;
  EXPECT_TRUE(contents(dir + "/good") == before) << "the earlier import changed";
  EXPECT_FALSE(fs::exists(dir + "/good.tmp-import"));
}

// A GGUF cut short anywhere (in the header, the metadata, the tensor table, the tensor data, and
// at points spread over the whole file) is an error naming the file, never a crash.
TEST(Gguf, TruncatedFileIsAnErrorNamingIt) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"gguf", "numpy", "torch", "safetensors", "transformers"}));
  const std::string dir = make_temp_dir("gguf-truncated");
  const auto written = run_process({SHARDRL_PYTHON, gguf_reference_script(), "broken", dir}, kEnv);
  ASSERT_EQ(written.exit_code, 0) << written.output;
  const json regions = json_line(written.output, "cuts");
  const int64_t size = regions.value("size", int64_t{0});
  ASSERT_GT(size, 0) << written.output;

  std::vector<std::pair<std::string, int64_t>> cuts;
  for (const auto& [region, offset] : regions["cuts"].items()) {
    cuts.emplace_back(region, offset.get<int64_t>());
  }
  ASSERT_EQ(cuts.size(), 5u) << regions.dump();
  for (int64_t at : {0, 1, 4, 7, 8, 16, 20, 23, 24, 25}) cuts.emplace_back("start", at);
  constexpr int kSpread = 24;
  for (int i = 1; i < kSpread; ++i) cuts.emplace_back("spread", size * i / kSpread);

  for (const auto& [region, at] : cuts) {
    SCOPED_TRACE(region + " at " + std::to_string(at));
    ASSERT_LT(at, size);
    const std::string cut = dir + "/cut-" + std::to_string(at) + ".gguf";
    fs::copy_file(dir + "/good.gguf", cut, fs::copy_options::overwrite_existing);
    fs::resize_file(cut, static_cast<uintmax_t>(at));
    expect_import_refused(cut, dir + "/out-" + std::to_string(at), {});
  }
}

// The real model: its import answers the chat as transformers does on the GGUF (logits within
// 1e-4 relative, 20 greedy tokens, the chat template with and without a system message), and
// transformers loads the import with the GGUF's logits and tokenizer.
TEST(Gguf, SmolLM2ImportAnswersAsTransformersOnTheGguf) {
  SHARDRL_REQUIRE_DEPENDENCY(
      missing_python_modules({"gguf", "numpy", "torch", "safetensors", "transformers"}));
  SHARDRL_REQUIRE_DEPENDENCY(missing_smollm2_gguf());
  const std::string gguf = smollm2_gguf();
  ASSERT_TRUE(fs::exists(gguf));
  const std::string dir = make_temp_dir("gguf-smollm2") + "/import";

  const auto imported = run_process({bin("shardrl"), "import", gguf, dir}, kEnv);
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  const auto chat = run_process(
      {bin("shardrl"), "generate", dir, "--chat", "What is the capital of France?"}, kEnv);
  EXPECT_EQ(chat.exit_code, 0) << chat.output;
  EXPECT_NE(chat.output.find("Paris"), std::string::npos) << chat.output;

  const auto checked = run_process(
      {SHARDRL_PYTHON, gguf_reference_script(), "smollm2", bin("shardrl"), gguf, dir}, kEnv, 600);
  expect_checks_pass(checked, 14);
  std::cout << "SmolLM2: shardrl import " << imported.seconds << " s, generate --chat "
            << chat.seconds << " s, references " << checked.seconds << " s "
            << json_line(checked.output, "timing").dump() << "\n";
}

}  // namespace
}  // namespace shardrl::testing
