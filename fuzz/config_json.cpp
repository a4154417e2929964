// Fuzzes the config.json readers of the model folders ShardRL loads: LLaMA and Qwen2
// (transformers' LlamaConfig / Qwen2Config, models::LlamaConfig::load), SD3 (diffusers'
// SD3Transformer2DModel config, models::SD3Config::load) and BERT (the text encoder's,
// models::BertConfig::load). Each input is read by all three, as any of them may meet any folder.
// A config one of them accepts must write back (to_json) into a config it reads again the same.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/sd3.h"
#include "shardrl/models/text_encoder.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string path = fuzz::scratch_dir() + "/config.json";
  fuzz::write_file(path, data, size);
  fuzz::expect_clear_errors({path}, [&] {
    const auto config = models::LlamaConfig::load(path);
    if (models::LlamaConfig::from_json(config.to_json()).to_json() != config.to_json()) {
      fuzz::finding("LlamaConfig", "to_json does not read back the same");
    }
  });
  fuzz::expect_clear_errors({path}, [&] {
    const auto config = models::SD3Config::load(path);
    if (models::SD3Config::from_json(config.to_json()).to_json() != config.to_json()) {
      fuzz::finding("SD3Config", "to_json does not read back the same");
    }
  });
  fuzz::expect_clear_errors({path}, [&] { models::BertConfig::load(path); });
  return 0;
}
