// Reading a sharded checkpoint: the index, its files verified before first use, and tensors (or
// row ranges of them) assembled from whichever shard files hold them. Shared by load, export and
// inspect.
#pragma once

#include <memory>

#include "shardrl/checkpoint.h"

namespace shardrl::checkpoint {

constexpr const char* kIndexFile = "index.json";

// Empty when the file exists with the expected size (and crc32), else what is wrong, naming path.
std::string check_file_size(const std::string& path, int64_t expected_bytes);
std::string check_file(const std::string& path, int64_t expected_bytes, uint32_t expected_crc);
// Throws naming `path` and the field unless `index` has the structure save() writes: every field
// load, export and inspect read, of its type, sizes in range, shard files listed under 'files'.
void check_index(const nlohmann::json& index, const std::string& path);

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
