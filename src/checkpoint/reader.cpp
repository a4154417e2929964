#include "checkpoint/reader.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>

namespace shardrl::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string check_file_size(const std::string& path, int64_t expected_bytes) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return fmt::format("checkpoint file {} is missing ({})", path, ec.message());
  if (static_cast<int64_t>(size) != expected_bytes) {
    return fmt::format("checkpoint file {} is truncated or resized: {} bytes, the index says {}",
                       path, size, expected_bytes);
  }
  return "";
}

std::string check_file(const std::string& path, int64_t expected_bytes, uint32_t expected_crc) {
  if (auto problem = check_file_size(path, expected_bytes); !problem.empty()) return problem;
  const uint32_t crc = file_crc32(path);
  if (crc != expected_crc) {
    return fmt::format("checkpoint file {} is damaged: crc32 {:08x}, the index says {:08x}", path,
                       crc, expected_crc);
  }
  return "";
}

json read_index(const std::string& dir) {
  const std::string path = (fs::path(dir) / kIndexFile).string();
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("checkpoint index {} is missing", path));
  json index;
  try {
    index = json::parse(in);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint index {} is damaged: {}", path, e.what()));
  }
  for (const char* field : {"step", "world_size", "files", "model", "optimizer", "rng"}) {
    if (!index.contains(field)) {
      throw std::runtime_error(fmt::format("checkpoint index {} has no '{}'", path, field));
    }
  }
  check_index(index, path);
  return index;
}

std::vector<FileStatus> verify(const std::string& dir) {
  const json index = read_index(dir);
  std::vector<FileStatus> out;
  for (const auto& [name, meta] : index.at("files").items()) {
    FileStatus s;
    s.file = name;
    s.expected_bytes = meta.at("bytes").get<int64_t>();
    const std::string path = (fs::path(dir) / name).string();
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    s.bytes = ec ? -1 : static_cast<int64_t>(size);
    s.problem = check_file(path, s.expected_bytes, meta.at("crc32").get<uint32_t>());
    s.ok = s.problem.empty();
    out.push_back(std::move(s));
  }
  return out;
}

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  index_ = read_index(dir_);
}

const json& CheckpointReader::model_entry(const std::string& name) const {
  const json& model = index_.at("model");
  auto it = model.find(name);
  if (it == model.end()) {
    throw std::runtime_error(fmt::format("checkpoint {} has no tensor '{}'", dir_, name));
  }
  return *it;
}

const SafetensorsReader& CheckpointReader::file(const std::string& name) {
  auto it = open_.find(name);
  if (it != open_.end()) return *it->second;
  const std::string path = (fs::path(dir_) / name).string();
  const json& files = index_.at("files");
  if (!files.contains(name)) {
    throw std::runtime_error(
        fmt::format("checkpoint {}: {} is not listed in its {}", dir_, name, kIndexFile));
  }
  const json& meta = files[name];
  const int64_t bytes = meta.at("bytes").get<int64_t>();
  BlockChecksums blocks;
  if (meta.contains("block_crc32")) {
    blocks.block_bytes = meta.at("block_bytes").get<int64_t>();
    blocks.crc32 = meta.at("block_crc32").get<std::vector<uint32_t>>();
  }
  // With block checksums the reader checks the bytes as it reads them, so no byte is read twice;
  // files written before them are checked whole up front.
  const std::string problem = blocks.empty()
                                  ? check_file(path, bytes, meta.at("crc32").get<uint32_t>())
                                  : check_file_size(path, bytes);
  if (!problem.empty()) throw std::runtime_error(problem);
  return *open_.emplace(name, std::make_unique<SafetensorsReader>(path, std::move(blocks)))
              .first->second;
}

