// Checkpoints with real ranks: resume equals uninterrupted training (bitwise at the same world
// size, to 1e-6 when resharded), damage is detected and named, rotation holds its limits, and the
// export reads back with an independent reader.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include <zlib.h>

#include "checkpoint/io.h"
#include "shardrl/checkpoint.h"
#include "test_util.h"
#include "workers/param_files.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct CkptRun {
  int exit_code = -1;
  std::string output;
  int64_t start = -1;
  std::vector<double> loss, lr, rng;
  std::map<std::string, torch::Tensor> params;
};

// Every run trains the test transformer with unused params (which never get optimizer state).
CkptRun run_train(int nproc, const std::string& root, const std::vector<std::string>& extra,
                  bool expect_success = true) {
  const std::string out = make_temp_dir("ckpt-out");
  std::vector<std::string> args = {"train", "--root", root, "--out", out, "--unused-params"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto result = launch_workers(nproc, args, 300, "ckpt_worker");
  CkptRun run;
  run.exit_code = result.exit_code;
  run.output = result.output;
  if (expect_success) {
    EXPECT_EQ(result.exit_code, 0) << result.output;
  }
  if (result.exit_code != 0) return run;
  auto summary = json::parse(std::ifstream(out + "/losses.json"));
  run.start = summary["start"].get<int64_t>();
  run.loss = summary["loss"].get<std::vector<double>>();
  run.lr = summary["lr"].get<std::vector<double>>();
  run.rng = summary["rng"].get<std::vector<double>>();
  run.params = read_params(out);
  return run;
}

double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).norm() /
          b.to(torch::kDouble).norm().clamp_min(1e-30))
      .item<double>();
}

std::vector<std::string> save_at(std::initializer_list<int> steps) {
  std::vector<std::string> args = {"--save-at"};
  for (int s : steps) args.push_back(std::to_string(s));
  return args;
}

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Moments, steps and scheduler of two checkpoints agree: exactly at tolerance 0.
void expect_same_optimizer(const std::string& a, const std::string& b, double tolerance) {
  const json ia = checkpoint::read_index(a), ib = checkpoint::read_index(b);
  EXPECT_EQ(ia["scheduler"], ib["scheduler"]);
  const json& sa = ia["optimizer"]["state"];
  const json& sb = ib["optimizer"]["state"];
  ASSERT_EQ(sa.size(), sb.size());
  ASSERT_GT(sa.size(), 0u);
  for (const auto& [name, state] : sa.items()) {
    ASSERT_TRUE(sb.contains(name)) << name;
    EXPECT_EQ(state["step"], sb[name]["step"]) << name;
    for (const std::string moment : {"exp_avg", "exp_avg_sq"}) {
      auto ta = checkpoint::read_full_tensor(a, "optimizer", name + "." + moment);
      auto tb = checkpoint::read_full_tensor(b, "optimizer", name + "." + moment);
      ASSERT_EQ(ta.sizes(), tb.sizes()) << name;
      if (tolerance == 0) {
        EXPECT_TRUE(torch::equal(ta, tb)) << name << "." << moment;
      } else {
        EXPECT_LE(relative_error(tb, ta), tolerance) << name << "." << moment;
      }
    }
  }
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Safetensors, RoundTripsDtypesAndReadsRowRanges) {
  const std::string dir = make_temp_dir("st");
  const std::string path = dir + "/t.safetensors";
  std::map<std::string, torch::Tensor> tensors = {
      {"a.f32", torch::randn({3, 4})},
      {"b.bf16", torch::randn({5}).to(torch::kBFloat16)},
      {"c.f16", torch::randn({2, 2}).to(torch::kHalf)},
      {"d.i64", torch::tensor({1, -2, 3}, torch::kLong)},
      {"e.scalar", torch::tensor(2.5f)}};
  std::vector<checkpoint::TensorInfo> infos;
  for (const auto& [name, t] : tensors) infos.push_back({name, t.scalar_type(), t.sizes().vec()});
  checkpoint::SafetensorsWriter writer(path, infos, {{"format", "pt"}});
  for (const auto& [name, t] : tensors) writer.write(name, t);
  const auto summary = writer.close();
  EXPECT_EQ(summary.bytes, static_cast<int64_t>(fs::file_size(path)));
  EXPECT_EQ(summary.crc32, checkpoint::file_crc32(path));

  checkpoint::SafetensorsReader reader(path);
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  // The header is padded so the data section starts 8-byte aligned.
  EXPECT_EQ(reader.info(reader.names().front()).offset % 8, 0);
  for (const auto& [name, t] : tensors) EXPECT_TRUE(torch::equal(reader.read(name), t)) << name;
  EXPECT_TRUE(torch::equal(reader.read_rows("a.f32", 1, 2), tensors["a.f32"].narrow(0, 1, 2)));
  EXPECT_THROW(reader.read_rows("a.f32", 2, 2), std::out_of_range);
  EXPECT_THROW(reader.read("missing"), std::runtime_error);
  EXPECT_THROW(checkpoint::SafetensorsWriter(dir + "/x.safetensors", infos)
                   .write("b.bf16", tensors["b.bf16"]),
               std::logic_error);
}

