// Progress of a long stage on the console: a supervised pretraining loop, a weight import, the load
// of a large checkpoint. On a terminal a bar redrawn in place; elsewhere (a log file, or the rank
// output `shardrl launch` relays line by line) one line every few seconds, never one per
// iteration. A stage over before its first line prints nothing.
//
//   Progress progress("pretraining the MMDiT", steps, {.unit = "steps", .enabled = rank == 0});
//   for (int64_t step = 0; step < steps; ++step) {
//     ...
//     progress.update(step + 1, fmt::format("loss {:.4f}", loss));
//   }
//   progress.finish();   // "pretraining the MMDiT: 1500/1500 steps in 2m01s (12.4 steps/s)"
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace shardrl {

// The seconds between two progress lines when stdout is no terminal: SHARDRL_PROGRESS_SECONDS
// from the environment (a number >= 0; 0 prints every update), else 10.
double progress_line_seconds();

// "42ms", "0.8s", "42s", "3m07s", "1h02m": a duration as a progress line or an ETA shows it.
std::string format_duration(double seconds);
// "512 B", "12.0 KB", "340.2 MB", "1.25 GB" (powers of 1000).
std::string format_bytes(double bytes);

class Progress {
 public:
  struct Options {
    // What `done` and `total` count: "steps", "tensors", ...; "B" shows them as sizes.
    std::string unit = "steps";
    // False: prints nothing, e.g. on every rank but rank 0.
    bool enabled = true;
    // Unset: progress_line_seconds().
    std::optional<double> line_seconds;
    // Unset: whether stdout is a terminal.
    std::optional<bool> terminal;
    // For tests: the clock (seconds, monotonic) and where the text goes (stdout by default).
    std::function<double()> clock;
    std::function<void(const std::string& text)> write;
  };

  // `total` <= 0: unknown (no percentage, no ETA).
  Progress(std::string what, int64_t total, Options options);
  Progress(std::string what, int64_t total) : Progress(std::move(what), total, Options{}) {}
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `done` of `total` finished; `detail` (a loss, say) ends the line. Prints when a line is due.
  void update(int64_t done, const std::string& detail = "");
  // Adds to what is done.
  void advance(int64_t amount, const std::string& detail = "") { update(done_ + amount, detail); }
  // The closing line with the total time, if the stage printed anything; later calls do nothing.
  void finish();

 private:
  double now() const;
  std::string counts(int64_t done) const;
  std::string rate(double per_second) const;
  void emit(const std::string& text);

  std::string what_;
  int64_t total_;
  Options options_;
  double line_seconds_;
  bool terminal_;
  double start_, last_print_;
  int64_t done_ = 0;
  bool printed_ = false, finished_ = false;
};

}  // namespace shardrl
