// The bulk collectives on real ranks: shared memory between ranks of one host (the default on a
// CPU) and Gloo (SHARDRL_SHM_DISABLE=1, and what ranks on different hosts use) give exactly the
// values each rank computes for itself, across slot boundaries, dtypes and several collectives in
// flight; a peer that exits, stalls or calls a different collective ends in a named
// CollectiveError, an exit at once rather than at the timeout; a /dev/shm too small falls back.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <fstream>

#include "test_util.h"

namespace shardrl::testing {
namespace {

using json = nlohmann::json;

std::vector<json> run_comm(int nproc, const std::vector<std::string>& args,
                           const std::map<std::string, std::string>& env = {}) {
  const auto dir = make_temp_dir("comm");
  std::vector<std::string> all = args;
  all.insert(all.end(), {"--out", dir});
  auto result = launch_workers(nproc, all, 300, "comm_worker", env);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  std::vector<json> ranks;
  for (int r = 0; r < nproc; ++r) {
    std::ifstream in(dir + "/rank" + std::to_string(r) + ".json");
    EXPECT_TRUE(in.good()) << "rank " << r << " wrote nothing\n" << result.output;
    ranks.push_back(in ? json::parse(in) : json::object());
  }
  return ranks;
}

class CommCheck : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(CommCheck, CollectivesGiveTheExactValues) {
  const auto [nproc, shm] = GetParam();
  std::map<std::string, std::string> env;
  if (!shm) env["SHARDRL_SHM_DISABLE"] = "1";
  auto ranks = run_comm(nproc, {"check"}, env);
  for (const auto& r : ranks) {
    const std::string transport = r.value("transport", "");
    if (shm) {
      EXPECT_EQ(transport, "shm") << r.dump();
    } else {
      EXPECT_EQ(transport, "gloo (SHARDRL_SHM_DISABLE=1 on rank 0)") << r.dump();
    }
    EXPECT_GT(r.value("cases", 0), shm ? 130 : 100) << r.dump();
    EXPECT_TRUE(r.contains("failures") && r["failures"].empty()) << r.dump(1);
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndTransport, CommCheck,
                         ::testing::Values(std::make_tuple(2, true), std::make_tuple(3, true),
                                           std::make_tuple(4, true), std::make_tuple(2, false),
                                           std::make_tuple(3, false)));

// One rank's SHARDRL_SHM_DISABLE=1 turns shared memory off for the whole group, not for one side.
TEST(Comm, OneRankWithoutSharedMemoryTurnsItOffForTheGroup) {
  auto ranks = run_comm(2, {"check", "--no-shm-rank", "1"});
  for (const auto& r : ranks) {
    EXPECT_EQ(r.value("transport", ""), "gloo (SHARDRL_SHM_DISABLE=1 on rank 1)") << r.dump();
    EXPECT_TRUE(r.contains("failures") && r["failures"].empty()) << r.dump(1);
  }
}

// FSDP's host-shared image: every rank reads all rows where its peers wrote them, and a rank that
// starts the next gather waits until every peer has released the last one. Rank 1 holds the first
// gather for 600 ms; rank 0's second gather must block that long, and rank 1 must see the first
// gather's rows all along. An image larger than /dev/shm is refused on both ranks alike.
TEST(Comm, HostImageWaitsForEveryPeerToReleaseTheLastGather) {
  auto ranks = run_comm(2, {"image", "--stall-ms", "600"});
  for (const auto& r : ranks) {
    ASSERT_EQ(r.value("transport", ""), "shm") << r.dump();
    EXPECT_TRUE(r.contains("failures") && r["failures"].empty()) << r.dump(1);
    EXPECT_GE(r.value("cases", 0), 2 * 3 + 1) << r.dump();
    EXPECT_FALSE(r.value("too_big_mapped", true)) << r.dump();
    EXPECT_NE(r.value("too_big_why", "").find("no host-shared image (rank 0: reserving"),
              std::string::npos)
        << r.dump();
  }
  // Rank 1 re-reads the first gather's 3 segments every ~20 ms of its 600 ms hold; at least 5
  // reads, so that a loaded machine (ctest -j, 2 cores), where one read takes 10 ms or more,
  // still passes.
  EXPECT_GE(ranks[1].value("cases", 0), 2 * 3 + 1 + 3 * 5) << ranks[1].dump();
  EXPECT_GT(ranks[0].value("issue_seconds_2", 0.0), 0.5) << ranks[0].dump();
  EXPECT_LT(ranks[1].value("issue_seconds_2", 1.0), 0.3) << ranks[1].dump();
}

// A peer that dies while the ranks map a host-shared image leaves nothing in /dev/shm: rank 0 made
// the file before it waited for the peer, and unlinks it on the way out of the failed collective
// (/dev/shm is memory: a leaked file keeps its pages until the machine reboots).
TEST(Comm, PeerDyingWhileAnImageIsMappedLeavesNothingInDevShm) {
  const auto dir = make_temp_dir("orphan_image");
  auto result = launch_workers(2, {"orphan-image", "--out", dir}, 120, "comm_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto rank0 = json::parse(std::ifstream(dir + "/rank0.json"));
  EXPECT_NE(rank0.value("error", "").find("rank 1"), std::string::npos) << rank0.dump(1);
  EXPECT_FALSE(rank0.value("mapped", false)) << rank0.dump(1);
  EXPECT_TRUE(rank0["left_in_dev_shm"].empty()) << rank0.dump(1);
}

// A /dev/shm too small for the segment (here 1 MiB: a tmpfs mounted in a mount namespace of the
// job's own; Docker's default is 64 MiB) leaves the group on Gloo, saying why, rather than failing
// with SIGBUS in the middle of a step when tmpfs runs out of pages.
TEST(Comm, DevShmTooSmallFallsBackToGloo) {
  SHARDRL_REQUIRE_DEPENDENCY(geteuid() == 0 && run_process({"unshare", "-m", "true"}).exit_code == 0
                                 ? ""
                                 : "root and unshare (util-linux) for a mount namespace");
  const auto dir = make_temp_dir("comm_small_shm");
  const std::string job = "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec " + bin("shardrl") +
                          " launch -n 2 --threads 1 -- " + bin("comm_worker") + " check --out " +
                          dir;
  auto result =
      run_process({"unshare", "-m", "--propagation", "private", "sh", "-c", job}, {}, 300);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  for (int r = 0; r < 2; ++r) {
    auto rank = json::parse(std::ifstream(dir + "/rank" + std::to_string(r) + ".json"));
    const std::string transport = rank.value("transport", "");
    EXPECT_NE(transport.find("gloo (no shared-memory segment (rank 0: reserving"),
              std::string::npos)
        << transport;
    EXPECT_NE(transport.find("No space left on device"), std::string::npos) << transport;
    EXPECT_TRUE(rank["failures"].empty()) << rank.dump(1);
  }
}

// A peer that exits is found through its pidfd: the survivors report it long before the timeout.
TEST(Comm, ExitedPeerIsNamedAtOnce) {
  auto ranks = run_comm(3, {"exit", "--exit-rank", "1", "--timeout-ms", "60000"});
  ASSERT_EQ(ranks.size(), 3u);
  for (int r : {0, 2}) {
    EXPECT_EQ(ranks[r].value("transport", ""), "shm");
    const std::string error = ranks[r].value("error", "");
    EXPECT_NE(error.find("all_gather failed on rank " + std::to_string(r)), std::string::npos)
        << error;
    EXPECT_NE(error.find("rank 1 stopped responding"), std::string::npos) << error;
    EXPECT_NE(error.find("rank 1 (pid "), std::string::npos) << error;
    EXPECT_NE(error.find("exited while this rank waited"), std::string::npos) << error;
    EXPECT_LT(ranks[r].value("seconds", 1e9), 10.0) << error;  // the timeout is 60 s
  }
}

// A live peer that does not arrive ends the wait at the group's timeout, named as a timeout.
TEST(Comm, StalledPeerTimesOut) {
  auto ranks =
      run_comm(2, {"stall", "--exit-rank", "1", "--timeout-ms", "2000", "--stall-ms", "8000"});
  ASSERT_EQ(ranks.size(), 2u);
  const std::string error = ranks[0].value("error", "");
  EXPECT_NE(error.find("rank 1 did not publish its piece within 2000 ms"), std::string::npos)
      << error;
  EXPECT_NE(error.find("every rank of the group is alive"), std::string::npos) << error;
  const double seconds = ranks[0].value("seconds", 0.0);
  EXPECT_GT(seconds, 1.9) << error;
  EXPECT_LT(seconds, 8.0) << error;
}

// Ranks that call collectives of different sizes both fail, each naming what the other called.
TEST(Comm, CollectivesOutOfStepAreNamed) {
  auto ranks = run_comm(2, {"mismatch", "--timeout-ms", "20000"});
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    const std::string error = r.value("error", "");
    EXPECT_NE(error.find("shared-memory collectives out of step"), std::string::npos) << error;
    EXPECT_NE(error.find("all_gather of 2400000 bytes"), std::string::npos) << error;
    EXPECT_NE(error.find("all_gather of 1200000 bytes"), std::string::npos) << error;
    EXPECT_LT(r.value("seconds", 1e9), 10.0) << error;
  }
}

// Seconds from when rank 0's main returned to the end of the job (rank 0's teardown, at least).
double rank0_teardown_seconds(const std::string& dir) {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  auto rank0 = json::parse(std::ifstream(dir + "/rank0.json"));
  return now - rank0.value("returned_at", now);
}

// The end of a job whose ranks finish apart. Rank 0 hosts the store and stays until every rank has
// checked out: a rank left beating against a store that is gone gets LibTorch's lost-connection
// warning, with a C++ stack trace, at the end of a job that succeeded.
TEST(Comm, StoreHostStaysUntilEveryRankHasFinished) {
  for (const int late : {1, 2}) {
    auto ranks = run_comm(3, {"finish", "--exit-rank", std::to_string(late), "--stall-ms", "800"});
    for (const auto& r : ranks) EXPECT_EQ(r.value("sum", 0.0), 3.0) << r.dump();
  }
  const auto dir = make_temp_dir("finish");
  auto result = launch_workers(2, {"finish", "--exit-rank", "1", "--stall-ms", "800", "--out", dir},
                               60, "comm_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  for (const char* noise : {"frame #", "Connection was likely closed", "TCPStore"})
    EXPECT_EQ(result.output.find(noise), std::string::npos) << noise << "\n" << result.output;
  EXPECT_GT(rank0_teardown_seconds(dir), 0.7);  // rank 0 waited for rank 1's 800 ms
}

// A rank that died never checks out: rank 0 stops waiting for it once its heartbeat has stood
// still for six periods (1.5 s), well before the longest it would wait for a live one (5 s).
TEST(Comm, StoreHostDoesNotWaitForADeadRank) {
  const auto dir = make_temp_dir("vanish");
  auto result = launch_workers(
      2, {"vanish", "--exit-rank", "1", "--timeout-ms", "60000", "--out", dir}, 120, "comm_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  const double teardown = rank0_teardown_seconds(dir);
  EXPECT_GT(teardown, 1.0);
  EXPECT_LT(teardown, 4.0);
}

// Under torchrun its agent hosts the store and every rank is a client of it, as
// torch.distributed's own ranks are: no rank tries to bind the agent's port (LibTorch would log
// that as an error before carrying on), and nobody waits for anybody at the end. In "restart",
// rank 1 fails after its first attempt has run and torchrun (--max-restarts 1) starts both again;
// the agent's store still holds the first attempt's keys, and rank 0 comes a second late, so a
// rank 1 that read them would connect to Gloo's address of a rank that is gone.
TEST(Comm, RanksStartedByTorchrunUseItsAgentsStore) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"torch"}));
  for (const std::string mode : {"check", "finish", "restart"}) {
    const auto dir = make_temp_dir("torchrun");
    const std::string worker = bin("comm_worker") + (mode == "finish" ? " finish" : " check") +
                               " --stall-ms 800 --timeout-ms 20000 --out " + dir;
    const std::string attempt = "[ \"$TORCHELASTIC_RESTART_COUNT\" = ";
    const std::string script =
        mode == "restart"
            ? "if " + attempt + "1 ] && [ \"$RANK\" = 0 ]; then sleep 1; fi; " + worker +
                  " && if " + attempt + "0 ] && [ \"$RANK\" = 1 ]; then rm " + dir +
                  "/rank1.json; exit 3; fi"
            : "exec " + worker;
    auto result = run_process(
        {SHARDRL_PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port",
         std::to_string(free_port()), "--no-python", "/bin/sh", "-c", script},
        {}, 300);
    ASSERT_EQ(result.exit_code, 0) << result.output;
    if (mode == "restart") {
      EXPECT_NE(result.output.find("exitcode: 3"), std::string::npos) << result.output;
    }
    for (const char* noise : {"failed to bind", "frame #", "Connection was likely closed"})
      EXPECT_EQ(result.output.find(noise), std::string::npos) << noise << "\n" << result.output;
    for (int r = 0; r < 2; ++r) {
      auto rank = json::parse(std::ifstream(dir + "/rank" + std::to_string(r) + ".json"));
      EXPECT_EQ(rank.value("transport", ""), "shm") << rank.dump();
      if (mode != "finish") {
        EXPECT_TRUE(rank["failures"].empty()) << rank.dump(1);
      }
    }
  }
}

}  // namespace
}  // namespace shardrl::testing