// Loads verify the bytes they read, in the same pass: a damaged byte fails exactly the reads
// whose blocks hold it, whether they read the block whole or in part, and the header is checked.
// Checkpoints store zlib's crc32 whichever library computes it (ISA-L when the build found it):
// the same values in one call and in pieces, so checkpoints of either build load in the other.
TEST(Safetensors, Crc32IsZlibsInOneCallAndInPieces) {
  auto bytes = torch::randint(256, {(5 << 20) + 77}, torch::kUInt8);
  const auto* data = bytes.data_ptr<uint8_t>();
  const int64_t n = bytes.numel();
  const uint32_t zlib = static_cast<uint32_t>(::crc32(0, data, static_cast<uInt>(n)));
  EXPECT_EQ(checkpoint::crc32_update(0, data, n), zlib);
  uint32_t pieces = 0;
  for (int64_t done = 0, step = 1; done < n; done += step, step = step * 3 + 1) {
    pieces = checkpoint::crc32_update(pieces, data + done, std::min(step, n - done));
  }
  EXPECT_EQ(pieces, zlib);
  EXPECT_EQ(checkpoint::crc32_update(0, data, 0), 0u);
}

TEST(Safetensors, BlockChecksumsVerifyExactlyTheBytesRead) {
  const std::string dir = make_temp_dir("st-blocks");
  const std::string path = dir + "/t.safetensors";
  const int64_t block = checkpoint::BlockChecksums::kDefaultBlockBytes;
  const int64_t rows = 3 * block / (64 * 4) + 5, cols = 64;  // a bit over three blocks
  const auto big = torch::randn({rows, cols});
  const auto tail = torch::arange(10, torch::kFloat);
  checkpoint::SafetensorsWriter writer(
      path, {{"big", torch::kFloat, {rows, cols}}, {"tail", torch::kFloat, {10}}});
  writer.write("big", big);
  writer.write("tail", tail);
  const auto summary = writer.close();
  ASSERT_EQ(summary.blocks.block_bytes, block);
  ASSERT_EQ(summary.blocks.crc32.size(), 4u);
  EXPECT_EQ(summary.crc32, checkpoint::file_crc32(path)) << "combined from the blocks";

  auto reader = [&] { return checkpoint::SafetensorsReader(path, summary.blocks); };
  EXPECT_TRUE(torch::equal(reader().read("big"), big));
  EXPECT_TRUE(torch::equal(reader().read_rows("big", 7, 3), big.narrow(0, 7, 3)));
  EXPECT_TRUE(torch::equal(reader().read("tail"), tail));

  // One flipped byte in the third block.
  const int64_t damaged_at = 2 * block + 100;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(damaged_at);
    const char c = static_cast<char>(f.get());
    f.seekp(damaged_at);
    f.put(static_cast<char>(c ^ 0x01));
  }
  const int64_t row_bytes = cols * 4, data_start = reader().info("big").offset;
  const int64_t damaged_row = (damaged_at - data_start) / row_bytes;
  EXPECT_TRUE(torch::equal(reader().read_rows("big", 0, 100), big.narrow(0, 0, 100)))
      << "the first block is intact";
  EXPECT_TRUE(torch::equal(reader().read("tail"), tail)) << "so is the last";
  for (auto [first, count] : std::vector<std::pair<int64_t, int64_t>>{
           {0, rows}, {damaged_row, 1}, {damaged_row - 3, 10}}) {
    try {
      reader().read_rows("big", first, count);
      ADD_FAILURE() << "rows " << first << "+" << count << " read the damaged byte unnoticed";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("checkpoint file " + path + " is damaged"),
                std::string::npos)
          << e.what();
    }
  }
  // A damaged header, and a file whose size no longer fits the checksums.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f.put(' ');
  }
  EXPECT_THROW(reader(), std::runtime_error);
  fs::resize_file(path, block);
  EXPECT_THROW(reader(), std::runtime_error);
}

