// The safetensors format: an 8-byte little-endian header length, a JSON header mapping each
// tensor to {dtype, shape, data_offsets} (offsets relative to the end of the header), then the
// raw little-endian data. The header is padded with spaces to 8 bytes so data stays aligned.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "build_config.h"
#if SHARDRL_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "checkpoint/io.h"
#include "shardrl/checkpoint.h"

namespace shardrl::checkpoint {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; this build writes the host's bytes");

// A header larger than this is a damaged file, not a real model.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

const std::vector<std::pair<torch::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<torch::ScalarType, const char*>> names = {
      {torch::kFloat, "F32"},  {torch::kBFloat16, "BF16"}, {torch::kHalf, "F16"},
      {torch::kDouble, "F64"}, {torch::kLong, "I64"},      {torch::kInt, "I32"},
      {torch::kShort, "I16"},  {torch::kChar, "I8"},       {torch::kByte, "U8"},
      {torch::kBool, "BOOL"}};
  return names;
}

// nlohmann converts a number such as 1e30 to int64_t with undefined behaviour: sizes and offsets
// must be written as integers that fit.
std::vector<int64_t> integers(const nlohmann::json& value, const std::string& path,
                              const std::string& tensor, const char* field) {
  bool ok = value.is_array();
  for (size_t i = 0; ok && i < value.size(); ++i) {
    ok = value[i].is_number_integer() &&
         !(value[i].is_number_unsigned() &&
           value[i].get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
  }
  if (!ok) {
    throw std::runtime_error(
        fmt::format("{}: tensor '{}' {} must be a list of integers, got {}", path, tensor, field,
                    value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
  }
  return value.get<std::vector<int64_t>>();
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

std::string dtype_name(torch::ScalarType dtype) {
  for (const auto& [type, name] : dtype_names()) {
    if (type == dtype) return name;
  }
  throw std::invalid_argument(
      fmt::format("safetensors: dtype {} has no safetensors name", c10::toString(dtype)));
}

torch::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  for (const auto& [type, known] : dtype_names()) {
    if (name == known) return type;
  }
  throw std::runtime_error(fmt::format("{}: unsupported safetensors dtype '{}'", where, name));
}

int64_t TensorInfo::nbytes() const {
  return numel_of(shape) * static_cast<int64_t>(c10::elementSize(dtype));
}

// ---- writer ------------------------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorInfo> tensors,
                                     const std::map<std::string, std::string>& metadata,
                                     Progress progress)
    : path_(std::move(path)), tensors_(std::move(tensors)), progress_(std::move(progress)) {
  blocks_.block_bytes = BlockChecksums::kDefaultBlockBytes;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t cursor = 0;
  for (auto& t : tensors_) {
    if (header.contains(t.name)) {
      throw std::invalid_argument(fmt::format("{}: tensor '{}' declared twice", path_, t.name));
    }
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {cursor, cursor + t.nbytes()}}};
    t.offset = cursor;
    cursor += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  for (auto& t : tensors_) t.offset += 8 + static_cast<int64_t>(text.size());

  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw io_error("cannot create", path_);
  const uint64_t length = text.size();
  write_bytes(&length, sizeof(length));
  write_bytes(text.data(), static_cast<int64_t>(text.size()));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::write_bytes(const void* data, int64_t n) {
  const char* p = static_cast<const char*>(data);
  // Block checksums while the bytes are in cache; the whole-file crc is combined from them.
  for (int64_t done = 0; done < n;) {
    const int64_t in_block = (written_ + done) % blocks_.block_bytes;
    if (in_block == 0) blocks_.crc32.push_back(0);
    const int64_t take = std::min(n - done, blocks_.block_bytes - in_block);
    blocks_.crc32.back() = crc32_update(blocks_.crc32.back(), p + done, take);
    done += take;
  }
  while (n > 0) {
    // Bounded chunks: write(2) may transfer at most ~2 GiB at once.
    const ssize_t done = ::write(fd_, p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)));
    if (done < 0) {
      if (errno == EINTR) continue;
      throw io_error("cannot write", path_);
    }
    p += done;
    n -= done;
    written_ += done;
  }
}

