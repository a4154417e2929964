#include "tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "shardrl/data.h"

namespace shardrl::trainer {
// Named rather than anonymous: the unity build compiles this file with others of the library.
namespace tfevents {

// ---- the protobuf wire format ---------------------------------------------------------------

enum class WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// The serialized fields of one message, appended in field order.
class ProtoFields {
 public:
  ProtoFields& varint(uint32_t field, uint64_t value) {
    key(field, WireType::kVarint);
    raw_varint(value);
    return *this;
  }
  // A double (fixed64) or a float (fixed32), little-endian.
  template <class Number>
  ProtoFields& fixed(uint32_t field, Number value) {
    static_assert(sizeof(Number) == 8 || sizeof(Number) == 4);
    key(field, sizeof(Number) == 8 ? WireType::kFixed64 : WireType::kFixed32);
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(Number));
    for (size_t i = 0; i < sizeof(Number); ++i) out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
    return *this;
  }
  // Strings, bytes and embedded messages.
  ProtoFields& bytes(uint32_t field, const std::string& value) {
    key(field, WireType::kLengthDelimited);
    raw_varint(value.size());
    out_ += value;
    return *this;
  }
  ProtoFields& message(uint32_t field, const ProtoFields& value) {
    return bytes(field, value.out_);
  }
  const std::string& str() const { return out_; }

 private:
  void key(uint32_t field, WireType type) {
    raw_varint((uint64_t{field} << 3) | static_cast<uint32_t>(type));
  }
  void raw_varint(uint64_t value) {
    while (value >= 0x80) {
      out_ += static_cast<char>((value & 0x7f) | 0x80);
      value >>= 7;
    }
    out_ += static_cast<char>(value);
  }

  std::string out_;
};

// Field numbers of the messages written (event.proto, summary.proto, tensor.proto,
// tensor_shape.proto, types.proto).
namespace pb {
namespace event {
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
}
namespace session_log {
constexpr uint32_t kStatus = 1;
constexpr uint64_t kStart = 1;
}  // namespace session_log
namespace summary {
constexpr uint32_t kValue = 1;
}
namespace value {
constexpr uint32_t kTag = 1, kSimpleValue = 2, kImage = 4, kTensor = 8, kMetadata = 9;
}
namespace image {
constexpr uint32_t kHeight = 1, kWidth = 2, kColorspace = 3, kEncodedImageString = 4;
}
namespace metadata {
constexpr uint32_t kPluginData = 1;
}
namespace plugin_data {
constexpr uint32_t kPluginName = 1, kContent = 2;
}
namespace tensor {
constexpr uint32_t kDtype = 1, kTensorShape = 2, kStringVal = 8;
constexpr uint64_t kDtString = 7;  // DataType DT_STRING
}  // namespace tensor
namespace tensor_shape {
constexpr uint32_t kDim = 2, kDimSize = 1;
}
}  // namespace pb

// The Event field `summary` holding a Summary of `values` (each a serialized Summary.Value).
std::string summary_field(const std::vector<ProtoFields>& values) {
  ProtoFields summary;
  for (const auto& v : values) summary.message(pb::summary::kValue, v);
  ProtoFields field;
  field.message(pb::event::kSummary, summary);
  return field.str();
}

// ---- CRC-32C --------------------------------------------------------------------------------

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    table[i] = crc;
  }
  return table;
}