TEST(Checkpoint, ResumeAtTheSameWorldSizeIsBitwise) {
  const std::string straight = make_temp_dir("ckpt-straight");
  const std::string resumed = make_temp_dir("ckpt-resumed");
  auto uninterrupted = run_train(2, straight, concat({"--end-step", "6"}, save_at({6})));
  auto first = run_train(2, resumed, concat({"--end-step", "3"}, save_at({3})));
  auto second = run_train(2, resumed, concat({"--resume", "--end-step", "6"}, save_at({6})));
  ASSERT_EQ(uninterrupted.loss.size(), 6u);
  ASSERT_EQ(first.loss.size(), 3u);
  ASSERT_EQ(second.loss.size(), 3u);
  EXPECT_EQ(second.start, 3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(first.loss[i], uninterrupted.loss[i]) << "step " << i;
    EXPECT_EQ(second.loss[i], uninterrupted.loss[3 + i]) << "step " << 3 + i;
    EXPECT_EQ(second.lr[i], uninterrupted.lr[3 + i]) << "lr after step " << 3 + i;
    EXPECT_EQ(second.rng[i], uninterrupted.rng[3 + i]) << "rng after step " << 3 + i;
  }
  ASSERT_EQ(second.params.size(), uninterrupted.params.size());
  for (const auto& [name, t] : uninterrupted.params)
    EXPECT_TRUE(torch::equal(second.params.at(name), t)) << name;
  expect_same_optimizer(straight + "/global_step_6", resumed + "/global_step_6", 0);
}

TEST(Checkpoint, SavedAtFourResumesAtTwoAndThree) {
  const std::string root4 = make_temp_dir("ckpt-n4");
  auto uninterrupted = run_train(4, root4, concat({"--end-step", "6"}, save_at({3, 6})));
  ASSERT_EQ(uninterrupted.loss.size(), 6u);
  for (int n : {2, 3}) {
    const std::string root = make_temp_dir("ckpt-resharded");
    auto run = run_train(
        n, root, concat({"--load", root4 + "/global_step_3", "--end-step", "6"}, save_at({6})));
    ASSERT_EQ(run.loss.size(), 3u) << n;
    EXPECT_EQ(run.start, 3);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(run.loss[i], uninterrupted.loss[3 + i], 1e-6 * uninterrupted.loss[3 + i])
          << "N=" << n << " step " << 3 + i;
      EXPECT_EQ(run.lr[i], uninterrupted.lr[3 + i]) << "N=" << n << " lr after step " << 3 + i;
      // Rank 0 restores the saved rank 0's generator.
      EXPECT_EQ(run.rng[i], uninterrupted.rng[3 + i]) << "N=" << n;
    }
    for (const auto& [name, t] : uninterrupted.params)
      EXPECT_LE(relative_error(run.params.at(name), t), 1e-6) << "N=" << n << " " << name;
    expect_same_optimizer(root4 + "/global_step_6", root + "/global_step_6", 1e-6);
    EXPECT_EQ(checkpoint::read_index(root + "/global_step_6")["world_size"], n);
  }
}