void SafetensorsWriter::write(const std::string& name, const torch::Tensor& tensor) {
  if (fd_ < 0) throw std::logic_error(fmt::format("{}: write after close", path_));
  if (next_ >= tensors_.size() || tensors_[next_].name != name) {
    throw std::logic_error(fmt::format(
        "{}: tensor '{}' written out of order (expected '{}')", path_, name,
        next_ < tensors_.size() ? tensors_[next_].name : std::string("<none: all written>")));
  }
  const TensorInfo& info = tensors_[next_];
  if (tensor.scalar_type() != info.dtype || tensor.numel() != numel_of(info.shape)) {
    throw std::invalid_argument(fmt::format("{}: tensor '{}' is {} {}, declared {} {}", path_, name,
                                            c10::toString(tensor.scalar_type()),
                                            c10::str(tensor.sizes()), c10::toString(info.dtype),
                                            c10::str(c10::IntArrayRef(info.shape))));
  }
  const torch::Tensor data = tensor.detach().to(torch::kCPU).contiguous();
  write_bytes(data.data_ptr(), info.nbytes());
  ++next_;
  if (progress_) progress_(path_, written_);
}

FileSummary SafetensorsWriter::close() {
  if (next_ != tensors_.size()) {
    throw std::logic_error(
        fmt::format("{}: closed after {} of {} tensors", path_, next_, tensors_.size()));
  }
  if (::fsync(fd_) != 0) throw io_error("cannot fsync", path_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw io_error("cannot close", path_);
  uint32_t crc = 0;
  for (size_t i = 0; i < blocks_.crc32.size(); ++i) {
    const int64_t length =
        std::min(blocks_.block_bytes, written_ - static_cast<int64_t>(i) * blocks_.block_bytes);
    crc = static_cast<uint32_t>(::crc32_combine(crc, blocks_.crc32[i], length));
  }
  return {path_, written_, crc, blocks_};
}

// ---- reader ------------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(std::string path, BlockChecksums checksums)
    : path_(std::move(path)), checksums_(std::move(checksums)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw io_error("cannot open", path_);
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw io_error("cannot stat", path_);
    file_size_ = st.st_size;
    if (checksums_.block_bytes < 0) {
      throw std::invalid_argument(fmt::format("{}: negative checksum block size", path_));
    }
    if (!checksums_.empty()) {
      // Rounded up without an addition that a huge block size would overflow.
      const int64_t blocks =
          file_size_ / checksums_.block_bytes + (file_size_ % checksums_.block_bytes != 0);
      if (blocks != static_cast<int64_t>(checksums_.crc32.size())) {
        throw std::runtime_error(
            fmt::format("checkpoint file {} is truncated or resized: {} bytes do not fit its {} "
                        "block checksums",
                        path_, file_size_, checksums_.crc32.size()));
      }
      verified_.assign(checksums_.crc32.size(), false);
    }
    uint64_t length = 0;
    if (file_size_ < 8) {
      throw std::runtime_error(
          fmt::format("{}: truncated: {} bytes, no safetensors header", path_, file_size_));
    }
    read_bytes(&length, 8, 0);
    if (length > kMaxHeaderBytes || static_cast<int64_t>(length) > file_size_ - 8) {
      throw std::runtime_error(
          fmt::format("{}: damaged: header length {} does not fit the {}-byte file", path_, length,
                      file_size_));
    }
    std::string text(length, '\0');
    read_bytes(text.data(), static_cast<int64_t>(length), 8);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(fmt::format("{}: damaged safetensors header: {}", path_, e.what()));
    }
    const int64_t data_start = 8 + static_cast<int64_t>(length);
    try {
      for (const auto& [name, entry] : header.items()) {
        if (name == "__metadata__") {
          for (const auto& [k, v] : entry.items()) metadata_[k] = v.get<std::string>();
          continue;
        }
        TensorInfo info;
        info.name = name;
        info.dtype = dtype_from_name(entry.at("dtype").get<std::string>(), path_);
        info.shape = integers(entry.at("shape"), path_, name, "shape");
        // Sizes are checked before any arithmetic on them, so none can overflow.
        int64_t elements = 1;
        for (int64_t d : info.shape) {
          if (d < 0 || (d != 0 && elements > kMaxTensorElements / d)) {
            throw std::runtime_error(fmt::format(
                "{}: tensor '{}' has shape {}: sizes must be >= 0, at most 2^48 elements", path_,
                name, entry.at("shape").dump()));
          }
          if (d != 0) elements *= d;
        }
        const auto offsets = integers(entry.at("data_offsets"), path_, name, "data_offsets");
        if (offsets.size() != 2 || offsets[0] < 0 || offsets[1] < offsets[0] ||
            offsets[1] > file_size_ - data_start || offsets[1] - offsets[0] != info.nbytes()) {
          throw std::runtime_error(
              fmt::format("{}: tensor '{}' data_offsets do not match its shape or the {}-byte file "
                          "(truncated?)",
                          path_, name, file_size_));
        }
        info.offset = data_start + offsets[0];
        tensors_.push_back(std::move(info));
      }
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(fmt::format("{}: damaged safetensors header: {}", path_, e.what()));
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorInfo& a, const TensorInfo& b) { return a.offset < b.offset; });
    for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (...) {
    // A constructor that throws runs no destructor: without this, every damaged file would leak
    // a descriptor, and a process that meets enough of them could open no more files.
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    throw std::runtime_error(fmt::format("{}: no tensor '{}'", path_, name));
  }
  return tensors_[it->second];
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

