// Bad input and failing peers: every case ends in a clear error, within the timeout, never a hang.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "test_util.h"

namespace shardrl::testing {
namespace {

std::vector<std::string> train_args(std::vector<std::string> extra) {
  std::vector<std::string> args = {"train", "--out", make_temp_dir("errors"), "--steps", "4"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(DistErrors, UnknownDtypeNamesTheField) {
  auto r = launch_workers(1, train_args({"--param-dtype", "fp8"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("mixed_precision.param_dtype: unknown dtype 'fp8'"), std::string::npos)
      << r.output;
}

TEST(DistErrors, MeshThatDoesNotDivideTheWorld) {
  auto r = launch_workers(4, train_args({"--fsdp-size", "3"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("fsdp_size=3 does not divide the world size 4"), std::string::npos)
      << r.output;
}

TEST(DistErrors, MismatchedWorldSizeIsReportedNotAwaited) {
  const std::string port = std::to_string(free_port());
  const std::string worker = bin("dist_worker") + " train --steps 1 --out " + make_temp_dir("ws");
  const std::string script = "export MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; " +
                             "RANK=0 WORLD_SIZE=2 " + worker + " & RANK=1 WORLD_SIZE=3 " + worker +
                             "; wait";
  auto r = run_process({"/bin/sh", "-c", script}, {}, 60);
  EXPECT_NE(
      r.output.find("world size mismatch: rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"),
      std::string::npos)
      << r.output;
  EXPECT_NE(
      r.output.find("world size mismatch: rank 0 has WORLD_SIZE=2 but rank 1 has WORLD_SIZE=3"),
      std::string::npos)
      << r.output;
}

TEST(DistErrors, RankOutOfRange) {
  auto r = run_process({bin("dist_worker"), "train", "--out", make_temp_dir("range")},
                       {{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("RANK=2 is out of range for WORLD_SIZE=2"), std::string::npos)
      << r.output;
}

TEST(DistErrors, PortInUseIsNamed) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  auto r = run_process(
      {bin("shardrl"), "launch", "-n", "2", "--master-port", port, "--grace", "1", "--",
       bin("dist_worker"), "train", "--timeout-ms", "5000", "--out", make_temp_dir("port")},
      {}, 60);
  close(fd);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("rank 0 cannot host the rendezvous store on 127.0.0.1:" + port +
                          " (is the port in use?"),
            std::string::npos)
      << r.output;
}

TEST(DistErrors, KilledRankIsNamedBySurvivorsWithinTheTimeout) {
  auto r = launch_workers(
      3, train_args({"--die-rank", "1", "--die-step", "2", "--timeout-ms", "10000"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[rank 0] error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 2] error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 stopped responding"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0 + 5.0) << r.output;
}

TEST(DistErrors, KilledStoreHostIsNamed) {
  auto r = launch_workers(
      2, train_args({"--die-rank", "0", "--die-step", "2", "--timeout-ms", "10000"}));
  EXPECT_NE(r.exit_code, 0);
  // The survivor's own diagnosis, not the launcher's "rank 0 was killed" line.
  EXPECT_NE(r.output.find("[rank 1] error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the rendezvous store at 127.0.0.1:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(hosted by rank 0)"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0 + 5.0) << r.output;
}

TEST(DistErrors, StuckRankMakesOthersTimeOut) {
  auto r = launch_workers(
      2, train_args({"--hang-rank", "1", "--die-step", "1", "--timeout-ms", "3000"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[rank 0] error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("timeout 3000 ms"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every rank of the group is alive"), std::string::npos) << r.output;
  // The stuck rank is stopped by the launcher after the grace period.
  EXPECT_LT(r.seconds, 3.0 + 20.0 + 10.0) << r.output;
}

// The live processes whose environment holds `entry` (NAME=value).
std::vector<pid_t> processes_with_env(const std::string& entry) {
  std::vector<pid_t> found;
  std::error_code ignored;
  for (const auto& dir : std::filesystem::directory_iterator("/proc", ignored)) {
    const std::string name = dir.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(dir.path() / "environ");
    for (std::string var; std::getline(in, var, '\0');) {
      if (var == entry) found.push_back(std::stoi(name));
    }
  }
  return found;
}

// shardrl launch gives every rank a process group of its own, so killing the launcher's group
// alone would leave ranks running after a test gave up on them.
TEST(TestHarness, TimeoutKillsEveryProcessOfTheJob) {
  const std::string value = std::to_string(getpid()) + "-harness";
  const std::string entry = "SHARDRL_HARNESS_MARK=" + value;
  BackgroundProcess job(
      {bin("shardrl"), "launch", "-n", "2", "--", "/bin/sh", "-c", "sleep 600 & wait"},
      {{"SHARDRL_HARNESS_MARK", value}});
  size_t most = 0;
  auto r = job.wait(
      3,
      [&] {
        most = std::max(most, processes_with_env(entry).size());
        return false;
      },
      0);
  EXPECT_EQ(r.exit_code, -2) << r.output;
  // The launcher, two ranks' shells and their sleeps.
  EXPECT_EQ(most, 5u);
  std::vector<pid_t> left;
  for (int i = 0; i < 20; ++i) {
    left = processes_with_env(entry);
    if (left.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(left.empty()) << left.size() << " processes of the job outlived the harness";
  for (pid_t pid : left) kill(pid, SIGKILL);
}

}  // namespace
}  // namespace shardrl::testing
