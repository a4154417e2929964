// Offload over real ranks: the training policy and a mid-training round trip change no bit of
// training; grouped optimizers move every sub-optimizer's state; a file offload frees memory.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "fsdp_run.h"
#include "shardrl/offload.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

void expect_bitwise_equal(const Run& got, const Run& expected) {
  ASSERT_FALSE(expected.losses.empty());
  EXPECT_EQ(got.losses, expected.losses);
  EXPECT_EQ(got.grad_norms, expected.grad_norms);
  ASSERT_EQ(got.params.size(), expected.params.size());
  for (const auto& [name, tensor] : expected.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    EXPECT_TRUE(torch::equal(got.params.at(name), tensor)) << name << " differs";
  }
}

// Four micro-batches per step, with a global batch every world size here divides into them.
Scenario accumulation_scenario() {
  Scenario s;
  s.unused_params = true;
  s.micro = 4;
  s.batch = 16;
  s.max_norm = 0.05;  // clipping on: the norm and the scaling pass over offloaded grads too
  return s;
}

// offloaded = [params, grads, optimizer] bytes in the tier after each step, per rank.
void expect_offloaded_after_every_step(const Run& run, bool optimizer) {
  for (const auto& rank : run.memory) {
    ASSERT_EQ(rank["offloaded"].size(), 3u);
    for (const auto& step : rank["offloaded"]) {
      EXPECT_GT(step[0].get<int64_t>(), 0) << "params not offloaded: " << rank.dump();
      EXPECT_GT(step[1].get<int64_t>(), 0) << "grads not offloaded: " << rank.dump();
      if (optimizer) {
        EXPECT_GT(step[2].get<int64_t>(), 0) << rank.dump();
      }
    }
  }
}

class OffloadPolicyTest : public ::testing::TestWithParam<int> {};

TEST_P(OffloadPolicyTest, TrainingWithGradientAccumulationIsBitwiseUnchanged) {
  const Scenario s = accumulation_scenario();
  const std::string dir = make_temp_dir("offload");
  auto plain = train_sharded(GetParam(), s);
  auto offloaded = train_sharded(GetParam(), s,
                                 {"--param-offload", "--optimizer-offload", "--offload-dir", dir});
  expect_bitwise_equal(offloaded, plain);
  expect_offloaded_after_every_step(offloaded, true);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, OffloadPolicyTest, ::testing::Values(1, 2));

TEST(Offload, PolicyWithoutGradientSyncIsBitwiseUnchanged) {
  const Scenario s = accumulation_scenario();
  auto plain = train_sharded(2, s, {"--no-sync"});
  auto offloaded = train_sharded(2, s, {"--no-sync", "--param-offload"});
  expect_bitwise_equal(offloaded, plain);
  expect_offloaded_after_every_step(offloaded, false);
}

TEST(Offload, RoundTripMidTrainingChangesNoBitOfTheContinuation) {
  const Scenario s = accumulation_scenario();
  auto plain = train_sharded(2, s);
  // After the backward of step 1: params, grads and the optimizer state of step 0 all move.
  auto round_trip = train_sharded(2, s, {"--offload-round-trip-step", "1"});
  expect_bitwise_equal(round_trip, plain);
  for (const auto& rank : round_trip.memory) {
    const auto& moved = rank["offloaded"][0];
    EXPECT_GT(moved[0].get<int64_t>(), 0) << rank.dump();
    EXPECT_GT(moved[1].get<int64_t>(), 0) << rank.dump();
    EXPECT_GT(moved[2].get<int64_t>(), 0) << rank.dump();
  }
}

nlohmann::json run_grouped(int stepped) {
  const std::string dir = make_temp_dir("offload-grouped");
  auto result = launch_workers(2, {"grouped", "--out", dir, "--stepped", std::to_string(stepped)},
                               300, "offload_worker");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return nlohmann::json::parse(std::ifstream(dir + "/grouped_0.json"));
}

void expect_every_state_tensor_moved(const nlohmann::json& phase) {
  EXPECT_EQ(phase["top_level_state"], 0) << "the grouped optimizer's own state stays empty";
  EXPECT_EQ(phase["resident_after_offload"], 0) << phase.dump();
  EXPECT_EQ(phase["optimizer_resident"], 0) << phase.dump();
  EXPECT_EQ(phase["changed_after_onload"], 0) << phase.dump();
  EXPECT_GT(phase["optimizer_offloaded"].get<int64_t>(), 0);
}

TEST(GroupedOptimizerOffload, FirstSubOptimizerSteppedSecondNot) {
  auto report = run_grouped(0);
  const auto& one = report["one_stepped"];
  EXPECT_GT(one["sub_state"][0].get<int64_t>(), 0);
  EXPECT_EQ(one["sub_state"][1], 0);
  expect_every_state_tensor_moved(one);
  const auto& both = report["both_stepped"];
  EXPECT_GT(both["sub_state"][1].get<int64_t>(), 0);
  expect_every_state_tensor_moved(both);
  // Moments of every param of both parts, plus the shards and grads.
  EXPECT_GT(both["tensors"].get<int64_t>(), one["tensors"].get<int64_t>());
  EXPECT_DOUBLE_EQ(report["adapter_lr_after_step"].get<double>(), 1e-2 / 2);
}