torch::Tensor SafetensorsReader::read(const std::string& name) const {
  const TensorInfo& t = info(name);
  torch::Tensor out = torch::empty(t.shape, torch::dtype(t.dtype));
  read_bytes(out.data_ptr(), t.nbytes(), t.offset);
  return out;
}

torch::Tensor SafetensorsReader::read_rows(const std::string& name, int64_t first,
                                           int64_t rows) const {
  const TensorInfo& t = info(name);
  std::vector<int64_t> shape = t.shape.empty() ? std::vector<int64_t>{1} : t.shape;
  shape[0] = rows;
  torch::Tensor out = torch::empty(shape, torch::dtype(t.dtype));
  read_rows_into(name, first, rows, out);
  return out;
}

void SafetensorsReader::read_rows_into(const std::string& name, int64_t first, int64_t rows,
                                       const torch::Tensor& out) const {
  const TensorInfo& t = info(name);
  const int64_t total_rows = t.shape.empty() ? 1 : t.shape[0];
  if (first < 0 || rows < 0 || first + rows > total_rows) {
    throw std::out_of_range(fmt::format("{}: rows [{}, {}) of '{}' outside its {} rows", path_,
                                        first, first + rows, name, total_rows));
  }
  const int64_t row_bytes = total_rows == 0 ? 0 : t.nbytes() / total_rows;
  if (!out.is_contiguous() || out.scalar_type() != t.dtype ||
      out.numel() * static_cast<int64_t>(out.element_size()) != rows * row_bytes) {
    throw std::invalid_argument(
        fmt::format("{}: '{}' rows read into a mismatched tensor", path_, name));
  }
  read_bytes(out.data_ptr(), rows * row_bytes, t.offset + first * row_bytes);
}

void SafetensorsReader::check_block(int64_t block, const char* data) const {
  const int64_t begin = block * checksums_.block_bytes;
  const int64_t length = std::min(checksums_.block_bytes, file_size_ - begin);
  const uint32_t crc = crc32_update(0, data, length);
  if (crc != checksums_.crc32[block]) {
    throw std::runtime_error(fmt::format(
        "checkpoint file {} is damaged: crc32 {:08x} of bytes [{}, {}), the index says {:08x}",
        path_, crc, begin, begin + length, checksums_.crc32[block]));
  }
  verified_[block] = true;
}

