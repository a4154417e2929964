// Internal to the trainer: TensorBoard event files, written as TensorFlow's summary writer writes
// them, without TensorFlow or a protobuf library.
//
// An event file is a sequence of TFRecords: the length of the data (uint64, little-endian), the
// masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data. Each record's data is
// a serialized tensorflow.Event (tensorflow/core/util/event.proto): the first carries file_version
// "brain.Event:2", the others a Summary (tensorflow/core/framework/summary.proto) of scalars
// (simple_value), PNG images (Summary.Image) or text (a string tensor whose metadata names the
// "text" plugin), or a SessionLog. The protobuf wire format is written by hand: varints, fixed
// 32/64-bit numbers and length-delimited fields.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace shardrl::trainer {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord frames use it.
uint32_t crc32c(const void* data, size_t size);
// TFRecord's masked form: rotated right by 15 bits plus 0xa282ead8, so that the CRC of bytes that
// hold CRCs is not degenerate.
uint32_t masked_crc32c(const void* data, size_t size);
// One TFRecord: the frame around `data`.
std::string tf_record(const std::string& data);

class TensorBoardWriter {
 public:
  // Opens a new event file in `dir` (created if missing) and writes the file_version event. The
  // file is named as TensorFlow names them, events.out.tfevents.<seconds>.<host>.<pid>.<n>, with
  // <seconds> raised if need be so that it sorts after every event file already in `dir`:
  // TensorBoard reads a folder's files in name order. Errors name the file.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::string& path() const { return path_; }

  // A SessionLog START at `step`: TensorBoard forgets whatever the folder's earlier files logged
  // at `step` and after, as for a run that restarted there (a resumed run at the step after its
  // checkpoint, a fresh one at 0), so that no step shows twice.
  void start_session(int64_t step);
  // One event with every value as a scalar (float32, as TensorBoard stores them).
  void add_scalars(int64_t step, const std::map<std::string, double>& values);
  // uint8 [H, W], [H, W, 1] (grey) or [H, W, 3] (RGB), stored as PNG.
  void add_image(int64_t step, const std::string& tag, const torch::Tensor& image);
  // Markdown, which TensorBoard's text dashboard renders.
  void add_text(int64_t step, const std::string& tag, const std::string& markdown);
  // Hands what was written to the operating system, so that a killed run keeps it.
  void flush();

 private:
  // A serialized Event with wall_time and step, and `fields` (serialized fields of Event) after.
  void write_event(int64_t step, const std::string& fields);

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace shardrl::trainer
