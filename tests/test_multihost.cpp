// Two hosts on one machine: a network namespace each, joined by a veth pair. Ranks start the
// torchrun way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME; no `shardrl
// launch`) with `ip netns exec`, by hand or by a real torchrun on each host, and share the
// checkpoint folder as a shared filesystem would.
// Training, checkpointing and resuming cross the link; a cut link and a killed host end every
// surviving rank within the collective timeout plus kGraceSeconds, naming what it lost.
//
// Needs root and iproute2's `ip`; the namespaces, the link and the ranks are removed even when a
// test fails. Names carry the test process's pid, so parallel ctest runs do not collide.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "test_util.h"

namespace shardrl::testing {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The collective timeout the fault tests run with (actor_rollout_ref.nccl_timeout, seconds), and
// the grace a rank gets beyond it to notice, diagnose (a few heartbeat periods) and exit: a step
// of compute can run before the hung collective starts its clock.
constexpr int kTimeoutSeconds = 4;
constexpr double kGraceSeconds = 10;
// The store's port; each namespace has its own ports, so a fixed one cannot clash.
constexpr int kPort = 29500;

std::string join(const std::vector<std::string>& words) {
  std::string text;
  for (const auto& w : words) text += (text.empty() ? "" : " ") + w;
  return text;
}

ProcessResult ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"ip"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, 30);
}

// Host a (rank 0, the store) at 10.213.0.1 and host b (rank 1) at 10.213.0.2, a /30 that exists
// only inside the two namespaces: the veth is created straight into them, never in the root
// namespace, so no traffic leaves them.
class TwoHosts {
 public:
  struct Host {
    std::string ns, veth, address;
  };

  TwoHosts() {
    const std::string id = std::to_string(getpid());
    hosts_[0] = {"srl" + id + "a", "srl" + id + "va", "10.213.0.1"};
    hosts_[1] = {"srl" + id + "b", "srl" + id + "vb", "10.213.0.2"};
  }
  ~TwoHosts() {
    for (const auto& host : hosts_) {
      kill_all(host);
      ip({"netns", "del", host.ns});  // takes its end of the veth pair, and so the pair, with it
    }
  }
  TwoHosts(const TwoHosts&) = delete;
  TwoHosts& operator=(const TwoHosts&) = delete;

  // Empty when the hosts are up, else what failed.
  std::string set_up() {
    std::vector<std::vector<std::string>> steps;
    for (const auto& host : hosts_) steps.push_back({"netns", "add", host.ns});
    steps.push_back({"-n", hosts_[0].ns, "link", "add", hosts_[0].veth, "type", "veth", "peer",
                     "name", hosts_[1].veth, "netns", hosts_[1].ns});
    for (const auto& host : hosts_) {
      steps.push_back({"-n", host.ns, "addr", "add", host.address + "/30", "dev", host.veth});
      steps.push_back({"-n", host.ns, "link", "set", host.veth, "up"});
      steps.push_back({"-n", host.ns, "link", "set", "lo", "up"});
    }
    for (const auto& step : steps) {
      auto r = ip(step);
      if (r.exit_code != 0) return "ip " + join(step) + ": " + r.output;
    }
    return "";
  }

  const Host& host(int i) const { return hosts_[i]; }

  // One rank of a two-rank job on host `rank`, as torchrun or a Slurm script would start it.
  std::unique_ptr<BackgroundProcess> start_rank(int rank, const std::vector<std::string>& args) {
    const Host& h = hosts_[rank];
    std::vector<std::string> argv = {"ip",
                                     "netns",
                                     "exec",
                                     h.ns,
                                     "env",
                                     "RANK=" + std::to_string(rank),
                                     "WORLD_SIZE=2",
                                     "LOCAL_RANK=0",
                                     "MASTER_ADDR=" + hosts_[0].address,
                                     "MASTER_PORT=" + std::to_string(kPort),
                                     "GLOO_SOCKET_IFNAME=" + h.veth,
                                     "OMP_NUM_THREADS=1",
                                     bin("shardrl")};
    argv.insert(argv.end(), args.begin(), args.end());
    return std::make_unique<BackgroundProcess>(argv);
  }

  // torchrun on host `node` (one rank a host): its agents rendezvous, node 0's hosts the store,
  // and each starts its rank with the environment above.
  std::unique_ptr<BackgroundProcess> start_torchrun(int node,
                                                    const std::vector<std::string>& args) {
    const Host& h = hosts_[node];
    std::vector<std::string> argv = {
        "ip", "netns", "exec", h.ns, "env", "GLOO_SOCKET_IFNAME=" + h.veth,
        // torchrun sets it only for several ranks a host
        "OMP_NUM_THREADS=1", SHARDRL_PYTHON, "-m", "torch.distributed.run", "--nnodes", "2",
        "--node-rank", std::to_string(node), "--nproc-per-node", "1", "--master-addr",
        hosts_[0].address, "--master-port", std::to_string(kPort), "--no-python", bin("shardrl")};
    argv.insert(argv.end(), args.begin(), args.end());
    return std::make_unique<BackgroundProcess>(argv);
  }
  // SIGKILLs every process in the host's namespace: a host that dies.
  void kill_all(const Host& host) {
    auto r = ip({"netns", "pids", host.ns});
    std::istringstream pids(r.output);
    for (pid_t pid; pids >> pid;) kill(pid, SIGKILL);
  }

