// File-level helpers shared by the checkpoint sources: POSIX I/O with errors that name the file.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace shardrl::checkpoint {

// The most elements the file parsers accept in one tensor's shape: far beyond any real tensor,
// and small enough that elements times an element size cannot overflow int64.
constexpr int64_t kMaxTensorElements = int64_t{1} << 48;

// "<what> <path>: <strerror(errno)>".
std::runtime_error io_error(const std::string& what, const std::string& path);
uint32_t crc32_update(uint32_t crc, const void* data, int64_t n);
// Reads exactly n bytes at offset; end of file first is a truncation error naming path.
void pread_exact(int fd, void* out, int64_t n, int64_t offset, const std::string& path);
// fsync of a file or a directory (the latter makes creates and renames in it durable).
void fsync_path(const std::string& path);
// Creates or replaces path with content and fsyncs it.
void write_file_durably(const std::string& path, const std::string& content);

}  // namespace shardrl::checkpoint
