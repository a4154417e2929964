// Fuzzes the safetensors reader: the 8-byte header length, the JSON header and its tensor table
// (dtype, shape, data_offsets), then every tensor it accepted is read back, whole and by rows.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "shardrl/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string path = fuzz::scratch_dir() + "/input.safetensors";
  fuzz::write_file(path, data, size);
  fuzz::expect_clear_errors({path}, [&] {
    checkpoint::SafetensorsReader reader(path);
    for (const auto& name : reader.names()) {
      const auto& info = reader.info(name);
      const torch::Tensor whole = reader.read(name);
      if (whole.numel() * static_cast<int64_t>(whole.element_size()) != info.nbytes()) {
        fuzz::finding("tensor size", name + " read with another size than declared");
      }
      const int64_t rows = info.shape.empty() ? 1 : info.shape[0];
      if (rows > 0) reader.read_rows(name, rows / 2, rows - rows / 2);
    }
  });
  return 0;
}
