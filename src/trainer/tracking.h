// Internal to the trainer: where a run's metrics go, as verl's Tracking sends them to the loggers
// trainer.logger names:
//   console      a line a training step: its headline metrics, the task's throughput, the mean
//                time of a step and the ETA; on a terminal a bar redrawn in place;
//   file         metrics.jsonl in the run folder, one JSON object a step;
//   tensorboard  event files in TENSORBOARD_DIR, else tensorboard_log/<project_name>/
//                <experiment_name> (verl's place): every metric as a scalar, and the images and
//                texts the tasks log (evaluation samples, validation generations).
// Only rank 0 writes; each step is flushed, so a killed run keeps every finished step.
#pragma once

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace shardrl::trainer {

class TensorBoardWriter;

// The loggers ShardRL has, in verl's names.
const std::vector<std::string>& known_loggers();

// trainer.logger, checked: each name one of known_loggers() (an unknown one, such as wandb, is an
// error naming the key and the loggers there are). A single string is a list of one, as in verl.
std::vector<std::string> configured_loggers(const nlohmann::json& config);

// TensorBoard's folder: the TENSORBOARD_DIR environment variable, else
// tensorboard_log/<trainer.project_name>/<trainer.experiment_name>, as verl's.
std::string tensorboard_dir(const nlohmann::json& config);

// The task's throughput, shown on the console line: the metric that holds it and its unit.
struct Throughput {
  std::string metric;  // e.g. "perf/images_per_s"; empty: none
  std::string unit;    // e.g. "img/s"
};

// The console's line for a training step, without the bar: the headline metrics present among
// `metrics`, the throughput, and `seconds_per_step` (the mean so far) with the ETA of the steps
// left after `step`.
std::string step_line(int64_t step, int64_t total_steps,
                      const std::map<std::string, double>& metrics, const Throughput& throughput,
                      double seconds_per_step);

class Tracking {
 public:
  struct Options {
    std::vector<std::string> loggers;  // configured_loggers()
    std::string metrics_path;          // the file logger's metrics.jsonl
    std::string tensorboard_dir;
    int64_t total_steps = 0;
    // > 0: the run resumed from the checkpoint of this step. The file keeps the lines up to it
    // (a killed run may have logged a few beyond), and TensorBoard forgets the steps after it.
    int64_t resumed_step = 0;
    Throughput throughput;
    bool enabled = true;  // false on every rank but 0
  };

  explicit Tracking(Options options);
  ~Tracking();

  bool uses(const std::string& logger) const;
  // Metrics of `step`. A training step also gets its console line; the others (validation before
  // training, step 0) go to the file and TensorBoard only.
  void log(int64_t step, const std::map<std::string, double>& metrics, bool training_step);
  // To TensorBoard (when it is a logger): an image (uint8 [H, W, C]) and markdown text.
  void log_image(int64_t step, const std::string& tag, const torch::Tensor& image);
  void log_text(int64_t step, const std::string& tag, const std::string& markdown);

 private:
  void console(int64_t step, const std::map<std::string, double>& metrics);

  Options options_;
  bool console_ = false, tty_ = false;
  std::ofstream file_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::chrono::steady_clock::time_point start_;
  // The mean time of a step: from the first training step this process logged on.
  std::optional<std::chrono::steady_clock::time_point> first_logged_;
  double first_step_seconds_ = 0;
  int64_t steps_logged_ = 0;
};

}  // namespace shardrl::trainer