// Event file names from this process, numbered as TensorFlow numbers them.
std::atomic<int> files_opened{0};

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// "events.out.tfevents.<seconds>.<rest>" -> seconds; -1 for other names.
int64_t seconds_in_name(const std::string& name) {
  static const std::string prefix = "events.out.tfevents.";
  if (name.rfind(prefix, 0) != 0) return -1;
  const size_t end = name.find('.', prefix.size());
  const std::string digits = name.substr(prefix.size(), end - prefix.size());
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(digits);
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace tfevents

uint32_t crc32c(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = tfevents::make_crc32c_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tf_record(const std::string& data) {
  std::string record;
  record.reserve(data.size() + 16);
  const uint64_t length = data.size();
  char header[8];
  for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  const auto append_u32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) record += static_cast<char>((v >> (8 * i)) & 0xff);
  };
  record.append(header, 8);
  append_u32(masked_crc32c(header, 8));
  record += data;
  append_u32(masked_crc32c(data.data(), data.size()));
  return record;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  namespace fs = std::filesystem;
  namespace pb = tfevents::pb;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw std::runtime_error(
        fmt::format("cannot create the TensorBoard folder '{}': {}", dir, ec.message()));
  }
  const std::string host = tfevents::hostname();
  const int n = tfevents::files_opened++;
  auto name_at = [&](int64_t seconds) {
    return fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", seconds, host, getpid(), n);
  };
  auto seconds = static_cast<int64_t>(tfevents::wall_seconds());
  // A resumed run that starts within the second its first part did, or a clock set back, would
  // otherwise name a file that TensorBoard reads before the older one.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string existing = entry.path().filename().string();
    const int64_t s = tfevents::seconds_in_name(existing);
    if (s >= 0 && existing >= name_at(seconds)) seconds = s + 1;
  }
  path_ = (fs::path(dir) / name_at(seconds)).string();
  file_ = std::fopen(path_.c_str(), "wbx");
  if (!file_) {
    throw std::runtime_error(fmt::format("cannot create the TensorBoard event file '{}': {}", path_,
                                         std::strerror(errno)));
  }
  tfevents::ProtoFields version;
  version.bytes(pb::event::kFileVersion, "brain.Event:2");
  write_event(0, version.str());
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_event(int64_t step, const std::string& fields) {
  namespace pb = tfevents::pb;
  tfevents::ProtoFields e;
  e.fixed(pb::event::kWallTime, tfevents::wall_seconds());
  e.varint(pb::event::kStep, static_cast<uint64_t>(step));
  const std::string record = tf_record(e.str() + fields);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) {
    throw std::runtime_error(
        fmt::format("cannot write TensorBoard events to '{}': {}", path_, std::strerror(errno)));
  }
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0) {
    throw std::runtime_error(
        fmt::format("cannot write TensorBoard events to '{}': {}", path_, std::strerror(errno)));
  }
}

void TensorBoardWriter::start_session(int64_t step) {
  namespace pb = tfevents::pb;
  tfevents::ProtoFields status, field;
  status.varint(pb::session_log::kStatus, pb::session_log::kStart);
  field.message(pb::event::kSessionLog, status);
  write_event(step, field.str());
}

void TensorBoardWriter::add_scalars(int64_t step, const std::map<std::string, double>& values) {
  namespace pb = tfevents::pb;
  std::vector<tfevents::ProtoFields> scalars(values.size());
  size_t i = 0;
  for (const auto& [tag, v] : values) {
    scalars[i++].bytes(pb::value::kTag, tag).fixed(pb::value::kSimpleValue, static_cast<float>(v));
  }
  write_event(step, tfevents::summary_field(scalars));
}

void TensorBoardWriter::add_image(int64_t step, const std::string& tag,
                                  const torch::Tensor& picture) {
  namespace pb = tfevents::pb;
  const torch::Tensor hwc = picture.dim() == 2 ? picture.unsqueeze(2) : picture;
  tfevents::ProtoFields img;
  img.varint(pb::image::kHeight, static_cast<uint64_t>(hwc.size(0)))
      .varint(pb::image::kWidth, static_cast<uint64_t>(hwc.size(1)))
      .varint(pb::image::kColorspace,
              static_cast<uint64_t>(hwc.size(2)))  // 1 grey, 3 RGB
      .bytes(pb::image::kEncodedImageString, data::encode_png(picture));
  std::vector<tfevents::ProtoFields> v(1);
  v[0].bytes(pb::value::kTag, tag).message(pb::value::kImage, img);
  write_event(step, tfevents::summary_field(v));
}

void TensorBoardWriter::add_text(int64_t step, const std::string& tag,
                                 const std::string& markdown) {
  namespace pb = tfevents::pb;
  // TextPluginData (version 0) serializes to no bytes: the plugin's name is what marks text.
  tfevents::ProtoFields plugin, plugin_metadata, dim, shape, strings;
  plugin.bytes(pb::plugin_data::kPluginName, "text").bytes(pb::plugin_data::kContent, "");
  plugin_metadata.message(pb::metadata::kPluginData, plugin);
  dim.varint(pb::tensor_shape::kDimSize, 1);
  shape.message(pb::tensor_shape::kDim, dim);
  strings.varint(pb::tensor::kDtype, pb::tensor::kDtString)
      .message(pb::tensor::kTensorShape, shape)
      .bytes(pb::tensor::kStringVal, markdown);
  std::vector<tfevents::ProtoFields> v(1);
  v[0].bytes(pb::value::kTag, tag)
      .message(pb::value::kMetadata, plugin_metadata)
      .message(pb::value::kTensor, strings);
  write_event(step, tfevents::summary_field(v));
}

}  // namespace shardrl::trainer
