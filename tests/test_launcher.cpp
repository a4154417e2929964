// Launcher tests: real child processes started through /bin/sh, output captured in temp files.
#include "shardrl/launcher.h"

#include "test_util.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using shardrl::dist::launch;
using shardrl::dist::LaunchOptions;

// An unlinked temp file: unlike a pipe it cannot fill up and block launch() while the test,
// which runs on the same thread, is not reading.
class CaptureFile {
 public:
  CaptureFile() {
    std::string path = testing::TempDir() + "shardrl_launcher_XXXXXX";
    fd_ = mkostemp(path.data(), O_CLOEXEC);
    if (fd_ < 0) throw std::runtime_error("mkostemp failed for " + path);
    unlink(path.c_str());
  }
  CaptureFile(const CaptureFile&) = delete;
  CaptureFile& operator=(const CaptureFile&) = delete;
  ~CaptureFile() { close(fd_); }

  int fd() const { return fd_; }

  std::string Contents() const {
    std::string contents;
    char buffer[4096];
    off_t offset = 0;
    for (ssize_t got; (got = pread(fd_, buffer, sizeof(buffer), offset)) > 0; offset += got) {
      contents.append(buffer, static_cast<size_t>(got));
    }
    return contents;
  }

 private:
  int fd_ = -1;
};

struct LaunchResult {
  int status = -1;
  std::string out;
  std::string err;
  double seconds = 0;
};

// `args` become the script's $1, $2, ...
LaunchOptions ShellJob(int nproc, const std::string& script,
                       const std::vector<std::string>& args = {}) {
  LaunchOptions options;
  options.nproc = nproc;
  options.command = {"/bin/sh", "-c", script, "sh"};
  options.command.insert(options.command.end(), args.begin(), args.end());
  return options;
}