 private:
  Host hosts_[2];
};

// Runs the body with two hosts up, or skips (fails under CI=true) where namespaces cannot be made.
#define REQUIRE_TWO_HOSTS(hosts)                                                             \
  TwoHosts hosts;                                                                            \
  if (const std::string why = hosts.set_up(); !why.empty()) {                                \
    const char* ci = std::getenv("CI");                                                      \
    if (ci && std::string(ci) == "true") FAIL() << "two network namespaces needed: " << why; \
    GTEST_SKIP() << "needs root and iproute2 for network namespaces: " << why;               \
  }

std::string write_config(const std::string& dir) {
  const std::string path = dir + "/lm.yaml";
  std::ofstream(path) << kSmallLmConfig;
  return path;
}

// Both ranks of one run; every rank must exit 0.
void run_both(TwoHosts& hosts, const std::vector<std::string>& args) {
  auto rank0 = hosts.start_rank(0, args);
  auto rank1 = hosts.start_rank(1, args);
  auto r1 = rank1->wait(300);
  auto r0 = rank0->wait(300);
  ASSERT_EQ(r0.exit_code, 0) << r0.output;
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
}

size_t lines_in(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

TEST(MultiHost, TrainsCheckpointsAndResumesAcrossHosts) {
  REQUIRE_TWO_HOSTS(hosts);
  const auto dir = make_temp_dir("multihost_train");
  const auto config = write_config(dir);
  auto args = [&](const std::string& out, int steps) {
    return std::vector<std::string>{"train", config, "trainer.default_local_dir=" + dir + "/" + out,
                                    "trainer.total_training_steps=" + std::to_string(steps),
                                    // A failure shows in a minute, not the default ten.
                                    "actor_rollout_ref.nccl_timeout=60"};
  };
  ASSERT_NO_FATAL_FAILURE(run_both(hosts, args("resumed", 4)));
  EXPECT_TRUE(fs::exists(dir + "/resumed/checkpoints/global_step_4"));
  {
    auto rank0 = hosts.start_rank(0, args("resumed", 6));
    auto rank1 = hosts.start_rank(1, args("resumed", 6));
    auto r1 = rank1->wait(300);
    auto r0 = rank0->wait(300);
    ASSERT_EQ(r0.exit_code, 0) << r0.output;
    ASSERT_EQ(r1.exit_code, 0) << r1.output;
    EXPECT_NE(r0.output.find("resumed from"), std::string::npos) << r0.output;
    // Hosts apart (here: network namespaces) keep Gloo's TCP path; shared memory is for one host.
    EXPECT_NE(r0.output.find("on 2 rank(s), bulk collectives over gloo (ranks 0 and 1 are not on "
                             "one host"),
              std::string::npos)
        << r0.output;
  }
  ASSERT_NO_FATAL_FAILURE(run_both(hosts, args("straight", 6)));
  expect_same_metrics(dir + "/resumed/metrics.jsonl", dir + "/straight/metrics.jsonl", 6,
                      {"step", "loss"});
}

// docs/multi-host.md's torchrun line, one torchrun a host: it trains to the bits of the same job
// started the Slurm way (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand).
TEST(MultiHost, TorchrunOnEachHostTrainsAsRanksStartedByHandDo) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch"}));
  REQUIRE_TWO_HOSTS(hosts);
  const auto dir = make_temp_dir("multihost_torchrun");
  const auto config = write_config(dir);
  auto args = [&](const std::string& out) {
    return std::vector<std::string>{"train", config, "trainer.default_local_dir=" + dir + "/" + out,
                                    "trainer.total_training_steps=3",
                                    "actor_rollout_ref.nccl_timeout=60"};
  };
  auto node0 = hosts.start_torchrun(0, args("torchrun"));
  auto node1 = hosts.start_torchrun(1, args("torchrun"));
  auto r1 = node1->wait(300);
  auto r0 = node0->wait(300);
  ASSERT_EQ(r0.exit_code, 0) << r0.output;
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  EXPECT_NE(r0.output.find("on 2 rank(s), bulk collectives over gloo"), std::string::npos)
      << r0.output;
  // Rank 0 is a client of its agent's store, like rank 1.
  EXPECT_EQ(r0.output.find("failed to bind"), std::string::npos) << r0.output;
  ASSERT_NO_FATAL_FAILURE(run_both(hosts, args("by_hand")));
  expect_same_metrics(dir + "/torchrun/metrics.jsonl", dir + "/by_hand/metrics.jsonl", 3,
                      {"step", "loss", "grad_norm"});
}

