// What a run leaves besides its checkpoints: summary.json and the reward curve from metrics.jsonl.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "shardrl/data.h"
#include "shardrl/trainer.h"
#include "tasks.h"

namespace shardrl::trainer {

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << j.dump(2) << "\n";
}

RunCurve summarize_run(const std::string& run_dir, const std::string& title) {
  RunCurve curve;
  curve.phase_seconds_per_step = nlohmann::json::object();
  std::map<std::string, double> phase_seconds;  // "time_<phase>" summed over the steps
  const std::string path = run_dir + "/metrics.jsonl";
  if (!std::filesystem::exists(path)) return curve;  // trainer.logger without "file"
  std::ifstream lines(path);
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
