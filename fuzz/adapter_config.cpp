// Fuzzes a LoRA adapter's adapter_config.json (models::lora::read_peft_config: PEFT's fields r,
// lora_alpha, lora_dropout, target_modules as names or a regex, and those it refuses), then matches
// the config against the module names of a LLaMA / Qwen2 decoder and an SD3 transformer, as
// load_peft_adapter does before it reads the adapter's tensors.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "shardrl/models/lora.h"

namespace {

const std::vector<std::string>& module_names() {
  static const std::vector<std::string> names = {
      "model.layers.0.self_attn.q_proj",     "model.layers.0.self_attn.k_proj",
      "model.layers.0.self_attn.v_proj",     "model.layers.0.self_attn.o_proj",
      "model.layers.11.mlp.gate_proj",       "model.layers.11.mlp.up_proj",
      "model.layers.11.mlp.down_proj",       "lm_head",
      "transformer_blocks.0.attn.to_q",      "transformer_blocks.0.attn.add_k_proj",
      "transformer_blocks.17.attn.to_out.0", "transformer_blocks.3.ff_context.net.2",
      "transformer_blocks.0.norm1.linear",   "context_embedder"};
  return names;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string path = fuzz::scratch_dir() + "/adapter_config.json";
  fuzz::write_file(path, data, size);
  fuzz::expect_clear_errors({path}, [&] {
    const auto config = models::lora::read_peft_config(path);
    for (const auto& name : module_names()) models::lora::is_target(config, name);
    // What `shardrl train` saves with a checkpoint, read back.
    const auto again = models::lora::config_from_peft(
        nlohmann::json::parse(models::lora::peft_adapter_config(config)), path);
    if (again.r != config.r || again.describe_targets() != config.describe_targets()) {
      fuzz::finding("adapter_config", "peft_adapter_config does not read back the same");
    }
  });
  return 0;
}
