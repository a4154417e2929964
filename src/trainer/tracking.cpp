#include "tracking.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "shardrl/progress.h"
#include "shardrl/trainer.h"
#include "tensorboard.h"

namespace shardrl::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// What the console line shows of a step's metrics, when present, in this order; then any val/.
constexpr const char* kHeadline[] = {"reward_mean", "loss", "grad_norm", "kl"};

// 41234 -> "41234", 41.23 -> "41.2", 4.123 -> "4.12": three figures or more, no exponent.
std::string rate_figure(double value) {
  const double magnitude = std::abs(value);
  if (magnitude >= 100) return fmt::format("{:.0f}", value);
  if (magnitude >= 10) return fmt::format("{:.1f}", value);
  return fmt::format("{:.2f}", value);
}

}  // namespace

const std::vector<std::string>& known_loggers() {
  static const std::vector<std::string> loggers = {"console", "file", "tensorboard"};
  return loggers;
}

std::vector<std::string> configured_loggers(const json& config) {
  const json& value = at(config, "trainer.logger");
  std::vector<json> items;
  if (value.is_string()) {
    items.push_back(value);
  } else if (value.is_array()) {
    items = value.get<std::vector<json>>();
  } else {
    throw std::invalid_argument(
        fmt::format("config key 'trainer.logger' must be a list of loggers ({}), got {}",
                    fmt::join(known_loggers(), ", "), value.dump()));
  }
  std::vector<std::string> loggers;
  for (const json& item : items) {
    const auto& known = known_loggers();
    if (!item.is_string() || std::find(known.begin(), known.end(), item) == known.end()) {
      throw std::invalid_argument(
          fmt::format("config key 'trainer.logger': {} is not a logger ShardRL has; it has {}",
                      item.is_string() ? "'" + item.get<std::string>() + "'" : item.dump(),
                      fmt::join(known, ", ")));
    }
    loggers.push_back(item.get<std::string>());
  }
  return loggers;
}

std::string tensorboard_dir(const json& config) {
  const char* env = std::getenv("TENSORBOARD_DIR");
  if (env != nullptr && *env != '\0') return env;
  return (fs::path("tensorboard_log") / get<std::string>(config, "trainer.project_name") /
          get<std::string>(config, "trainer.experiment_name"))
      .string();
}

std::string step_line(int64_t step, int64_t total_steps,
                      const std::map<std::string, double>& metrics, const Throughput& throughput,
                      double seconds_per_step) {
  std::string line = fmt::format("{}/{}", step, total_steps);
  for (const char* key : kHeadline) {
    const auto it = metrics.find(key);
    if (it != metrics.end()) line += fmt::format(" {}={:.4g}", key, it->second);
  }
  for (const auto& [key, value] : metrics) {
    if (key.rfind("val/", 0) == 0) line += fmt::format(" {}={:.4g}", key, value);
  }
  if (!throughput.metric.empty()) {
    const auto it = metrics.find(throughput.metric);
    if (it != metrics.end())
      line += fmt::format(" | {} {}", rate_figure(it->second), throughput.unit);
  }
  line += fmt::format(" | {}/step", format_duration(seconds_per_step));
  if (step < total_steps) {
    line += ", ETA " + format_duration(seconds_per_step * static_cast<double>(total_steps - step));
  }
  return line;
}

Tracking::Tracking(Options options)
    : options_(std::move(options)),
      tty_(isatty(STDOUT_FILENO) != 0),
      start_(std::chrono::steady_clock::now()) {
  if (!options_.enabled) return;
  console_ = uses("console");
  if (uses("file")) {
    const std::string& path = options_.metrics_path;
    fs::create_directories(fs::path(path).parent_path());
    std::string kept;
    if (options_.resumed_step > 0) {
      std::ifstream in(path);
      for (std::string line; std::getline(in, line);) {
        const auto j = json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.value("step", int64_t{0}) <= options_.resumed_step)
          kept += line + "\n";
      }
    }
    file_.open(path, std::ios::trunc);
    file_ << kept;
    if (!file_) throw std::runtime_error(fmt::format("cannot write metrics to '{}'", path));
  }
  if (uses("tensorboard")) {
    tensorboard_ = std::make_unique<TensorBoardWriter>(options_.tensorboard_dir);
    // What a killed run logged after its checkpoint is redone: TensorBoard drops it. A fresh run
    // replaces what an earlier one in the same folder logged.
    tensorboard_->start_session(options_.resumed_step > 0 ? options_.resumed_step + 1 : 0);
    tensorboard_->flush();
    spdlog::info("TensorBoard: {} (tensorboard --logdir {})", tensorboard_->path(),
                 options_.tensorboard_dir);
  }
}

Tracking::~Tracking() = default;

bool Tracking::uses(const std::string& logger) const {
  return std::find(options_.loggers.begin(), options_.loggers.end(), logger) !=
         options_.loggers.end();
}

void Tracking::log(int64_t step, const std::map<std::string, double>& metrics, bool training_step) {
  if (!options_.enabled) return;
  if (file_.is_open()) {
    json line = {{"step", step}};
    for (const auto& [name, value] : metrics) line[name] = value;
    file_ << line.dump() << "\n";
    file_.flush();  // a killed run keeps every finished step
    if (!file_) {
      throw std::runtime_error(fmt::format("cannot write metrics to '{}'", options_.metrics_path));
    }
  }
  if (tensorboard_) {
    tensorboard_->add_scalars(step, metrics);
    tensorboard_->flush();
  }
  if (training_step && console_) console(step, metrics);
}

void Tracking::console(int64_t step, const std::map<std::string, double>& metrics) {
  const auto now = std::chrono::steady_clock::now();
  ++steps_logged_;
  if (!first_logged_) {
    first_logged_ = now;
    // The first step's own time, as the task measured it, else all since the run began.
    const auto it = metrics.find("step_time");
    first_step_seconds_ =
        it != metrics.end() ? it->second : std::chrono::duration<double>(now - start_).count();
  }
  // Wall time between step lines: checkpoint saves and evaluations included, as the ETA needs.
  const double mean =
      (first_step_seconds_ + std::chrono::duration<double>(now - *first_logged_).count()) /
      static_cast<double>(steps_logged_);
  const std::string line =
      step_line(step, options_.total_steps, metrics, options_.throughput, mean);
  if (tty_) {
    constexpr int kWidth = 24;
    const int64_t total = options_.total_steps;
    const int filled =
        total > 0 ? static_cast<int>(kWidth * std::min<int64_t>(step, total) / total) : 0;
    fmt::print("\r[{:<{}}] {}\033[K", std::string(filled, '#'), kWidth, line);
    if (step >= total) fmt::print("\n");
  } else {
    fmt::print("step {}\n", line);
  }
  std::fflush(stdout);
}

void Tracking::log_image(int64_t step, const std::string& tag, const torch::Tensor& image) {
  if (!options_.enabled || !tensorboard_) return;
  tensorboard_->add_image(step, tag, image);
  tensorboard_->flush();
}

void Tracking::log_text(int64_t step, const std::string& tag, const std::string& markdown) {
  if (!options_.enabled || !tensorboard_) return;
  tensorboard_->add_text(step, tag, markdown);
  tensorboard_->flush();
}

}  // namespace shardrl::trainer
