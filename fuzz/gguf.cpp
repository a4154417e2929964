// Fuzzes the GGUF reader: magic and version, the metadata key/value pairs (every value type,
// nested arrays), general.alignment and the tensor table (names, dims, ggml types, offsets); then
// every tensor of a type ShardRL dequantizes is read.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "shardrl/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string path = fuzz::scratch_dir() + "/input.gguf";
  fuzz::write_file(path, data, size);
  fuzz::expect_clear_errors({path}, [&] {
    checkpoint::GgufFile gguf(path);
    for (const auto& [key, value] : gguf.metadata().items()) gguf.at(key);
    for (const auto& t : gguf.tensors()) {
      // Only small tensors: the data of a large one is real I/O, not parsing.
      if (t.bytes >= 0 && t.bytes <= (int64_t{1} << 16)) {
        // A type ShardRL does not dequantize is a clear error; the other tensors are still read.
        try {
          gguf.read(t.name);
        } catch (const std::invalid_argument& e) {
          if (std::string(e.what()).find(path) == std::string::npos) throw;
        }
      }
    }
  });
  return 0;
}
