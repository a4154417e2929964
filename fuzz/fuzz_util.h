// What the harnesses share: a scratch directory for the files a parser reads by path, and the
// rule that decides what counts as a finding.
//
// A parser given bad bytes may only throw one of our clear errors: a std::runtime_error,
// std::invalid_argument or std::out_of_range whose message names the file (or source) it read.
// Anything else is a finding and aborts, so libFuzzer saves the input: a library's own exception
// escaping (nlohmann::json, c10::Error, YAML::Exception), std::bad_alloc or std::length_error from
// a size field taken on trust, an error that does not say which file, and of course every crash
// and ASan/UBSan report.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardrl::fuzz {

[[noreturn]] inline void finding(const char* what, const std::string& message) {
  std::fprintf(stderr, "FUZZ FINDING: %s: %s\n", what, message.c_str());
  std::abort();
}

// A directory of this process's own under /dev/shm (no disk writes per input), or TMPDIR.
inline const std::string& scratch_dir() {
  // Never destroyed: the atexit handler that removes it runs after static destructors.
  static const std::string& dir = *new std::string([] {
    namespace fs = std::filesystem;
    const fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path dir = base / ("shardrl-fuzz-" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(scratch_dir(), ec);
    });
    return dir.string();
  }());
  return dir;
}

// Replaces the file at path with exactly these bytes.
inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  // EMFILE here means the parser leaks a file descriptor per input.
  if (fd < 0) finding("harness", "cannot create " + path + ": " + std::strerror(errno));
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) finding("harness", "cannot write " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// The input's NUL-separated parts: a harness whose input stands for several files splits it so.
inline std::vector<std::string> split_parts(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      parts.emplace_back();
    } else {
      parts.back() += static_cast<char>(data[i]);
    }
  }
  return parts;
}

inline void write_file(const std::string& path, const std::string& text) {
  write_file(path, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// Copies the fixed files a harness reads beside its input (fuzz/data/<name>) into dir.
inline void copy_data(const std::string& name, const std::string& dir) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  for (const auto& file :
       fs::directory_iterator(fs::path(SHARDRL_SOURCE_DIR) / "fuzz" / "data" / name)) {
    fs::copy_file(file.path(), fs::path(dir) / file.path().filename(),
                  fs::copy_options::overwrite_existing);
  }
}

// Runs parse(); returns normally when it succeeds or throws a clear error mentioning one of
// `names` (the file, or the override it comes from).
template <class F>
void expect_clear_errors(const std::vector<std::string>& names, F&& parse) {
  auto check = [&](const std::exception& e) {
    for (const auto& name : names) {
      if (std::string(e.what()).find(name) != std::string::npos) return;
    }
    finding("an error that does not name the file", e.what());
  };
  try {
    parse();
  } catch (const std::bad_alloc& e) {
    finding("std::bad_alloc (a size taken on trust)", e.what());
  } catch (const std::length_error& e) {
    finding("std::length_error (a size taken on trust)", e.what());
  } catch (const std::runtime_error& e) {
    check(e);
  } catch (const std::invalid_argument& e) {
    check(e);
  } catch (const std::out_of_range& e) {
    check(e);
  } catch (const std::exception& e) {
    finding("a library's exception escaped", e.what());
  }
}

}  // namespace shardrl::fuzz