TEST(Checkpoint, HybridShardedSaveResumesOneDimensional) {
  // A 2 x 2 mesh: only the first replica writes shards; every rank writes its RNG state.
  const std::string hybrid = make_temp_dir("ckpt-hsdp");
  auto uninterrupted =
      run_train(4, hybrid, concat({"--fsdp-size", "2", "--end-step", "4"}, save_at({2, 4})));
  ASSERT_EQ(uninterrupted.loss.size(), 4u);
  const json index = checkpoint::read_index(hybrid + "/global_step_2");
  EXPECT_EQ(index["world_size"], 4);
  EXPECT_EQ(index["model"]["tok_emb.weight"]["shards"].size(), 2u);
  EXPECT_EQ(index["rng"].size(), 4u);
  const std::string root = make_temp_dir("ckpt-from-hsdp");
  auto run = run_train(
      3, root, concat({"--load", hybrid + "/global_step_2", "--end-step", "4"}, save_at({4})));
  ASSERT_EQ(run.loss.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(run.loss[i], uninterrupted.loss[2 + i], 1e-6 * uninterrupted.loss[2 + i]);
  for (const auto& [name, t] : uninterrupted.params)
    EXPECT_LE(relative_error(run.params.at(name), t), 1e-6) << name;
  expect_same_optimizer(hybrid + "/global_step_4", root + "/global_step_4", 1e-6);
}

// A rank killed while it writes step 6: global_step_3 stays the latest and whole, and the run
// resumes from it. Rank 1 killed: rank 0, the leader, sees the save fail and removes the partial
// files. Rank 0 killed: nobody is left to, and the next save clears them.
TEST(Checkpoint, KillDuringSaveLeavesThePreviousCheckpointLoadable) {
  for (const int die_rank : {1, 0}) {
    SCOPED_TRACE("rank " + std::to_string(die_rank) + " killed");
    const std::string root = make_temp_dir("ckpt-kill");
    auto killed = run_train(2, root,
                            concat({"--end-step", "6", "--die-rank", std::to_string(die_rank),
                                    "--die-save-step", "6", "--die-after-bytes", "1000"},
                                   save_at({3, 6})),
                            /*expect_success=*/false);
    ASSERT_NE(killed.exit_code, 0) << killed.output;
    EXPECT_NE(killed.output.find("dying during the save of step 6"), std::string::npos)
        << killed.output;
    EXPECT_EQ(fs::exists(root + "/.tmp-step-6"), die_rank == 0) << killed.output;
    EXPECT_FALSE(fs::exists(root + "/global_step_6"));
    EXPECT_EQ(checkpoint::find_latest(root), root + "/global_step_3");
    for (const auto& f : checkpoint::verify(root + "/global_step_3"))
      EXPECT_TRUE(f.ok) << f.problem;

    auto resumed = run_train(2, root, concat({"--resume", "--end-step", "6"}, save_at({6})));
    EXPECT_EQ(resumed.start, 3);
    EXPECT_EQ(resumed.loss.size(), 3u);
    EXPECT_FALSE(fs::exists(root + "/.tmp-step-6")) << "the next save clears the leftover";
    EXPECT_EQ(checkpoint::find_latest(root), root + "/global_step_6");
  }
}

TEST(Checkpoint, DamagedTruncatedOrMissingFilesAreNamed) {
  const std::string root = make_temp_dir("ckpt-damage");
  run_train(2, root, concat({"--end-step", "2"}, save_at({2})));
  const std::string good = root + "/global_step_2";
  auto load = [](const std::string& dir) {
    // A world of one: it reads every file of the two-rank checkpoint.
    return run_process({bin("ckpt_worker"), "load", "--unused-params", "--load", dir});
  };
  auto ok = load(good);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("step 2 saved at 2 ranks"), std::string::npos) << ok.output;

  struct Case {
    std::string file, expect;
    std::function<void(const std::string&)> damage;
  };
  const std::vector<Case> cases = {
      {"model_rank1.safetensors", "is damaged",
       [](const std::string& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(static_cast<std::streamoff>(fs::file_size(p) / 2));
         char c;
         f.get(c);
         f.seekp(static_cast<std::streamoff>(fs::file_size(p) / 2));
         f.put(static_cast<char>(c ^ 0x10));
       }},
      {"optim_rank0.safetensors", "is truncated",
       [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 2); }},
      {"model_rank0.safetensors", "is missing", [](const std::string& p) { fs::remove(p); }},
  };
  for (const auto& c : cases) {
    const std::string dir = make_temp_dir("ckpt-damaged") + "/global_step_2";
    fs::copy(good, dir, fs::copy_options::recursive);
    const std::string path = dir + "/" + c.file;
    c.damage(path);
    auto result = load(dir);
    EXPECT_NE(result.exit_code, 0) << c.file;
    EXPECT_NE(result.output.find("checkpoint file " + path + " " + c.expect), std::string::npos)
        << result.output;
    for (const auto& f : checkpoint::verify(dir)) EXPECT_EQ(f.ok, f.file != c.file) << f.file;
    auto inspect = run_process({bin("shardrl"), "inspect", dir});
    EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
    EXPECT_NE(inspect.output.find("checksums FAILED"), std::string::npos) << inspect.output;
  }
  std::ofstream(good + "/index.json", std::ios::trunc) << "{ not json";
  auto result = load(good);
  EXPECT_NE(result.output.find("checkpoint index " + good + "/index.json is damaged"),
            std::string::npos)
      << result.output;
}

