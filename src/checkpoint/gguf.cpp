// GGUF reading (llama.cpp's single-file format): header, metadata, tensor table and dequantization
// of the types a released model file commonly uses.
//
// The parser trusts nothing in the file: every count and length is checked against the bytes that
// remain before anything is allocated, so a damaged or hostile file is an error naming the field,
// never a crash or an allocation the file's size does not justify.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <limits>
#include <string>

#include "checkpoint/io.h"
#include "shardrl/checkpoint.h"

namespace shardrl::checkpoint {
namespace {

using json = nlohmann::json;

// ggml's type table (ggml.h, enum ggml_type): the name, the elements per block and the bytes per
// block. Types removed from ggml keep an empty name; bytes 0 means "size not known here".
struct GgmlType {
  const char* name;
  int64_t block;
  int64_t bytes;
};
constexpr std::array<GgmlType, 40> kGgmlTypes = {{
    {"F32", 1, 4},       {"F16", 1, 2},      {"Q4_0", 32, 18},    {"Q4_1", 32, 20},
    {"", 0, 0},          {"", 0, 0},         {"Q5_0", 32, 22},    {"Q5_1", 32, 24},
    {"Q8_0", 32, 34},    {"Q8_1", 32, 36},   {"Q2_K", 256, 84},   {"Q3_K", 256, 110},
    {"Q4_K", 256, 144},  {"Q5_K", 256, 176}, {"Q6_K", 256, 210},  {"Q8_K", 256, 292},
    {"IQ2_XXS", 256, 0}, {"IQ2_XS", 256, 0}, {"IQ3_XXS", 256, 0}, {"IQ1_S", 256, 0},
    {"IQ4_NL", 32, 18},  {"IQ3_S", 256, 0},  {"IQ2_S", 256, 0},   {"IQ4_XS", 256, 136},
    {"I8", 1, 1},        {"I16", 1, 2},      {"I32", 1, 4},       {"I64", 1, 8},
    {"F64", 1, 8},       {"IQ1_M", 256, 0},  {"BF16", 1, 2},      {"", 0, 0},
    {"", 0, 0},          {"", 0, 0},         {"TQ1_0", 256, 54},  {"TQ2_0", 256, 66},
    {"", 0, 0},          {"", 0, 0},         {"", 0, 0},          {"MXFP4", 32, 17},
}};

constexpr int64_t kMaxDims = 4;                     // GGML_MAX_DIMS
constexpr int64_t kMaxElements = int64_t{1} << 48;  // far beyond any model, far below overflow
constexpr int kMaxArrayDepth = 4;

// Sequential reads of the header with every length checked against the file's size.
class Cursor {
 public:
  Cursor(int fd, int64_t size, const std::string& path) : fd_(fd), size_(size), path_(path) {}

  int64_t position() const { return pos_; }
  int64_t remaining() const { return size_ - pos_; }

  void read(void* out, int64_t n, const std::string& field) {
    if (n < 0 || n > remaining()) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: truncated: {} needs {} bytes at offset {}, the file has {} left",
                      path_, field, n, pos_, remaining()));
    }
    pread_exact(fd_, out, n, pos_, path_);
    pos_ += n;
  }
  template <typename T>
  T scalar(const std::string& field) {
    T value;
    read(&value, sizeof(T), field);
    return value;
  }
  std::string string(const std::string& field) {
    const auto length = scalar<uint64_t>(field + " (string length)");
    if (length > static_cast<uint64_t>(remaining())) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: {} claims a {}-byte string with {} bytes left in the file", path_,
                      field, length, remaining()));
    }
    std::string out(length, '\0');
    read(out.data(), static_cast<int64_t>(length), field);
    return out;
  }
  // A count of items that take at least `min_item_bytes` each, bounded by the bytes left.
  int64_t count(const std::string& field, int64_t min_item_bytes) {
    const auto n = scalar<uint64_t>(field);
    if (n > static_cast<uint64_t>(remaining() / min_item_bytes)) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: {} is {}, more than the {} bytes left in the file can hold", path_,
                      field, n, remaining()));
    }
    return static_cast<int64_t>(n);
  }

 private:
  int fd_;
  int64_t size_, pos_ = 0;
  const std::string& path_;
};

// The smallest encoding of a value of GGUF type `type`, for bounding array counts.
int64_t min_value_bytes(uint32_t type) {
  switch (type) {
    case 0:
    case 1:
    case 7:
      return 1;  // u8, i8, bool
    case 2:
    case 3:
      return 2;  // u16, i16
    case 4:
    case 5:
    case 6:
      return 4;  // u32, i32, f32
    case 8:
      return 8;  // string: its length
    case 9:
      return 12;  // array: element type and count
    case 10:
    case 11:
    case 12:
      return 8;  // u64, i64, f64
    default:
      return 1;
  }
}

