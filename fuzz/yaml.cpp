// Fuzzes the YAML config: the input is a config file, optionally followed by a NUL byte and
// NUL-separated "dotted.key=value" overrides. It is loaded over the config table every task shares
// (trainer.*, the engine roles actor_rollout_ref.{model, actor, ref}) with a free-form `data`
// mapping, as `shardrl train` loads a config: YAML parsing, typing of scalars, the overlay and its
// key and type checks, the overrides, then the table's checks of every key's type, range and
// choices. A config that passes is read back key by key with its row's type.
#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "fuzz_util.h"
#include "shardrl/trainer.h"
#include "trainer/config_table.h"

namespace {

using nlohmann::json;
using shardrl::trainer::ConfigTable;

const ConfigTable& table() {
  static const ConfigTable t = [] {
    auto rows = shardrl::trainer::shared_keys();
    rows.push_back({"data", nullptr, shardrl::trainer::mapping().or_null(""), "free-form"});
    return ConfigTable(std::move(rows));
  }();
  return t;
}

// Reads every row's value as its type, as the tasks do.
void read_back(const json& config) {
  using shardrl::trainer::get;
  using Type = shardrl::trainer::Values::Type;
  for (const auto& row : table().rows()) {
    if (shardrl::trainer::at(config, row.key).is_null()) continue;
    switch (row.values.type()) {
      case Type::kBoolean:
        get<bool>(config, row.key);
        break;
      case Type::kInteger:
        get<int64_t>(config, row.key);
        break;
      case Type::kNumber:
        get<double>(config, row.key);
        break;
      case Type::kText:
        get<std::string>(config, row.key);
        break;
      default:
        shardrl::trainer::at(config, row.key).dump();
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
      trainer::ConfigOrigins origins;
      const json config = trainer::load_config(path, overrides, table(), &origins);
      table().check(config, origins, /*check_files=*/false);
      read_back(config);
    } catch (const YAML::Exception& e) {
      fuzz::finding("yaml-cpp's exception escaped", e.what());
    }
  });
  return 0;
}