// Every byte of a checkpoint is covered: a flipped bit in every 11th byte of index.json (most of
// which leave valid JSON) and in every byte of index.json.crc32 is an error of read_index naming
// the index, and find_damage names each shard file with a flip in every 4099th byte (samples: every
// file is under one crc32 whole). An index of version 1, saved before the checksum file, still
// reads without one.
TEST(Checkpoint, EveryByteIsCoveredByAChecksum) {
  const std::string root = make_temp_dir("ckpt-every-byte");
  run_train(2, root, concat({"--end-step", "2"}, save_at({2})));
  const std::string dir = root + "/global_step_2";
  ASSERT_EQ(checkpoint::find_damage(dir), "");
  auto index_problem = [&] {
    try {
      checkpoint::read_index(dir);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto flip_each = [&](const std::string& file, size_t stride, const std::string& named,
                       const std::function<std::string()>& problem_of) {
    const std::string path = dir + "/" + file;
    const std::string good = slurp(path);
    for (size_t at = 0; at < good.size(); at += stride) {
      std::string bad = good;
      bad[at] = static_cast<char>(bad[at] ^ (1 << (at % 8)));
      std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
      const std::string problem = problem_of();
      if (problem.find(dir + "/" + named) == std::string::npos) {
        ADD_FAILURE() << "a flip at byte " << at << " of " << file << ": '" << problem << "'";
        break;
      }
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << good;
  };
  flip_each("index.json", 11, "index.json", index_problem);
  flip_each("index.json.crc32", 1, "index.json", index_problem);
  for (const char* file : {"model_rank0.safetensors", "model_rank1.safetensors",
                           "optim_rank0.safetensors", "optim_rank1.safetensors"}) {
    flip_each(file, 4099, file, [&] { return checkpoint::find_damage(dir); });
  }
  ASSERT_EQ(checkpoint::find_damage(dir), "");

  json index = checkpoint::read_index(dir);
  index["version"] = 1;
  std::ofstream(dir + "/index.json", std::ios::trunc) << index.dump(1);
  EXPECT_NE(checkpoint::find_damage(dir), "") << "version 1 with a checksum file that differs";
  fs::remove(dir + "/index.json.crc32");
  EXPECT_EQ(checkpoint::find_damage(dir), "");
  EXPECT_EQ(checkpoint::read_index(dir)["step"], 2);
}

TEST(Checkpoint, RotationKeepsTheConfiguredCountAndSize) {
  auto remaining = [](const std::string& root) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(root)) names.insert(e.path().filename().string());
    return names;
  };
  const std::set<std::string> expected = {"global_step_4", "global_step_5", "latest"};
  const std::string by_count = make_temp_dir("ckpt-keep");
  run_train(1, by_count, concat({"--end-step", "5", "--keep", "2"}, save_at({1, 2, 3, 4, 5})));
  EXPECT_EQ(remaining(by_count), expected);
  EXPECT_EQ(slurp(by_count + "/latest"), "global_step_5\n");

  const int64_t one = checkpoint::directory_bytes(by_count + "/global_step_5");
  const double limit_bytes = 2.5 * static_cast<double>(one);
  const std::string by_size = make_temp_dir("ckpt-size");
  run_train(1, by_size,
            concat({"--end-step", "5", "--max-mem-gb", std::to_string(limit_bytes / (1 << 30))},
                   save_at({1, 2, 3, 4, 5})));
  EXPECT_EQ(remaining(by_size), expected);
  int64_t total = 0;
  for (int s : {4, 5})
    total += checkpoint::directory_bytes(by_size + "/global_step_" + std::to_string(s));
  EXPECT_LE(static_cast<double>(total), limit_bytes);
}

TEST(Checkpoint, ExportReadsBackWithAnIndependentReader) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"json", "struct"}));
  const std::string root = make_temp_dir("ckpt-export");
  auto trained = run_train(2, root, concat({"--end-step", "3"}, save_at({3})));
  ASSERT_FALSE(trained.params.empty());
  const std::string ckpt = root + "/global_step_3";
  for (const std::string dtype : {"fp32", "bf16"}) {
    const std::string out = make_temp_dir("export-" + dtype);
    const int64_t max_shard = 40000;
    auto exported = run_process({bin("shardrl"), "export", ckpt, out, "--dtype", dtype,
                                 "--max-shard-size", std::to_string(max_shard)});
    ASSERT_EQ(exported.exit_code, 0) << exported.output;
    auto read = run_process(
        {SHARDRL_PYTHON, std::string(SHARDRL_SOURCE_DIR "/tests/python/read_safetensors.py"), out});
    ASSERT_EQ(read.exit_code, 0) << read.output;
    const json got = json::parse(read.output);
    ASSERT_EQ(got["tensors"].size(), trained.params.size());
    EXPECT_GT(got["files"].size(), 1u) << "max_shard_bytes should split the model";
    for (const auto& [name, t] : trained.params) {
      ASSERT_TRUE(got["tensors"].contains(name)) << name;
      const json& entry = got["tensors"][name];
      EXPECT_EQ(entry["dtype"], dtype == "fp32" ? "F32" : "BF16") << name;
      EXPECT_EQ(entry["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
      const auto values = entry["values"].get<std::vector<double>>();
      const auto want = t.to(dtype == "fp32" ? torch::kFloat : torch::kBFloat16)
                            .to(torch::kDouble)
                            .reshape(-1)
                            .contiguous();
      ASSERT_EQ(static_cast<int64_t>(values.size()), want.numel()) << name;
      EXPECT_TRUE(torch::equal(torch::tensor(values, torch::kDouble), want)) << name;
    }
    int64_t largest_tensor = 0;
    for (const auto& [name, t] : trained.params)
      largest_tensor = std::max<int64_t>(largest_tensor, t.numel() * (dtype == "fp32" ? 4 : 2));
    for (const auto& [file, bytes] : got["files"].items()) {
      // Header aside, a file exceeds the limit only when one tensor alone does.
      EXPECT_LE(bytes.get<int64_t>(), std::max(max_shard, largest_tensor) + 4096) << file;
    }
    if (dtype == "fp32") {
      // Back in at another world size, over a model built from another seed: every rank reading,
      // rank 0 reading and sending the others their rows, and that into a model built empty.
      for (const std::vector<std::string>& how :
           {std::vector<std::string>{}, {"--from-rank0"}, {"--from-rank0", "--empty-init"}}) {
        const std::string params = make_temp_dir("init-hf");
        std::vector<std::string> args = {"init", "--unused-params", "--seed", "99", "--hf",
                                         out,    "--out",           params};
        args.insert(args.end(), how.begin(), how.end());
        std::string label;
        for (const auto& flag : how) label += flag + " ";
        auto init = launch_workers(3, args, 300, "ckpt_worker");
        ASSERT_EQ(init.exit_code, 0) << init.output;
        const auto loaded = read_params(params);
        EXPECT_EQ(loaded.size(), trained.params.size());
        for (const auto& [name, tensor] : loaded) {
          EXPECT_TRUE(torch::equal(tensor, trained.params.at(name))) << label << name;
        }
      }
    }
    const json config = json::parse(std::ifstream(out + "/config.json"));
    EXPECT_EQ(config["d_model"], 48);
    EXPECT_EQ(config["torch_dtype"], dtype == "fp32" ? "float32" : "bfloat16");
  }
  auto inspect = run_process({bin("shardrl"), "inspect", ckpt});
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  for (const std::string want : {"step 3", "world size 2", "checksums ok", "blocks.0.fc1.weight"})
    EXPECT_NE(inspect.output.find(want), std::string::npos) << want << "\n" << inspect.output;
}

TEST(Checkpoint, WeightSyncYieldsFullTensorsWithoutChangingState) {
  const std::string root = make_temp_dir("ckpt-sync");
  run_train(2, root, concat({"--end-step", "2"}, save_at({2})));
  for (const std::string dtype : {"bf16", "fp32"}) {
    auto result = launch_workers(
        3, {"sync", "--unused-params", "--load", root + "/global_step_2", "--dtype", dtype}, 300,
        "ckpt_worker");
    EXPECT_EQ(result.exit_code, 0) << result.output;
    EXPECT_NE(result.output.find("synced"), std::string::npos) << result.output;
  }
}

}  // namespace
}  // namespace shardrl::testing
