#include "checkpoint/reader.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "checkpoint/io.h"

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

std::string index_checksum_line(const std::string& text) {
  return fmt::format("{:08x}\n", crc32_update(0, text.data(), static_cast<int64_t>(text.size())));
}

namespace {

// Empty when index.json's bytes `text` match index.json.crc32, else what is wrong, naming the
// file. An index of version 1 (written before the checksum file) without one is accepted: old
// checkpoints stay readable at the cost of that one test, and a flip that turns 2 into 1 is two
// bits, caught by the checksum file that a version-2 save always writes.
std::string check_index_checksum(const std::string& dir, const std::string& text,
                                 const json& index) {
  const std::string path = (fs::path(dir) / kIndexFile).string();
  const std::string sum_path = (fs::path(dir) / kIndexChecksumFile).string();
  std::ifstream in(sum_path, std::ios::binary);
  if (!in) {
    if (index.is_object() && index.value("version", json()) == json(1)) return "";
    return fmt::format("checkpoint index {} is unverifiable: its checksum file {} is missing", path,
                       sum_path);
  }
  const std::string stored((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string expected = index_checksum_line(text);
  if (stored != expected) {
    return fmt::format("checkpoint index {} is damaged: its crc32 is {}, {} says '{}'", path,
                       expected.substr(0, 8), sum_path, stored.substr(0, 16));
  }
  return "";
}

}  // namespace

json read_index(const std::string& dir) {
  const std::string path = (fs::path(dir) / kIndexFile).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("checkpoint index {} is missing", path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(
        fmt::format("checkpoint index {} is damaged: not valid JSON: {}", path, e.what()));
  }
  if (auto problem = check_index_checksum(dir, text, index); !problem.empty())
    throw std::runtime_error(problem);
  for (const char* field : {"step", "world_size", "files", "model", "optimizer", "rng"}) {
    if (!index.contains(field)) {
      throw std::runtime_error(fmt::format("checkpoint index {} has no '{}'", path, field));
    }
  }
  check_index(index, path);
  return index;
}

namespace {

// The status of each file the index lists whose position (in the index's name order) is
// `share` modulo `shares`.
std::vector<FileStatus> verify_files(const std::string& dir, const json& index, size_t share,
                                     size_t shares) {
  std::vector<FileStatus> out;
  size_t position = 0;
  for (const auto& [name, meta] : index.at("files").items()) {
    if (position++ % shares != share) continue;
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

}  // namespace

std::vector<FileStatus> verify(const std::string& dir) {
  return verify_files(dir, read_index(dir), 0, 1);
}

std::string find_damage(const std::string& dir, size_t share, size_t shares) {
  try {
    for (const auto& f : verify_files(dir, read_index(dir), share, shares)) {
      if (!f.ok) return f.problem;
    }
  } catch (const std::exception& e) {
    // An unreadable index, or one whose entries are not what a save writes (whose errors, from
    // the JSON library, would not say where).
    const std::string what = e.what();
    return what.find(dir) != std::string::npos ? what : fmt::format("checkpoint {}: {}", dir, what);
  }
  return "";
}

std::string find_damage(const std::string& dir) {
  return find_damage(dir, 0, 1);
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
    if (reader.info(tensor).dtype == out.scalar_type() && dst.is_cpu()) {
      reader.read_rows_into(tensor, lo - begin, hi - lo, dst);
    } else {
      // Another dtype, or memory a file read cannot write (a GPU's): through a host tensor.
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
