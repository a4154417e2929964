// FSDP when something goes wrong, on real ranks over real Gloo (fsdp_fault_worker): a forward or
// backward that throws on every rank, a peer that leaves in the middle of a collective; and
// no_sync's grad accumulation under bf16 params.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "test_util.h"
#include "workers/param_files.h"

namespace shardrl::testing {
namespace {

using nlohmann::json;

struct Recovered {
  json summary;
  std::map<std::string, torch::Tensor> params;
};

Recovered run_recover(const std::vector<std::string>& extra) {
  const auto dir = make_temp_dir("fsdp_recover");
  std::vector<std::string> args = {"recover", "--out", dir, "--steps", "3"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto result = launch_workers(2, args, 300, "fsdp_fault_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  if (result.exit_code != 0) return {};
  return {json::parse(std::ifstream(dir + "/losses.json")), read_params(dir)};
}

// The same run with no failure. It is the plain FSDP path, which ParityTest holds to unsharded
// LibTorch; a recovered run must take exactly the same steps (same code, same sums: bitwise).
const Recovered& run_without_failure() {
  static const Recovered run = run_recover({});
  return run;
}

void expect_same_run(const Recovered& got, const Recovered& expected) {
  ASSERT_EQ(got.summary["loss"], expected.summary["loss"]);
  ASSERT_EQ(got.params.size(), expected.params.size());
  for (const auto& [name, tensor] : expected.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    EXPECT_TRUE(torch::equal(got.params.at(name), tensor)) << name;
  }
}

// Every rank throws in block 0's backward at step 1, after block 1 was gathered, reduced and
// resharded and the root queued its end-of-backward work, which autograd then drops. The step is
// redone: the stale backward is abandoned (its reduce-scatter finished and discarded, every unit
// resharded), and the root's grads are reduced again on the retry and every step after it.
TEST(FSDPErrors, BackwardThatThrowsIsAbandonedAndTheStepRedoneMatches) {
  auto run = run_recover({"--throw-in", "backward", "--throw-step", "1"});
  ASSERT_EQ(run.summary["failures"].size(), 1u);
  EXPECT_NE(run.summary["failures"][0].get<std::string>().find("injected failure"),
            std::string::npos);
  expect_same_run(run, run_without_failure());
}

// The root's forward throws (a token out of the vocabulary) after it gathered its params and
// started the prefetch of block 0: the retry completes that gather and runs as usual.
TEST(FSDPErrors, ForwardThatThrowsLeavesTheStepRedoneUnchanged) {
  auto run = run_recover({"--throw-in", "forward", "--throw-step", "1"});
  ASSERT_EQ(run.summary["failures"].size(), 1u);
  EXPECT_NE(run.summary["failures"][0].get<std::string>().find("index"), std::string::npos)
      << run.summary.dump();
  expect_same_run(run, run_without_failure());
}

// Rank 1 leaves at step 1; rank 0 meets the failed collective, then tries the model again.
json lose_peer(const std::vector<std::string>& extra) {
  const auto dir = make_temp_dir("fsdp_lose_peer");
  std::vector<std::string> args = {
      "lose-peer", "--out", dir, "--exit-rank", "1", "--exit-step", "1", "--timeout-ms", "20000"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto result = launch_workers(2, args, 120, "fsdp_fault_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  if (result.exit_code != 0) return {};
  auto out = json::parse(std::ifstream(dir + "/errors.json"));
  std::cout << out.dump(1) << "\n";
  return out;
}

// The first error is the collective's own (naming the lost rank), not a refusal: the failure
// path itself (freeing what was gathered, dropping gathers in flight) must not throw another.
void expect_collective_error(const json& e) {
  const std::string message = e["error"].get<std::string>();
  EXPECT_NE(message.find("rank 1 stopped responding"), std::string::npos) << e.dump();
  EXPECT_EQ(message.find("cannot run"), std::string::npos) << e.dump();
}

// Each later use must refuse at once, naming the unit and the collective that failed, instead
// of retrying a collective the other ranks are not in (or reading an unfilled buffer).
void expect_refusals(const json& errors, size_t from, const std::string& failed) {
  ASSERT_GT(errors.size(), from);
  for (size_t i = from; i < errors.size(); ++i) {
    const auto& e = errors[i];
    const std::string message = e["error"].get<std::string>();
    EXPECT_NE(message.find("cannot run"), std::string::npos) << e.dump();
    EXPECT_NE(message.find(failed), std::string::npos) << e.dump();
    EXPECT_LT(e["seconds"].get<double>(), 1.0) << e.dump();  // no collective was attempted
  }
}

TEST(FSDPErrors, FailedAllGatherLeavesAModelThatRefusesToRun) {
  auto out = lose_peer({"--exit-before", "forward"});
  ASSERT_TRUE(out.contains("errors"));
  const auto& errors = out["errors"];
  ASSERT_EQ(errors.size(), 4u);
  expect_collective_error(errors[0]);
  // forward again, unshard() (every unit's gather in flight at once), full_parameters().
  expect_refusals(errors, 1, "the all-gather of unit 'root' failed");
  EXPECT_EQ(out["unsharded_param_bytes"].get<int64_t>(), 0);
}

// unshard() puts every unit's gather in flight before the first wait: after that wait fails, the
// gathers still in flight are never read, and no unit is left gathered or held.
TEST(FSDPErrors, FailedGathersInFlightLeaveNoUnitGathered) {
  auto out = lose_peer({"--exit-before", "unshard"});
  ASSERT_TRUE(out.contains("errors"));
  const auto& errors = out["errors"];
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_EQ(errors[0]["call"], "unshard");
  expect_collective_error(errors[0]);
  expect_refusals(errors, 1, "the all-gather of unit 'root' failed");
  EXPECT_EQ(out["unsharded_param_bytes"].get<int64_t>(), 0);
}

TEST(FSDPErrors, FailedReduceScatterLeavesAModelThatRefusesToRun) {
  // Params kept gathered after forward: the backward's first collective is a reduce-scatter, the
  // head's (first in backward).
  auto out = lose_peer({"--exit-before", "backward", "--keep-unsharded"});
  ASSERT_TRUE(out.contains("errors"));
  const auto& errors = out["errors"];
  ASSERT_EQ(errors.size(), 5u);
  EXPECT_EQ(errors[0]["call"], "backward");
  expect_collective_error(errors[0]);
  // clip_grad_norm_ (the grads are incomplete), forward again, unshard(), full_parameters().
  expect_refusals(errors, 1, "the reduce-scatter of unit 'head' failed");
  EXPECT_EQ(out["unsharded_param_bytes"].get<int64_t>(), 0);
}

// bf16 params, fp32 reduce_dtype, 6 micro-batches: under no_sync the unsharded grads kept between
// micro-batches are fp32 (4 bytes per element), as FSDP2 keeps them in reduce_dtype. The grads
// then equal those of syncing every micro-batch (each bf16 micro-batch grad summed in fp32 either
// way) up to fp32 reassociation: 12 terms (6 micro-batches x 2 ranks), each sum rounding by at
// most 2^-24 relative, bound the difference by 12 * 2^-24 (~7e-7) of the largest grad. Kept in
// bf16, each of the 5 additions rounds to 8 bits (2^-9 relative): ~1e-3.
TEST(FSDPAccumulation, NoSyncKeepsBf16GradsInReduceDtypeAndMatchesSyncingEveryMicroBatch) {
  const auto dir = make_temp_dir("fsdp_accumulate");
  auto result =
      launch_workers(2, {"accumulate", "--out", dir, "--micro", "6"}, 300, "fsdp_fault_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto out = json::parse(std::ifstream(dir + "/accumulate.json"));
  std::cout << out.dump(1) << "\n";
  EXPECT_EQ(out["kept_grad_bytes"].get<int64_t>(), 4 * out["unsharded_numel"].get<int64_t>());
  const double largest = out["max_grad"].get<double>();
  EXPECT_GT(largest, 0.0);
  EXPECT_LE(out["max_difference"].get<double>(), 12 * std::ldexp(1.0, -24) * largest);
}

}  // namespace
}  // namespace shardrl::testing