enum class Fault { kCutLink, kKillStoreHost, kKillOtherHost };

// Starts a long run on both hosts, injects the fault once rank 0 has logged a few steps, and
// checks that each surviving rank exits non-zero within the timeout plus the grace, naming what
// it lost. Prints the survivors' exit times after the fault.
void expect_fault_is_reported(TwoHosts& hosts, Fault fault) {
  const auto dir = make_temp_dir("multihost_fault");
  const std::vector<std::string> args = {
      "train",
      write_config(dir),
      "trainer.default_local_dir=" + dir + "/run",
      "trainer.total_training_steps=1000000",
      "trainer.save_freq=-1",
      "actor_rollout_ref.nccl_timeout=" + std::to_string(kTimeoutSeconds)};
  std::unique_ptr<BackgroundProcess> ranks[2] = {hosts.start_rank(0, args),
                                                 hosts.start_rank(1, args)};
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (lines_in(dir + "/run/metrics.jsonl") < 3) {
    if (Clock::now() > deadline || ranks[0]->exited() || ranks[1]->exited()) {
      ADD_FAILURE() << "the run did not get going\n[rank 0]\n"
                    << ranks[0]->output() << "\n[rank 1]\n"
                    << ranks[1]->output();
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  std::vector<int> survivors;
  const auto fault_at = Clock::now();
  switch (fault) {
    case Fault::kCutLink:
      EXPECT_EQ(ip({"-n", hosts.host(1).ns, "link", "set", hosts.host(1).veth, "down"}).exit_code,
                0);
      survivors = {0, 1};
      break;
    case Fault::kKillStoreHost:
      hosts.kill_all(hosts.host(0));
      survivors = {1};
      break;
    case Fault::kKillOtherHost:
      hosts.kill_all(hosts.host(1));
      survivors = {0};
      break;
  }
  const double bound = kTimeoutSeconds + kGraceSeconds;
  // Both survivors are watched at once, so each exit time is its own. A rank still running well
  // past the bound is killed (and shows as too slow) rather than waited for.
  const auto give_up = fault_at + std::chrono::seconds(static_cast<int>(bound) + 30);
  auto running = [&] {
    bool any = false;
    for (int rank : survivors) any |= !ranks[rank]->exited();  // every one polled, for its time
    return any;
  };
  while (running() && Clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::string exit_seconds;
  for (int rank : survivors) {
    auto result = ranks[rank]->wait(0);
    const double seconds =
        std::chrono::duration<double>(ranks[rank]->end_time() - fault_at).count();
    exit_seconds += fmt::format(" rank {}: {:.2f} s", rank, seconds);
    EXPECT_NE(result.exit_code, 0) << result.output;
    EXPECT_LT(seconds, bound) << "rank " << rank << " took " << seconds << " s\n" << result.output;
    // The value the config set reached the process group, and the message names its key.
    EXPECT_NE(result.output.find("timeout " + std::to_string(kTimeoutSeconds * 1000) + " ms"),
              std::string::npos)
        << result.output;
    EXPECT_NE(
        result.output.find("actor_rollout_ref.nccl_timeout=" + std::to_string(kTimeoutSeconds)),
        std::string::npos)
        << result.output;
    if (rank == 0) {
      EXPECT_NE(result.output.find("rank 1 stopped responding"), std::string::npos)
          << result.output;
    } else {
      EXPECT_NE(result.output.find("the rendezvous store at " + hosts.host(0).address + ":" +
                                   std::to_string(kPort) + " (hosted by rank 0)"),
                std::string::npos)
          << result.output;
    }
  }
  // Read by the 10-runs-in-a-row check for the spread of exit times.
  std::cout << "[multihost] exit after the fault:" << exit_seconds << " (bound " << bound
            << " s)\n";
}

TEST(MultiHost, CutLinkEndsBothSidesNamingThePeer) {
  REQUIRE_TWO_HOSTS(hosts);
  expect_fault_is_reported(hosts, Fault::kCutLink);
}

TEST(MultiHost, KilledStoreHostIsNamedByTheSurvivor) {
  REQUIRE_TWO_HOSTS(hosts);
  expect_fault_is_reported(hosts, Fault::kKillStoreHost);
}

TEST(MultiHost, KilledHostIsNamedByTheStoreHost) {
  REQUIRE_TWO_HOSTS(hosts);
  expect_fault_is_reported(hosts, Fault::kKillOtherHost);
}

}  // namespace
}  // namespace shardrl::testing
