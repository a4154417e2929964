// Memory readings of the benchmarks: this process's resident set from /proc/self/status.
#pragma once

#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace shardrl::bench {

// Resident set size of this process in bytes, from /proc/self/status (VmRSS or VmHWM).
inline int64_t proc_status_bytes(const char* field) {
  const int fd = ::open("/proc/self/status", O_RDONLY);
  if (fd < 0) return -1;
  char buf[4096];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return -1;
  buf[n] = '\0';
  const char* at = std::strstr(buf, field);
  if (!at) return -1;
  return std::strtoll(at + std::strlen(field) + 1, nullptr, 10) * 1024;  // "VmRSS:   123 kB"
}
inline int64_t rss_bytes() {
  return proc_status_bytes("VmRSS");
}

// Resets VmHWM to the current RSS (Linux >= 4.0), so that it measures the peak of what follows.
inline void reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  if (!clear_refs.flush()) throw std::runtime_error("cannot reset VmHWM via /proc/self/clear_refs");
}

// Returns free heap pages to the kernel so that an RSS increase shows fresh memory rather than
// being hidden by blocks the previous phase freed (the malloc policy keeps large blocks resident).
inline int64_t trimmed_rss() {
  malloc_trim(0);
  return rss_bytes();
}

}  // namespace shardrl::bench