void SafetensorsReader::read_bytes(void* out, int64_t n, int64_t offset) const {
  if (checksums_.empty()) {
    pread_exact(fd_, out, n, offset, path_);
    return;
  }
  // The kernel fetches the rest of the range while the blocks already read are checked, so the
  // checksum costs no I/O time on a cold read.
  if (n > checksums_.block_bytes) ::posix_fadvise(fd_, offset, n, POSIX_FADV_WILLNEED);
  char* dst = static_cast<char*>(out);
  const int64_t end = offset + n;
  while (offset < end) {
    const int64_t block = offset / checksums_.block_bytes;
    const int64_t begin = block * checksums_.block_bytes;
    const int64_t stop = std::min(begin + checksums_.block_bytes, file_size_);
    const int64_t take = std::min(end, stop) - offset;
    if (block == cached_block_) {
      std::memcpy(dst, cache_.data() + (offset - begin), static_cast<size_t>(take));
    } else if (verified_[block] || (offset == begin && take == stop - begin)) {
      // Straight into the destination; a whole block is checked there, while still in cache.
      pread_exact(fd_, dst, take, offset, path_);
      if (!verified_[block]) check_block(block, dst);
    } else {
      // Part of an unchecked block: the whole block is read once, checked, and kept, since the
      // next small tensor usually lies in the same block.
      cache_.resize(static_cast<size_t>(stop - begin));
      cached_block_ = -1;
      pread_exact(fd_, cache_.data(), stop - begin, begin, path_);
      check_block(block, cache_.data());
      cached_block_ = block;
      std::memcpy(dst, cache_.data() + (offset - begin), static_cast<size_t>(take));
    }
    dst += take;
    offset += take;
  }
}

uint32_t file_crc32(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("cannot open", path);
  std::vector<char> buffer(size_t{8} << 20);
  uint32_t crc = 0;
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const auto error = io_error("cannot read", path);
      ::close(fd);
      throw error;
    }
    if (n == 0) break;
    crc = crc32_update(crc, buffer.data(), n);
  }
  ::close(fd);
  return crc;
}

// ---- io.h --------------------------------------------------------------------------------------

std::runtime_error io_error(const std::string& what, const std::string& path) {
  return std::runtime_error(fmt::format("{} {}: {}", what, path, std::strerror(errno)));
}

uint32_t crc32_update(uint32_t crc, const void* data, int64_t n) {
#if SHARDRL_HAVE_ISAL
  // The same polynomial, reflection and inversion as zlib's crc32: the values are identical.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), static_cast<uint64_t>(n));
#else
  const auto* p = static_cast<const Bytef*>(data);
  uLong value = crc;
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<int64_t>(n, 1 << 30));
    value = ::crc32(value, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<uint32_t>(value);
#endif
}

void pread_exact(int fd, void* out, int64_t n, int64_t offset, const std::string& path) {
  char* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw io_error("cannot read", path);
    if (got == 0) {
      throw std::runtime_error(
          fmt::format("{}: truncated: unexpected end of file at byte {}", path, offset));
    }
    p += got;
    n -= got;
    offset += got;
  }
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("cannot open", path);
  const int rc = ::fsync(fd);
  const auto error = rc != 0 ? io_error("cannot fsync", path) : std::runtime_error("");
  ::close(fd);
  if (rc != 0) throw error;
}

void write_file_durably(const std::string& path, const std::string& content) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw io_error("cannot create", path);
  const char* p = content.data();
  size_t left = content.size();
  while (left > 0) {
    const ssize_t done = ::write(fd, p, left);
    if (done < 0 && errno == EINTR) continue;
    if (done < 0) {
      const auto error = io_error("cannot write", path);
      ::close(fd);
      throw error;
    }
    p += done;
    left -= static_cast<size_t>(done);
  }
  if (::fsync(fd) != 0) {
    const auto error = io_error("cannot fsync", path);
    ::close(fd);
    throw error;
  }
  if (::close(fd) != 0) throw io_error("cannot close", path);
}

}  // namespace shardrl::checkpoint