TEST(GroupedOptimizerOffload, FirstSubOptimizerEmptyAndTopLevelStateEmpty) {
  // The shape of verl's bug: the state an `if not optimizer.state` check sees is empty (the
  // grouped optimizer's own, and the first part's), yet the second part's state must move.
  auto report = run_grouped(1);
  const auto& one = report["one_stepped"];
  EXPECT_EQ(one["sub_state"][0], 0);
  EXPECT_GT(one["sub_state"][1].get<int64_t>(), 0);
  expect_every_state_tensor_moved(one);
  expect_every_state_tensor_moved(report["both_stepped"]);
}

TEST(Offload, FileTierReleasesResidentMemoryAndRestoresBitwise) {
  const std::string out = make_temp_dir("offload-memory");
  // d_model 1024, 3 blocks: ~38M params, so params + grads + AdamW moments > 600 MB.
  auto result = launch_workers(
      1, {"memory", "--out", out, "--dir", out + "/tier", "--d-model", "1024", "--layers", "3"},
      300, "offload_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto m = nlohmann::json::parse(std::ifstream(out + "/memory.json"));
  const auto offloaded = m["offloaded"].get<int64_t>();
  EXPECT_GE(offloaded, 500LL * 1000 * 1000) << m.dump();
  EXPECT_EQ(m["resident"], 0) << m.dump();
  const auto dropped = m["rss_before"].get<int64_t>() - m["rss_after_offload"].get<int64_t>();
  EXPECT_GE(dropped, offloaded * 9 / 10) << m.dump();
  EXPECT_EQ(m["changed_after_onload"], 0) << m.dump();
  // A second round overwrites the files the first left, and restores bitwise again; once the
  // model is gone, so are its files.
  EXPECT_GT(m["scratch_files_after_onload"], 0) << m.dump();
  EXPECT_EQ(m["changed_after_second_round"], 0) << m.dump();
  int64_t left = 0;
  if (std::filesystem::exists(out + "/tier")) {
    for (const auto& f : std::filesystem::recursive_directory_iterator(out + "/tier"))
      left += f.is_regular_file() ? 1 : 0;
  }
  EXPECT_EQ(left, 0);
}

// An actor and its reference model offloaded at the same time into one directory: each comes
// back bit for bit (the files are named per model, not only per unit).
TEST(Offload, TwoModelsShareADirectoryWithoutClobbering) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  Scenario s;
  s.layers = 2;
  std::vector<models::Transformer> models;
  std::vector<std::map<std::string, torch::Tensor>> before;
  offload::Options options;
  options.dir = make_temp_dir("offload-shared-dir");
  for (uint64_t seed : {1u, 2u}) {
    s.seed = seed;
    models.push_back(build_model(s));
    models::shard_transformer(models.back(), mesh, {});
    before.push_back(models.back().fsdp().full_parameters());
    auto sharded = models.back().fsdp();  // a handle on the model's FSDP state
    offload::set_policy(sharded, nullptr, options);
  }
  for (auto& m : models) {
    auto sharded = m.fsdp();
    offload::offload(sharded, nullptr);
  }
  for (auto& m : models) {
    auto sharded = m.fsdp();
    offload::onload(sharded, nullptr);
  }
  for (size_t i = 0; i < models.size(); ++i) {
    for (const auto& [name, tensor] : models[i].fsdp().full_parameters()) {
      EXPECT_TRUE(torch::equal(tensor, before[i].at(name))) << "model " << i << " " << name;
    }
  }
  EXPECT_FALSE(torch::equal(before[0].begin()->second, before[1].begin()->second));
}

TEST(Offload, BadInputIsNamed) {
  expect_invalid_argument_naming([] { offload::parse_tier("tape", "offload.tier"); },
                                 "offload.tier", "tape");
}

// A rank killed by a signal (pre-empted, or by the OOM killer) cannot remove its file tier, which
// is as large as its offloaded state (27.5 GB a host for Qwen3-1.7B): the next job on the host
// removes the scratch directories of processes that are gone, and keeps those of live ones.
TEST(Offload, ScratchLeftByRanksThatAreGoneIsRemovedByTheNextJob) {
  const auto dir = make_temp_dir("offload-stale");
  const auto tmp = dir + "/tmp";
  const pid_t gone = [] {  // a pid that was a process and is no more
    const pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, nullptr, 0);
    return child;
  }();
  const auto stale = fmt::format("{}/shardrl-offload-{}-rank0", tmp, gone);
  const auto live = fmt::format("{}/shardrl-offload-{}-rank1", tmp, getpid());
  for (const auto& scratch : {stale, live}) {
    std::filesystem::create_directories(scratch);
    std::ofstream(scratch + "/unit0.params.bin") << "state";
  }
  const auto config = dir + "/small.yaml";
  std::ofstream(config) << kSmallLmConfig;
  const auto run = run_process(
      {bin("shardrl"), "train", config, "trainer.default_local_dir=" + dir + "/run",
       "trainer.total_training_steps=1", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
       "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
       "actor_rollout_ref.actor.fsdp_config.offload_tier=file"},
      {{"TMPDIR", tmp}}, 300);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_FALSE(std::filesystem::exists(stale)) << run.output;
  EXPECT_NE(run.output.find(fmt::format("removed shardrl-offload-{}-rank0", gone)),
            std::string::npos)
      << run.output;
  EXPECT_TRUE(std::filesystem::exists(live + "/unit0.params.bin"));
  // The job's own scratch is gone with it.
  size_t left = 0;
  for (const auto& entry : std::filesystem::directory_iterator(tmp)) left += entry.path() != live;
  EXPECT_EQ(left, 0u);
}

}  // namespace
}  // namespace shardrl::testing
