// Fuzzes the checkpoint index: the input is a checkpoint's index.json, beside the real shard files
// of a small checkpoint (fuzz/data/checkpoint, written by `shardrl train`). It is read and checked
// the way inspect, export and load read it: verify() over its files, then its model and optimizer
// tensors assembled from the shards it points at, and its RNG entries.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "checkpoint/reader.h"
#include "fuzz_util.h"

namespace {

// Each input reads at most this many tensors: enough to reach every path, cheap enough for 10^6.
constexpr int kMaxTensors = 8;

const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(shardrl::fuzz::scratch_dir()) / "global_step_1";
    fs::create_directories(dir);
    const fs::path data = fs::path(SHARDRL_SOURCE_DIR) / "fuzz" / "data" / "checkpoint";
    for (const auto& file : fs::directory_iterator(data)) {
      if (file.path().extension() == ".safetensors") {
        fs::copy_file(file.path(), dir / file.path().filename(),
                      fs::copy_options::overwrite_existing);
      }
    }
    return dir.string();
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  using nlohmann::json;
  const std::string& dir = checkpoint_dir();
  fuzz::write_file(dir + "/index.json", data, size);
  // A matching checksum file, so that inputs reach the index's structure checks rather than
  // stopping at the checksum (a compare of 9 bytes, which nothing gains from fuzzing).
  const std::string checksum =
      checkpoint::index_checksum_line(std::string(reinterpret_cast<const char*>(data), size));
  fuzz::write_file(dir + "/" + checkpoint::kIndexChecksumFile,
                   reinterpret_cast<const uint8_t*>(checksum.data()), checksum.size());
  fuzz::expect_clear_errors({dir}, [&] {
    checkpoint::verify(dir);
    checkpoint::CheckpointReader reader(dir);
    const json& index = reader.index();
    int budget = kMaxTensors;
    for (const auto& [name, entry] : index.at("model").items()) {
      if (budget-- == 0) break;
      reader.read_full(reader.model_entry(name), name);
    }
    for (const auto& [name, moments] : index.at("optimizer").at("state").items()) {
      for (const auto& [moment, entry] : moments.items()) {
        if (moment == "step" || budget-- <= 0) continue;
        reader.read_full(entry, name + "." + moment);
      }
    }
    for (const auto& where : index.at("rng")) {
      if (budget-- <= 0) break;
      reader.file(where.at("file").get<std::string>()).read(where.at("tensor").get<std::string>());
    }
  });
  return 0;
}
