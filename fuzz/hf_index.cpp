// Fuzzes the index of a sharded Hugging Face folder (model.safetensors.index.json, which
// diffusers names diffusion_pytorch_model.safetensors.index.json; checkpoint::HfWeights), beside
// the real shard files transformers and diffusers wrote for small models (fuzz/data/hf_sharded).
// Every tensor it lists is looked up in the file it names, and the small ones are read, as
// load_weights and weight_shapes read them.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "shardrl/checkpoint.h"

namespace {

// Each input reads at most this many tensors: enough to reach every path, cheap enough for 10^6.
constexpr int kMaxReads = 4;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string dir = [] {
    const std::string d = fuzz::scratch_dir() + "/model";
    fuzz::copy_data("hf_sharded", d);
    return d;
  }();
  const std::string index = dir + "/model.safetensors.index.json";
  fuzz::write_file(index, data, size);
  fuzz::expect_clear_errors({dir}, [&] {
    checkpoint::HfWeights weights(dir);
    int budget = kMaxReads;
    for (const auto& name : weights.names()) {
      const auto& reader = weights.reader(name);
      if (reader.info(name).nbytes() <= 4096 && budget-- > 0) reader.read(name);
    }
  });
  return 0;
}
