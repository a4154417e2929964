// TensorBoard's event files as the trainer writes them: CRC-32C, TFRecord framing, file names.
// The events themselves are read by TensorBoard's own reader in tests/test_trainer.cpp and
// tests/test_diffusion_rl.cpp, on runs of `shardrl train`.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../src/trainer/tensorboard.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;

uint32_t crc_of(const std::string& s) {
  return trainer::crc32c(s.data(), s.size());
}

// RFC 3720 (iSCSI), appendix B.4, and the customary check value.
TEST(TensorBoard, Crc32cMatchesPublishedValues) {
  EXPECT_EQ(crc_of("123456789"), 0xE3069283u);
  EXPECT_EQ(crc_of(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc_of(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending += static_cast<char>(i);
  EXPECT_EQ(crc_of(ascending), 0x46DD794Eu);
  const uint32_t crc = crc_of("123456789");
  EXPECT_EQ(trainer::masked_crc32c("123456789", 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

uint64_t little_endian(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

TEST(TensorBoard, RecordFramesItsDataWithMaskedChecksums) {
  const std::string data = "event bytes";
  const std::string record = trainer::tf_record(data);
  ASSERT_EQ(record.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(little_endian(record, 0, 8), data.size());
  EXPECT_EQ(little_endian(record, 8, 4), trainer::masked_crc32c(record.data(), 8));
  EXPECT_EQ(record.substr(12, data.size()), data);
  EXPECT_EQ(little_endian(record, 12 + data.size(), 4),
            trainer::masked_crc32c(data.data(), data.size()));
}

// Event files sort after those already in the folder, whatever the clock: TensorBoard reads a
// folder's files in name order, and a resumed run's steps must come after its first part's.
TEST(TensorBoard, NewEventFilesSortAfterTheFolders) {
  const auto dir = make_temp_dir("tensorboard_names");
  const std::string future = dir + "/events.out.tfevents.9999999990.zzz.1.0";
  std::ofstream(future) << "";
  trainer::TensorBoardWriter writer(dir);
  const std::string name = fs::path(writer.path()).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.9999999991.", 0), 0u) << name;
  EXPECT_GT(name, fs::path(future).filename().string());
  trainer::TensorBoardWriter second(dir);
  EXPECT_GT(second.path(), writer.path());
  // The file_version event is there from the start: a run killed before its first step still
  // leaves a readable file.
  EXPECT_GT(fs::file_size(writer.path()), 16u);
}

TEST(TensorBoard, UnwritableFolderIsAnErrorNamingIt) {
  const auto dir = make_temp_dir("tensorboard_unwritable");
  std::ofstream(dir + "/file") << "";
  try {
    trainer::TensorBoardWriter writer(dir + "/file/tb");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/file/tb"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardrl::testing
