#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>

#include "shardrl/trainer.h"

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

}  // namespace shardrl::trainer