json read_value(Cursor& in, uint32_t type, const std::string& key, const std::string& path,
                int depth) {
  switch (type) {
    case 0:
      return in.scalar<uint8_t>(key);
    case 1:
      return in.scalar<int8_t>(key);
    case 2:
      return in.scalar<uint16_t>(key);
    case 3:
      return in.scalar<int16_t>(key);
    case 4:
      return in.scalar<uint32_t>(key);
    case 5:
      return in.scalar<int32_t>(key);
    case 6: {
      // The shortest decimal that reads back as this float (1e-05, not 9.999999747378752e-06):
      // the value a config.json written from it should show.
      return std::stod(fmt::format("{}", in.scalar<float>(key)));
    }
    case 7: {
      const auto b = in.scalar<uint8_t>(key);
      if (b > 1) {
        throw std::invalid_argument(
            fmt::format("GGUF {}: metadata '{}' is a bool with value {}", path, key, b));
      }
      return b == 1;
    }
    case 8:
      return in.string(key);
    case 9: {
      if (depth >= kMaxArrayDepth) {
        throw std::invalid_argument(fmt::format(
            "GGUF {}: metadata '{}' nests arrays deeper than {}", path, key, kMaxArrayDepth));
      }
      const auto item_type = in.scalar<uint32_t>(key + " (array type)");
      if (item_type > 12) {
        throw std::invalid_argument(fmt::format(
            "GGUF {}: metadata '{}' is an array of unknown type {}", path, key, item_type));
      }
      const int64_t n = in.count(key + " (array length)", min_value_bytes(item_type));
      json out = json::array();
      for (int64_t i = 0; i < n; ++i)
        out.push_back(read_value(in, item_type, key, path, depth + 1));
      return out;
    }
    case 10:
      return in.scalar<uint64_t>(key);
    case 11:
      return in.scalar<int64_t>(key);
    case 12:
      return in.scalar<double>(key);
    default:
      throw std::invalid_argument(
          fmt::format("GGUF {}: metadata '{}' has unknown value type {}", path, key, type));
  }
}

// Dequantization of ggml blocks, written as whole-tensor torch ops over a [blocks, block bytes]
// view; the arithmetic (fp16 scale widened to fp32, then q * d (+ m)) is ggml's and gguf-py's.
torch::Tensor half_column(const torch::Tensor& blocks, int64_t at) {
  return blocks.narrow(1, at, 2).contiguous().view(torch::kHalf).to(torch::kFloat);
}

torch::Tensor nibbles(const torch::Tensor& packed) {
  // Element j of a 32-block is the low nibble of byte j, element j + 16 the high nibble.
  return torch::cat({packed.bitwise_and(0x0F), packed.bitwise_right_shift(4)}, 1).to(torch::kFloat);
}

bool readable(const std::string& type) {
  for (const char* name : {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}) {
    if (type == name) return true;
  }
  return false;
}

torch::Tensor dequantize(const torch::Tensor& raw, const GgufFile::Tensor& t) {
  if (t.type == "F32") return raw.view(torch::kFloat).clone();
  if (t.type == "F16") return raw.view(torch::kHalf).to(torch::kFloat);
  if (t.type == "BF16") return raw.view(torch::kBFloat16).to(torch::kFloat);
  if (t.type == "Q8_0") {
    const auto blocks = raw.view({-1, 34});
    return blocks.narrow(1, 2, 32).contiguous().view(torch::kChar).to(torch::kFloat) *
           half_column(blocks, 0);
  }
  if (t.type == "Q4_0") {
    const auto blocks = raw.view({-1, 18});
    return (nibbles(blocks.narrow(1, 2, 16)) - 8) * half_column(blocks, 0);
  }
  if (t.type == "Q4_1") {
    const auto blocks = raw.view({-1, 20});
    return nibbles(blocks.narrow(1, 4, 16)) * half_column(blocks, 0) + half_column(blocks, 2);
  }
  TORCH_INTERNAL_ASSERT(false, "dequantize: ", t.type, " is listed as readable but not handled");
}

struct FileCloser {
  int fd;
  ~FileCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

GgufFile::GgufFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("cannot open GGUF", path);
  FileCloser closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw io_error("cannot stat GGUF", path);
  Cursor in(fd, st.st_size, path_);

