// Fuzzes the YAML config: the input is a config file, optionally followed by a NUL byte and
// NUL-separated "dotted.key=value" overrides. It is loaded over the trainer's engine defaults
// (actor_rollout_ref.{model, actor, ref}, the keys engine_config reads) and a trainer section,
// with `data` open (a null default accepts any value), as `shardrl train` loads a config: YAML
// parsing, typing of scalars, the overlay and its key and type checks, the overrides. Then every
// key of the defaults is read back with its default's type.
#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "fuzz_util.h"
#include "shardrl/trainer.h"

namespace {

using nlohmann::json;

const json& defaults() {
  static const json d = {{"trainer",
                          {{"task", "lm_pretrain"},
                           {"total_training_steps", 100},
                           {"save_freq", -1},
                           {"resume_mode", "auto"},
                           {"max_actor_ckpt_to_keep", 2},
                           {"max_mem_gb", 0.0},
                           {"logger", "console"}}},
                         {"data", nullptr},
                         {"actor_rollout_ref", shardrl::trainer::engine_defaults()}};
  return d;
}

// Reads every leaf of `d` from config as the type of its default, as the tasks do.
void read_back(const json& config, const json& d, const std::string& prefix) {
  using shardrl::trainer::get;
  for (const auto& [key, value] : d.items()) {
    const std::string name = prefix.empty() ? key : prefix + "." + key;
    if (value.is_object()) {
      read_back(config, value, name);
    } else if (value.is_boolean()) {
      get<bool>(config, name);
    } else if (value.is_number_integer()) {
      get<int64_t>(config, name);
    } else if (value.is_number()) {
      get<double>(config, name);
    } else if (value.is_string()) {
      get<std::string>(config, name);
    } else {
      // A null default: any value, printed as the trainer logs the config.
      shardrl::trainer::at(config, name).dump();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardrl;
  static const std::string path = fuzz::scratch_dir() + "/config.yaml";
  const auto* begin = reinterpret_cast<const char*>(data);
  const std::string input(begin, size);
  const size_t nul = input.find('\0');
  fuzz::write_file(path, data, nul == std::string::npos ? size : nul);
  std::vector<std::string> overrides;
  for (size_t at = nul; at != std::string::npos && at < input.size();) {
    const size_t next = input.find('\0', at + 1);
    overrides.push_back(input.substr(at + 1, next == std::string::npos ? next : next - at - 1));
    at = next;
  }
  // An error names the file, or the override it comes from.
  fuzz::expect_clear_errors({path, "override"}, [&] {
    try {
      const json config = trainer::load_config(path, overrides, defaults());
      read_back(config, defaults(), "");
      config.dump(2);
    } catch (const YAML::Exception& e) {
      fuzz::finding("yaml-cpp's exception escaped", e.what());
    }
  });
  return 0;
}
