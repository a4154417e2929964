#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "shardrl/data.h"
#include "shardrl/trainer.h"
#include "tasks.h"

namespace shardrl::trainer {

MetricsLogger::MetricsLogger(const std::string& path, int64_t total_steps, bool enabled,
                             int64_t resumed_step)
    : total_steps_(total_steps),
      enabled_(enabled),
      tty_(isatty(STDOUT_FILENO) != 0),
      start_(std::chrono::steady_clock::now()) {
  if (!enabled_) return;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::string kept;
  if (resumed_step > 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.value("step", int64_t{0}) <= resumed_step) kept += line + "\n";
    }
  }
  out_.open(path, std::ios::trunc);
  out_ << kept;
  if (!out_) throw std::runtime_error(fmt::format("cannot write metrics to '{}'", path));
}

void MetricsLogger::log(int64_t step, const std::map<std::string, double>& metrics) {
  if (!enabled_) return;
  nlohmann::json line = {{"step", step}};
  for (const auto& [name, value] : metrics) line[name] = value;
  out_ << line.dump() << "\n";
  out_.flush();  // a killed run keeps every finished step

  std::string summary;
  for (const char* key : {"loss", "reward_mean", "grad_norm", "lr", "kl", "clipfrac"}) {
    auto it = metrics.find(key);
    if (it != metrics.end()) summary += fmt::format(" {}={:.4g}", key, it->second);
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (tty_) {
    constexpr int kWidth = 24;
    const int filled = total_steps_ > 0 ? static_cast<int>(kWidth * step / total_steps_) : 0;
    fmt::print("\r[{:<{}}] {}/{}{} ({:.0f}s)\033[K", std::string(filled, '#'), kWidth, step,
               total_steps_, summary, elapsed);
    if (step >= total_steps_) fmt::print("\n");
    std::fflush(stdout);
  } else {
    fmt::print("step {}/{}{} ({:.1f}s)\n", step, total_steps_, summary, elapsed);
    std::fflush(stdout);
  }
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << j.dump(2) << "\n";
}

RunCurve summarize_run(const std::string& run_dir, const std::string& title) {
  RunCurve curve;
  std::map<std::string, double> phase_seconds;  // "time_<phase>" summed over the steps
  std::ifstream lines(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(lines, line);) {
    const auto step_metrics = nlohmann::json::parse(line);
    const int64_t step = step_metrics.value("step", int64_t{0});
    for (const auto& [key, value] : step_metrics.items()) {
      if (key.rfind("val/", 0) == 0) curve.validation[key][step] = value.get<double>();
    }
    if (step == 0) continue;  // before training: validation only
    curve.reward.push_back(step_metrics.value("reward_mean", 0.0));
    for (const auto& [key, value] : step_metrics.items()) {
      if (key.rfind("time_", 0) == 0) phase_seconds[key.substr(5)] += value.get<double>();
    }
  }
  curve.phase_seconds_per_step = nlohmann::json::object();
  for (const auto& [phase, total] : phase_seconds) {
    curve.phase_seconds_per_step[phase] =
        total / static_cast<double>(std::max<size_t>(curve.reward.size(), 1));
  }
  std::vector<double> smooth;
  for (size_t i = 0; i < curve.reward.size(); ++i) {
    const size_t from = i >= 4 ? i - 4 : 0;
    double sum = 0;
    for (size_t k = from; k <= i; ++k) sum += curve.reward[k];
    smooth.push_back(sum / static_cast<double>(i - from + 1));
  }
  data::LinePlotOptions plot;
  plot.title = title;
  data::write_png(run_dir + "/reward_curve.png", data::line_plot({curve.reward, smooth}, plot));
  return curve;
}

}  // namespace shardrl::trainer
