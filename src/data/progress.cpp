#include "shardrl/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace shardrl {
namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// On a terminal the bar is redrawn at most this often, and first drawn after this long, so that
// a stage of a moment leaves nothing behind.
constexpr double kRedrawSeconds = 0.25;
constexpr int kBarWidth = 24;

}  // namespace

double progress_line_seconds() {
  const char* env = std::getenv("SHARDRL_PROGRESS_SECONDS");
  if (env == nullptr || *env == '\0') return 10.0;
  char* end = nullptr;
  const double seconds = std::strtod(env, &end);
  if (*end != '\0' || !(seconds >= 0) || !std::isfinite(seconds)) {
    throw std::invalid_argument(fmt::format(
        "environment variable SHARDRL_PROGRESS_SECONDS must be a number of seconds >= 0, got '{}'",
        env));
  }
  return seconds;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  if (seconds < 0.1) return fmt::format("{:.0f}ms", seconds * 1000);
  if (seconds < 10) return fmt::format("{:.1f}s", seconds);
  const auto whole = static_cast<int64_t>(std::llround(seconds));
  if (whole < 60) return fmt::format("{}s", whole);
  if (whole < 3600) return fmt::format("{}m{:02d}s", whole / 60, whole % 60);
  return fmt::format("{}h{:02d}m", whole / 3600, (whole % 3600) / 60);
}

std::string format_bytes(double bytes) {
  if (bytes < 1e3) return fmt::format("{:.0f} B", bytes);
  if (bytes < 1e6) return fmt::format("{:.1f} KB", bytes / 1e3);
  if (bytes < 1e9) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.2f} GB", bytes / 1e9);
}

Progress::Progress(std::string what, int64_t total, Options options)
    : what_(std::move(what)), total_(total), options_(std::move(options)) {
  line_seconds_ = options_.line_seconds ? *options_.line_seconds : progress_line_seconds();
  terminal_ = options_.terminal ? *options_.terminal : isatty(STDOUT_FILENO) != 0;
  start_ = last_print_ = now();
}

Progress::~Progress() {
  try {
    finish();
  } catch (...) {
    // Console output must not turn an unwinding error into std::terminate.
  }
}

double Progress::now() const {
  return options_.clock ? options_.clock() : steady_seconds();
}

std::string Progress::counts(int64_t done) const {
  if (options_.unit == "B") {
    return total_ > 0 ? fmt::format("{}/{}", format_bytes(static_cast<double>(done)),
                                    format_bytes(static_cast<double>(total_)))
                      : format_bytes(static_cast<double>(done));
  }
  return total_ > 0 ? fmt::format("{}/{} {}", done, total_, options_.unit)
                    : fmt::format("{} {}", done, options_.unit);
}

std::string Progress::rate(double per_second) const {
  if (options_.unit == "B") return format_bytes(per_second) + "/s";
  // A slow loop reads better as seconds per item ("4.2 s/step") than as 0.24 steps/s.
  if (per_second > 0 && per_second < 1) {
    std::string one = options_.unit;
    if (one.size() > 1 && one.back() == 's') one.pop_back();
    return fmt::format("{:.1f} s/{}", 1 / per_second, one);
  }
  return fmt::format("{:.1f} {}/s", per_second, options_.unit);
}

void Progress::emit(const std::string& text) {
  if (options_.write) {
    options_.write(text);
  } else {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }
}

void Progress::update(int64_t done, const std::string& detail) {
  done_ = done;
  if (!options_.enabled || finished_) return;
  const double t = now();
  const double elapsed = t - start_;
  if (terminal_) {
    if (elapsed < kRedrawSeconds || (printed_ && t - last_print_ < kRedrawSeconds)) return;
  } else if (t - last_print_ < line_seconds_) {
    return;
  }
  const double per_second = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  std::string line = counts(done);
  if (total_ > 0) {
    line += fmt::format(" ({:.0f}%)", 100.0 * static_cast<double>(done) / total_);
  }
  if (per_second > 0) {
    line += ", " + rate(per_second);
    if (total_ > 0 && done < total_) {
      line += ", ETA " + format_duration(static_cast<double>(total_ - done) / per_second);
    }
  }
  if (!detail.empty()) line += ", " + detail;
  if (terminal_) {
    const int filled =
        total_ > 0 ? static_cast<int>(kBarWidth * std::min<int64_t>(done, total_) / total_) : 0;
    emit(fmt::format("\r{} [{:<{}}] {}\033[K", what_, std::string(filled, '#'), kBarWidth, line));
  } else {
    emit(fmt::format("{}: {}\n", what_, line));
  }
  printed_ = true;
  last_print_ = t;
}

void Progress::finish() {
  if (!options_.enabled || finished_) return;
  finished_ = true;
  if (!printed_) return;
  const double elapsed = now() - start_;
  std::string line = fmt::format("{}: {} in {}", what_, counts(done_), format_duration(elapsed));
  if (elapsed > 0 && done_ > 0) line += fmt::format(" ({})", rate(done_ / elapsed));
  emit(terminal_ ? fmt::format("\r{}\033[K\n", line) : line + "\n");
}

}  // namespace shardrl
