// The structure of index.json, checked once when it is read, so that load, export and inspect can
// index into it without meeting a missing field, a wrong type or a size nothing could hold.
#include <fmt/format.h>

#include <limits>

#include "checkpoint/io.h"
#include "checkpoint/reader.h"

namespace shardrl::checkpoint {
namespace {

using json = nlohmann::json;

class IndexChecker {
 public:
  explicit IndexChecker(const std::string& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& field, const std::string& expected,
                         const json& got) const {
    throw std::runtime_error(fmt::format("checkpoint index {}: '{}' must be {}, got {}", path_,
                                         field, expected,
                                         got.dump(-1, ' ', false, json::error_handler_t::replace)));
  }

  const json& field(const json& parent, const std::string& parent_name, const char* key) const {
    const std::string name = parent_name.empty() ? key : parent_name + "." + key;
    if (!parent.is_object() || !parent.contains(key)) {
      throw std::runtime_error(fmt::format("checkpoint index {} has no '{}'", path_, name));
    }
    return parent[key];
  }

  int64_t integer(const json& value, const std::string& name, int64_t min, int64_t max) const {
    if (!value.is_number_integer()) fail(name, "an integer", value);
    // An unsigned value beyond int64 reads as negative; compare it as what it is.
    if (value.is_number_unsigned() &&
        value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(name, fmt::format("an integer in [{}, {}]", min, max), value);
    }
    const int64_t v = value.get<int64_t>();
    if (v < min || v > max) fail(name, fmt::format("an integer in [{}, {}]", min, max), value);
    return v;
  }

  int64_t member(const json& parent, const std::string& parent_name, const char* key, int64_t min,
                 int64_t max = std::numeric_limits<int64_t>::max()) const {
    return integer(field(parent, parent_name, key),
                   parent_name.empty() ? key : parent_name + "." + key, min, max);
  }

  const std::string& string(const json& parent, const std::string& parent_name,
                            const char* key) const {
    const json& value = field(parent, parent_name, key);
    if (!value.is_string()) fail(parent_name + "." + key, "a string", value);
    return value.get_ref<const std::string&>();
  }

  // A file name in the checkpoint's directory: nothing that reaches outside it.
  void file_name(const std::string& name, const std::string& field_name) const {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.find('\0') != std::string::npos) {
      fail(field_name, "a file name in the checkpoint's directory", name);
    }
  }

  void files(const json& files) const {
    if (!files.is_object()) fail("files", "a mapping", files);
    for (const auto& [name, meta] : files.items()) {
      const std::string where = "files." + name;
      file_name(name, where);
      if (!meta.is_object()) fail(where, "a mapping", meta);
      const int64_t bytes = member(meta, where, "bytes", 0);
      member(meta, where, "crc32", 0, std::numeric_limits<uint32_t>::max());
      if (!meta.contains("block_crc32")) continue;
      const int64_t block_bytes = member(meta, where, "block_bytes", 1);
      const json& crcs = meta["block_crc32"];
      const int64_t blocks = bytes / block_bytes + (bytes % block_bytes != 0);
      if (!crcs.is_array() || static_cast<int64_t>(crcs.size()) != blocks) {
        fail(where + ".block_crc32", fmt::format("a list of {} checksums", blocks), crcs);
      }
      for (size_t i = 0; i < crcs.size(); ++i) {
        integer(crcs[i], fmt::format("{}.block_crc32[{}]", where, i), 0,
                std::numeric_limits<uint32_t>::max());
      }
    }
  }

  // {dtype, shape, shards: [{file, tensor, row_offset, rows}, ...]}
  void tensor(const json& entry, const std::string& where, const json& files) const {
    if (!entry.is_object()) fail(where, "a mapping", entry);
    dtype_from_name(string(entry, where, "dtype"),
                    fmt::format("checkpoint index {}: '{}.dtype'", path_, where));
    const json& shape = field(entry, where, "shape");
    if (!shape.is_array()) fail(where + ".shape", "a list of sizes", shape);
    int64_t elements = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t size =
          integer(shape[d], fmt::format("{}.shape[{}]", where, d), 0, kMaxTensorElements);
      if (size != 0 && elements > kMaxTensorElements / size) {
        fail(where + ".shape", "a shape of at most 2^48 elements", shape);
      }
      elements *= size;
    }
    const int64_t rows = shape.empty() ? 1 : shape[0].get<int64_t>();
    const json& shards = field(entry, where, "shards");
    if (!shards.is_array()) fail(where + ".shards", "a list", shards);
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string at = fmt::format("{}.shards[{}]", where, i);
      const json& shard = shards[i];
      if (!shard.is_object()) fail(at, "a mapping", shard);
      listed_file(string(shard, at, "file"), at + ".file", files);
      string(shard, at, "tensor");
      const int64_t first = member(shard, at, "row_offset", 0, rows);
      member(shard, at, "rows", 0, rows - first);
    }
  }

  void listed_file(const std::string& name, const std::string& where, const json& files) const {
    if (!files.contains(name)) fail(where, "a file listed under 'files'", name);
  }

 private:
  const std::string& path_;
};

}  // namespace

void check_index(const json& index, const std::string& path) {
  const IndexChecker c(path);
  if (!index.is_object()) c.fail("(top level)", "a mapping", index);
  c.member(index, "", "step", 0);
  c.member(index, "", "world_size", 1);
  for (const char* size : {"shard_size", "replicate_size"}) {
    if (index.contains(size)) c.member(index, "", size, 0);
  }
  const json& files = c.field(index, "", "files");
  c.files(files);

  const json& model = c.field(index, "", "model");
  if (!model.is_object()) c.fail("model", "a mapping", model);
  for (const auto& [name, entry] : model.items()) c.tensor(entry, "model." + name, files);

  const json& state = c.field(c.field(index, "", "optimizer"), "optimizer", "state");
  if (!state.is_object()) c.fail("optimizer.state", "a mapping", state);
  for (const auto& [name, moments] : state.items()) {
    const std::string where = "optimizer.state." + name;
    if (!moments.is_object()) c.fail(where, "a mapping", moments);
    c.member(moments, where, "step", 0);
    for (const auto& [moment, entry] : moments.items()) {
      if (moment != "step") c.tensor(entry, where + "." + moment, files);
    }
  }

  const json& rng = c.field(index, "", "rng");
  if (!rng.is_array()) c.fail("rng", "a list", rng);
  for (size_t r = 0; r < rng.size(); ++r) {
    const std::string where = fmt::format("rng[{}]", r);
    c.listed_file(c.string(rng[r], where, "file"), where + ".file", files);
    c.string(rng[r], where, "tensor");
  }
  // null: saved without an LR scheduler.
  if (const json& scheduler = c.field(index, "", "scheduler"); !scheduler.is_null()) {
    c.member(scheduler, "scheduler", "last_step", 0);
  }
  if (index.contains("extra") && !index["extra"].is_object()) {
    c.fail("extra", "a mapping", index["extra"]);
  }
}

}  // namespace shardrl::checkpoint