void CheckpointReader::read_rows(const json& entry, const std::string& what, int64_t first,
                                 int64_t rows, const torch::Tensor& out) {
  int64_t covered = 0;
  for (const auto& shard : entry.at("shards")) {
    const int64_t begin = shard.at("row_offset").get<int64_t>();
    const int64_t end = begin + shard.at("rows").get<int64_t>();
    const int64_t lo = std::max(first, begin), hi = std::min(first + rows, end);
    if (lo >= hi) continue;
    const std::string name = shard.at("file").get<std::string>();
    const SafetensorsReader& reader = file(name);
    const std::string tensor = shard.at("tensor").get<std::string>();
    // Rows of another size than the entry's would be read past the shard or into the wrong place.
    const auto& saved = reader.info(tensor).shape;
    const int64_t saved_row =
        saved.empty() ? 1 : c10::multiply_integers(saved.begin() + 1, saved.end());
    const int64_t out_row = c10::multiply_integers(out.sizes().begin() + 1, out.sizes().end());
    if (saved_row != out_row) {
      throw std::runtime_error(fmt::format(
          "checkpoint {}: '{}' in {} has rows of {} elements, its index entry ('{}') rows of {}",
          dir_, tensor, name, saved_row, what, out_row));
    }
    torch::Tensor dst = out.narrow(0, lo - first, hi - lo);
    if (reader.info(tensor).dtype == out.scalar_type()) {
      reader.read_rows_into(tensor, lo - begin, hi - lo, dst);
    } else {
      dst.copy_(reader.read_rows(tensor, lo - begin, hi - lo).view(dst.sizes()));
    }
    covered += hi - lo;
  }
  if (covered != rows) {
    throw std::runtime_error(
        fmt::format("checkpoint {}: rows [{}, {}) of '{}' are in no shard file", dir_, first,
                    first + rows, what));
  }
}

torch::Tensor CheckpointReader::read_full(const json& entry, const std::string& what) {
  const auto shape = entry.at("shape").get<std::vector<int64_t>>();
  const auto dtype = dtype_from_name(entry.at("dtype").get<std::string>(), what);
  // The tensor's data is in its shard files: a shape they cannot hold is damage, found before
  // allocating it. check_index bounded the shape, so the product does not overflow.
  const int64_t bytes =
      c10::multiply_integers(shape) * static_cast<int64_t>(c10::elementSize(dtype));
  int64_t held = 0;
  std::set<std::string> files;
  for (const auto& shard : entry.at("shards")) {
    const std::string name = shard.at("file").get<std::string>();
    if (!files.insert(name).second) continue;
    file(name);  // its size checked against the index
    held += index_.at("files").at(name).at("bytes").get<int64_t>();
  }
  if (bytes > held) {
    throw std::runtime_error(
        fmt::format("checkpoint {}: '{}' of shape {} needs {} bytes, more than its shard files "
                    "hold ({} bytes)",
                    dir_, what, entry.at("shape").dump(), bytes, held));
  }
  torch::Tensor out = torch::empty(shape, torch::dtype(dtype));
  // Scalars are stored as one row.
  torch::Tensor rows = shape.empty() ? out.view({1}) : out;
  read_rows(entry, what, 0, rows.size(0), rows);
  return out;
}

torch::Tensor read_full_tensor(const std::string& dir, const std::string& section,
                               const std::string& name) {
  CheckpointReader reader(dir);
  if (section == "model") return reader.read_full(reader.model_entry(name), name);
  if (section != "optimizer") {
    throw std::invalid_argument(fmt::format("read_full_tensor: unknown section '{}'", section));
  }
  const auto dot = name.rfind('.');
  const json& state = reader.index().at("optimizer").at("state");
  const std::string param = name.substr(0, dot == std::string::npos ? 0 : dot);
  const std::string moment = dot == std::string::npos ? "" : name.substr(dot + 1);
  if (!state.contains(param) || !state[param].contains(moment)) {
    throw std::runtime_error(fmt::format("checkpoint {} has no optimizer tensor '{}'", dir, name));
  }
  return reader.read_full(state[param][moment], name);
}

void for_each_full_tensor(
    const std::string& dir, const std::vector<std::string>& names,
    const std::function<void(const std::string& name, const torch::Tensor& tensor)>& callback) {
  CheckpointReader reader(dir);
  for (const auto& name : names) callback(name, reader.read_full(reader.model_entry(name), name));
}

}  // namespace shardrl::checkpoint