LaunchResult RunLaunch(LaunchOptions options) {
  CaptureFile out;
  CaptureFile err;
  options.stdout_fd = out.fd();
  options.stderr_fd = err.fd();
  auto start = std::chrono::steady_clock::now();
  LaunchResult result;
  result.status = launch(options);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.out = out.Contents();
  result.err = err.Contents();
  return result;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

bool Contains(const std::vector<std::string>& lines, const std::string& wanted) {
  return std::find(lines.begin(), lines.end(), wanted) != lines.end();
}

// Parses "KEY=value KEY=value" lines printed by the ranks, keyed by the "[rank K] " prefix.
std::map<std::string, std::map<std::string, std::string>> EnvByRank(const std::string& out) {
  std::map<std::string, std::map<std::string, std::string>> by_rank;
  for (const std::string& line : Lines(out)) {
    size_t prefix_end = line.find("] ");
    if (prefix_end == std::string::npos) continue;
    std::istringstream fields(line.substr(prefix_end + 2));
    for (std::string field; fields >> field;) {
      size_t eq = field.find('=');
      if (eq != std::string::npos) {
        by_rank[line.substr(0, prefix_end + 1)][field.substr(0, eq)] = field.substr(eq + 1);
      }
    }
  }
  return by_rank;
}

const char kPrintEnv[] =
    "echo RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE "
    "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR "
    "MASTER_PORT=$MASTER_PORT OMP=$OMP_NUM_THREADS OPENBLAS=$OPENBLAS_NUM_THREADS "
    "MKL=$MKL_NUM_THREADS";

// Sets or unsets one variable for the duration of a test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

std::string TempPath(const std::string& stem) {
  return testing::TempDir() + stem + "_" + std::to_string(getpid());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// True once `pid` is gone or a zombie nobody reaped yet (container init processes often never
// reap the orphans they adopt).
bool ProcessEnded(pid_t pid) {
  if (kill(pid, 0) != 0) return true;
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  size_t state = stat.rfind(") ");
  return state != std::string::npos && (stat[state + 2] == 'Z' || stat[state + 2] == 'X');
}

bool EndsWithin(pid_t pid, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!ProcessEnded(pid)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

void ExpectRejected(const LaunchOptions& options, const std::string& field) {
  try {
    launch(options);
    ADD_FAILURE() << "launch() accepted invalid " << field;
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(field), std::string::npos) << error.what();
  }
}

}  // namespace

TEST(Launcher, PrefixesEveryLineWithItsRank) {
  LaunchResult result = RunLaunch(
      ShellJob(2, "echo \"hello from $RANK\"; echo \"oops $RANK\" >&2; printf 'no newline'"));

  EXPECT_EQ(result.status, 0) << result.err;
  std::vector<std::string> out = Lines(result.out);
  std::vector<std::string> err = Lines(result.err);
  EXPECT_EQ(out.size(), 4u) << result.out;
  EXPECT_TRUE(Contains(out, "[rank 0] hello from 0")) << result.out;
  EXPECT_TRUE(Contains(out, "[rank 1] hello from 1")) << result.out;
  EXPECT_TRUE(Contains(out, "[rank 0] no newline")) << result.out;
  EXPECT_TRUE(Contains(out, "[rank 1] no newline")) << result.out;
  std::sort(err.begin(), err.end());
  EXPECT_EQ(err, (std::vector<std::string>{"[rank 0] oops 0", "[rank 1] oops 1"})) << result.err;
  EXPECT_EQ(result.out.back(), '\n');
}

TEST(Launcher, LinesFromConcurrentRanksNeverInterleave) {
  const int kLinesPerRank = 2000;
  const std::string padding(150, 'x');
  LaunchResult result = RunLaunch(
      ShellJob(3, "i=0; while [ $i -lt " + std::to_string(kLinesPerRank) +
                      " ]; do echo \"r$RANK-line-$i-" + padding + "\"; i=$((i+1)); done"));

  ASSERT_EQ(result.status, 0) << result.err;
  std::map<int, int> next_line_of_rank;
  for (const std::string& line : Lines(result.out)) {
    ASSERT_EQ(line.rfind("[rank ", 0), 0u) << line;
    int rank = line[6] - '0';
    std::string expected = "[rank " + std::to_string(rank) + "] r" + std::to_string(rank) +
                           "-line-" + std::to_string(next_line_of_rank[rank]++) + "-" + padding;
    ASSERT_EQ(line, expected);
  }
  EXPECT_EQ(next_line_of_rank,
            (std::map<int, int>{{0, kLinesPerRank}, {1, kLinesPerRank}, {2, kLinesPerRank}}));
}

TEST(Launcher, RanksSeeTorchrunEnvironmentAndThreadLimits) {
  LaunchOptions options = ShellJob(2, kPrintEnv);
  options.threads_per_rank = 3;
  LaunchResult result = RunLaunch(options);

  ASSERT_EQ(result.status, 0) << result.err;
  auto env = EnvByRank(result.out);
  ASSERT_EQ(env.size(), 2u) << result.out;
  for (int rank = 0; rank < 2; ++rank) {
    auto& vars = env["[rank " + std::to_string(rank) + "]"];
    EXPECT_EQ(vars["RANK"], std::to_string(rank));
    EXPECT_EQ(vars["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(vars["WORLD_SIZE"], "2");
    EXPECT_EQ(vars["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(vars["GROUP_RANK"], "0");
    EXPECT_EQ(vars["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(vars["OMP"], "3");
    EXPECT_EQ(vars["OPENBLAS"], "3");
    EXPECT_EQ(vars["MKL"], "3");
  }
  const std::string port = env["[rank 0]"]["MASTER_PORT"];
  ASSERT_FALSE(port.empty());
  EXPECT_GT(std::stoi(port), 0);
  EXPECT_LE(std::stoi(port), 65535);
  EXPECT_EQ(env["[rank 1]"]["MASTER_PORT"], port);
}

TEST(Launcher, PassesAnExplicitMasterPortThrough) {
  LaunchOptions options = ShellJob(1, kPrintEnv);
  options.master_port = 29512;
  LaunchResult result = RunLaunch(options);

  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(EnvByRank(result.out)["[rank 0]"]["MASTER_PORT"], "29512");
}

// The port the launcher picks stays reserved while the job runs: no other bind(0), such as another
// launcher's pick, gets it, so two jobs started at once cannot meet at one store. In a network
// namespace of its own with two ephemeral ports, where a released port would come back at once.
TEST(Launcher, PickedMasterPortStaysReservedWhileTheJobRuns) {
  using shardrl::testing::run_process;
  SHARDRL_REQUIRE_DEPENDENCY(geteuid() == 0 && run_process({"unshare", "-n", "true"}).exit_code == 0
                                 ? ""
                                 : "root and unshare (util-linux) for a network namespace");
  // Each rank binds port 0 forty times, with and without SO_REUSEADDR (a launcher's pick sets it);
  // a bind can fail while the other rank holds the one free port.
  const std::string probe =
      "import os, socket\n"
      "got = set()\n"
      "for reuse in (0, 1) * 20:\n"
      "    s = socket.socket()\n"
      "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)\n"
      "    try:\n"
      "        s.bind(('127.0.0.1', 0))\n"
      "        got.add(s.getsockname()[1])\n"
      "    except OSError:\n"
      "        pass\n"
      "    s.close()\n"
      "print('MASTER_PORT', os.environ['MASTER_PORT'], 'BOUND', *sorted(got))\n";
  const std::string job =
      "ip link set lo up && sysctl -q -w net.ipv4.ip_local_port_range='40000 40001' && exec " +
      shardrl::testing::bin("shardrl") + " launch -n 2 -- " + SHARDRL_PYTHON + " -c \"$0\"";
  const auto result = run_process({"unshare", "-n", "sh", "-c", job, probe}, {}, 120);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  int ranks_seen = 0;
  std::istringstream lines(result.output);
  for (std::string line; std::getline(lines, line);) {
    const auto at = line.find("MASTER_PORT");
    if (at == std::string::npos) continue;
    std::istringstream words(line.substr(at));
    std::string word, master_port;
    if (!(words >> word >> master_port)) continue;
    ++ranks_seen;
    words >> word;  // BOUND
    for (std::string port; words >> port;) {
      EXPECT_NE(port, master_port) << "a bind(0) got the job's MASTER_PORT while it ran:\n"
                                   << result.output;
    }
  }
  EXPECT_EQ(ranks_seen, 2) << result.output;
}

TEST(Launcher, SplitsCoresAcrossRanksByDefault) {
  ScopedEnv no_omp("OMP_NUM_THREADS", nullptr);
  LaunchResult result = RunLaunch(ShellJob(2, kPrintEnv));

  ASSERT_EQ(result.status, 0) << result.err;
  auto env = EnvByRank(result.out);
  const std::string omp = env["[rank 0]"]["OMP"];
  ASSERT_FALSE(omp.empty()) << result.out;
  int threads = std::stoi(omp);
  EXPECT_GE(threads, 1);
  unsigned cores = std::max(2u, std::thread::hardware_concurrency());
  EXPECT_LE(static_cast<unsigned>(threads) * 2, cores);
  EXPECT_EQ(env["[rank 0]"]["OPENBLAS"], omp);
  EXPECT_EQ(env["[rank 1]"]["OMP"], omp);
}

TEST(Launcher, KeepsTheCallersOmpNumThreads) {
  ScopedEnv omp("OMP_NUM_THREADS", "7");
  LaunchResult result = RunLaunch(ShellJob(2, kPrintEnv));

  ASSERT_EQ(result.status, 0) << result.err;
  auto env = EnvByRank(result.out);
  EXPECT_EQ(env["[rank 0]"]["OMP"], "7");
  EXPECT_EQ(env["[rank 1]"]["OMP"], "7");
}

TEST(Launcher, FailingRankStopsTheOthersAndTheirChildren) {
  const std::string pid_file = TempPath("shardrl_launcher_sleep_pid");
  unlink(pid_file.c_str());
  // Rank 1 waits until rank 0 has a child of its own, so the test can check that the whole
  // process group is stopped, not only the rank.
  const char kScript[] = R"(
    if [ "$RANK" = 1 ]; then
      while [ ! -s "$1" ]; do sleep 0.02; done
      echo 'rank one failing' >&2
      exit 3
    fi
    sleep 60 &
    echo $! > "$1.tmp" && mv "$1.tmp" "$1"
    wait)";
  LaunchOptions options = ShellJob(2, kScript, {pid_file});
  options.grace_seconds = 0.5;
  LaunchResult result = RunLaunch(options);

  EXPECT_EQ(result.status, 3) << result.err;
  EXPECT_LT(result.seconds, 3.0);
  std::vector<std::string> err = Lines(result.err);
  EXPECT_TRUE(Contains(err, "[rank 1] rank one failing")) << result.err;
  EXPECT_TRUE(Contains(err, "shardrl launch: rank 1 exited with status 3")) << result.err;
  EXPECT_TRUE(Contains(err, "shardrl launch: rank 0 was killed by signal 15 (SIGTERM)"))
      << result.err;

  const std::string sleep_pid = ReadFile(pid_file);
  unlink(pid_file.c_str());
  ASSERT_FALSE(sleep_pid.empty());
  EXPECT_TRUE(EndsWithin(std::stoi(sleep_pid), std::chrono::milliseconds(2000)))
      << "rank 0's child " << sleep_pid << " survived the launch";
}

TEST(Launcher, RankKilledBySignalIsAFailure) {
  LaunchResult result = RunLaunch(ShellJob(1, "kill -KILL $$"));

  EXPECT_EQ(result.status, 128 + SIGKILL);
  EXPECT_TRUE(
      Contains(Lines(result.err), "shardrl launch: rank 0 was killed by signal 9 (SIGKILL)"))
      << result.err;
}

TEST(Launcher, MissingCommandExitsWith127) {
  LaunchOptions options;
  options.nproc = 2;
  options.command = {"shardrl-test-no-such-command", "--flag"};
  LaunchResult result = RunLaunch(options);

  EXPECT_EQ(result.status, 127);
  EXPECT_TRUE(Contains(Lines(result.err),
                       "[rank 0] shardrl launch: cannot run 'shardrl-test-no-such-command': No "
                       "such file or directory"))
      << result.err;
  EXPECT_TRUE(Contains(Lines(result.err), "shardrl launch: rank 1 exited with status 127"))
      << result.err;
}

TEST(Launcher, ForwardsTerminationToRanks) {
  const std::string ready_file = TempPath("shardrl_launcher_ready");
  unlink(ready_file.c_str());
  // Rank 0 signals the launcher (its parent, i.e. this test process) once rank 1 has its trap
  // installed; both ranks must then receive the forwarded SIGTERM and exit cleanly. The short
  // foreground sleeps keep the shells responsive without leaving a long-lived child behind.
  const char kScript[] = R"(
    trap 'echo got SIGTERM; exit 0' TERM
    if [ "$RANK" = 1 ]; then
      touch "$1"
    else
      while [ ! -e "$1" ]; do sleep 0.02; done
      kill -TERM $PPID
    fi
    while :; do sleep 0.05; done)";
  LaunchResult result = RunLaunch(ShellJob(2, kScript, {ready_file}));
  unlink(ready_file.c_str());

  EXPECT_EQ(result.status, 128 + SIGTERM) << result.err;
  EXPECT_LT(result.seconds, 3.0);
  std::vector<std::string> out = Lines(result.out);
  EXPECT_TRUE(Contains(out, "[rank 0] got SIGTERM")) << result.out << result.err;
  EXPECT_TRUE(Contains(out, "[rank 1] got SIGTERM")) << result.out << result.err;
}

TEST(Launcher, RejectsInvalidOptions) {
  LaunchOptions no_ranks = ShellJob(0, "true");
  ExpectRejected(no_ranks, "nproc");

  LaunchOptions no_command;
  ExpectRejected(no_command, "command");

  LaunchOptions empty_program;
  empty_program.command = {""};
  ExpectRejected(empty_program, "command");

  LaunchOptions bad_port = ShellJob(1, "true");
  bad_port.master_port = 70000;
  ExpectRejected(bad_port, "master_port");

  LaunchOptions bad_grace = ShellJob(1, "true");
  bad_grace.grace_seconds = -1;
  ExpectRejected(bad_grace, "grace_seconds");
}