  char magic[4];
  in.read(magic, 4, "magic");
  if (std::string(magic, 4) != "GGUF") {
    throw std::invalid_argument(fmt::format("{}: not a GGUF file (its magic is not 'GGUF')", path));
  }
  version_ = in.scalar<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    // A big-endian file reads its version byte-swapped; say so rather than "version 50331648".
    const bool swapped = version_ == 0x02000000 || version_ == 0x03000000;
    throw std::invalid_argument(
        fmt::format("GGUF {}: {}", path,
                    swapped ? "big-endian files are not supported"
                            : fmt::format("version {} is not supported (2 and 3 are)", version_)));
  }
  // A tensor entry takes at least a name length, a dim count, one dim, a type and an offset.
  const int64_t n_tensors = in.count("tensor_count", 8 + 4 + 8 + 4 + 8);
  const int64_t n_metadata = in.count("metadata_kv_count", 8 + 4 + 1);

  metadata_ = json::object();
  for (int64_t i = 0; i < n_metadata; ++i) {
    std::string key = in.string(fmt::format("metadata key {}", i));
    const auto type = in.scalar<uint32_t>(fmt::format("metadata '{}' (type)", key));
    if (metadata_.contains(key)) {
      throw std::invalid_argument(fmt::format("GGUF {}: metadata '{}' appears twice", path, key));
    }
    metadata_[key] = read_value(in, type, key, path, 0);
  }

  int64_t alignment = 32;
  if (metadata_.contains("general.alignment")) {
    const json& a = metadata_["general.alignment"];
    if (!a.is_number_unsigned() || a.get<uint64_t>() == 0 || a.get<uint64_t>() > (1u << 20) ||
        (a.get<uint64_t>() & (a.get<uint64_t>() - 1)) != 0) {
      throw std::invalid_argument(fmt::format(
          "GGUF {}: metadata 'general.alignment' must be a power of two up to 2^20, got {}", path,
          a.dump(-1, ' ', false, json::error_handler_t::replace)));
    }
    alignment = a.get<int64_t>();
  }

  for (int64_t i = 0; i < n_tensors; ++i) {
    Tensor t;
    t.name = in.string(fmt::format("tensor {} name", i));
    const std::string field = fmt::format("tensor '{}'", t.name);
    const auto n_dims = in.scalar<uint32_t>(field + " (n_dims)");
    if (n_dims < 1 || n_dims > kMaxDims) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: {} has {} dims (1 to {} allowed)", path, field, n_dims, kMaxDims));
    }
    int64_t elements = 1;
    std::vector<int64_t> dims;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const auto dim = in.scalar<uint64_t>(field + " (dims)");
      if (dim == 0 || dim > static_cast<uint64_t>(kMaxElements / elements)) {
        throw std::invalid_argument(
            fmt::format("GGUF {}: {} has dim {} = {}, out of range (1 to 2^48 elements in all)",
                        path, field, d, dim));
      }
      elements *= static_cast<int64_t>(dim);
      dims.push_back(static_cast<int64_t>(dim));
    }
    t.shape.assign(dims.rbegin(), dims.rend());
    const auto type = in.scalar<uint32_t>(field + " (type)");
    const GgmlType* ggml =
        type < kGgmlTypes.size() && kGgmlTypes[type].name[0] != '\0' ? &kGgmlTypes[type] : nullptr;
    if (ggml == nullptr) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: {} has unknown ggml type {}", path, field, type));
    }
    t.type = ggml->name;
    if (dims[0] % ggml->block != 0) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: {} of type {} has a first dim {} that is not a multiple of its "
                      "block size {}",
                      path, field, t.type, dims[0], ggml->block));
    }
    t.bytes = ggml->bytes == 0 ? -1 : elements / ggml->block * ggml->bytes;
    const auto offset = in.scalar<uint64_t>(field + " (offset)");
    if (offset > static_cast<uint64_t>(st.st_size) || offset % alignment != 0) {
      throw std::invalid_argument(
          fmt::format("GGUF {}: {} has offset {}, outside the file or not {}-byte aligned", path,
                      field, offset, alignment));
    }
    t.offset = static_cast<int64_t>(offset);
    if (index_.count(t.name) != 0) {
      throw std::invalid_argument(fmt::format("GGUF {}: {} appears twice", path, field));
    }
    index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }

  // Offsets count from the aligned end of the header.
  const int64_t data_start = (in.position() + alignment - 1) / alignment * alignment;
  for (auto& t : tensors_) {
    t.offset += data_start;
    if (t.bytes >= 0 && t.offset + t.bytes > st.st_size) {
      throw std::invalid_argument(fmt::format(
          "GGUF {}: truncated: tensor '{}' ({} bytes at offset {}) ends past the file's {} bytes",
          path, t.name, t.bytes, t.offset, static_cast<int64_t>(st.st_size)));
    }
  }
}

const nlohmann::json& GgufFile::at(const std::string& key) const {
  if (!metadata_.contains(key)) {
    throw std::invalid_argument(fmt::format("GGUF {}: metadata '{}' is missing", path_, key));
  }
  return metadata_[key];
}

const GgufFile::Tensor& GgufFile::tensor(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    throw std::invalid_argument(fmt::format("GGUF {}: tensor '{}' is missing", path_, name));
  }
  return tensors_[it->second];
}

torch::Tensor GgufFile::read(const std::string& name) const {
  const Tensor& t = tensor(name);
  if (!readable(t.type)) {
    throw std::invalid_argument(fmt::format(
        "GGUF {}: tensor '{}' has type {}, which ShardRL does not read (it reads F32, F16, BF16, "
        "Q8_0, Q4_0 and Q4_1)",
        path_, t.name, t.type));
  }
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("cannot open GGUF", path_);
  FileCloser closer{fd};
  torch::Tensor raw = torch::empty({t.bytes}, torch::kUInt8);
  pread_exact(fd, raw.data_ptr(), t.bytes, t.offset, path_);
  return dequantize(raw, t).reshape(t.shape);
}

}  // namespace shardrl::checkpoint
