// Reading a sharded checkpoint: the index, its files verified before first use, and tensors (or
// row ranges of them) assembled from whichever shard files hold them. Shared by load, export and
// inspect.
#pragma once

#include <memory>

#include "shardrl/checkpoint.h"

namespace shardrl::checkpoint {

constexpr const char* kIndexFile = "index.json";
// The crc32 of index.json's bytes as 8 hex digits and a newline, written beside it. A separate
// file, so that index.json stays plain JSON and every byte of it is covered (a checksum field
// inside would have to leave its own bytes out).
constexpr const char* kIndexChecksumFile = "index.json.crc32";
// The index format; version 1 had no checksum file.
constexpr int kIndexVersion = 2;

// The checksum file's content for index bytes `text`.
std::string index_checksum_line(const std::string& text);

// Empty when the file exists with the expected size (and crc32), else what is wrong, naming path.
std::string check_file_size(const std::string& path, int64_t expected_bytes);
std::string check_file(const std::string& path, int64_t expected_bytes, uint32_t expected_crc);
// Throws naming `path` and the field unless `index` has the structure save() writes: every field
// load, export and inspect read, of its type, sizes in range, shard files listed under 'files'.
void check_index(const nlohmann::json& index, const std::string& path);

// find_damage for the files at positions `share` modulo `shares` of the index's (sorted) file
// list; the index itself is always checked. Shares let the ranks check a checkpoint together.
std::string find_damage(const std::string& dir, size_t share, size_t shares);

class CheckpointReader {
 public:
  explicit CheckpointReader(std::string dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& index() const { return index_; }
  // The model entry {dtype, shape, shards} of `name`; throws naming the checkpoint if absent.
  const nlohmann::json& model_entry(const std::string& name) const;
  // A file the index lists: its size checked on first use, its bytes as they are read (block
  // checksums), or the whole file's crc32 up front for an index without block checksums.
  const SafetensorsReader& file(const std::string& name);
  // Rows [first, first + rows) of the tensor `entry` describes into `out` (contiguous, any dtype;
  // converted when it differs from the saved one). `what` names the tensor in errors.
  void read_rows(const nlohmann::json& entry, const std::string& what, int64_t first, int64_t rows,
                 const torch::Tensor& out);
  torch::Tensor read_full(const nlohmann::json& entry, const std::string& what);

 private:
  std::string dir_;
  nlohmann::json index_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> open_;
};

}  // namespace shardrl::checkpoint
