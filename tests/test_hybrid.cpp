// Hybrid sharding (fsdp_size < world) with several models in one process, at 4 ranks: each
// model's DeviceMesh makes its own shard and replicate groups. The reference is the same job
// sharded over all 4 ranks, which ParityTest and the engine tests hold to unsharded LibTorch;
// a 2 x 2 mesh reduces in another order (a reduce-scatter over 2, then an all-reduce over 2), so
// results agree to fp32 rounding, not bitwise.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model_test_util.h"
#include "test_util.h"
#include "workers/param_files.h"

namespace shardrl::testing {
namespace {

using nlohmann::json;

void expect_close_metrics(const std::vector<json>& got, const std::vector<json>& expected,
                          const std::vector<std::string>& keys, double tolerance) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    for (const auto& key : keys) {
      ASSERT_TRUE(expected[i].contains(key)) << key << " in " << expected[i].dump();
      ASSERT_TRUE(got[i].contains(key)) << key << " in " << got[i].dump();
      const double want = expected[i][key].get<double>(), have = got[i][key].get<double>();
      EXPECT_NEAR(have, want, tolerance * std::max(1.0, std::abs(want))) << key << " at line " << i;
    }
  }
}

// An actor engine and a forward-only reference engine, both at fsdp_size 2 of 4 ranks: two
// meshes whose groups have the same shapes. The reference's log-probs enter the actor's loss, so
// a reference that read wrong params would change the actor's steps.
TEST(HybridSharding, ActorAndReferenceOnTwoByTwoMeshesEqualOneShardGroupOfFour) {
  std::map<int, std::string> dirs;
  for (int fsdp_size : {2, 4}) {
    dirs[fsdp_size] = make_temp_dir("hybrid_pair" + std::to_string(fsdp_size));
    auto result =
        launch_workers(4, {"--out", dirs[fsdp_size], "--fsdp-size", std::to_string(fsdp_size)}, 300,
                       "hybrid_worker");
    ASSERT_EQ(result.exit_code, 0) << result.output;
  }
  for (int rank = 0; rank < 4; ++rank) {
    const std::string file = "/metrics." + std::to_string(rank) + ".jsonl";
    auto hybrid = read_jsonl(dirs[2] + file), full = read_jsonl(dirs[4] + file);
    ASSERT_EQ(full.size(), 3u);
    expect_close_metrics(hybrid, full, {"loss", "pull", "grad_norm"}, 1e-5);
  }
  for (const std::string model : {"actor", "ref"}) {
    auto hybrid = read_params(dirs[2] + "/" + model), full = read_params(dirs[4] + "/" + model);
    ASSERT_EQ(hybrid.size(), full.size());
    for (const auto& [name, tensor] : full) {
      ASSERT_TRUE(hybrid.count(name)) << name;
      EXPECT_LE(relative_error(hybrid.at(name), tensor), 1e-5) << model << " " << name;
    }
  }
}

// The task with PPO's critic builds four engines in one process (the supervised stage, the actor,
// the reference and the critic), each on its own 2 x 2 mesh. The same run on one shard group of 4
// gives the same rewards, losses, KL, value losses and grad norms (each engine of the hybrid run on
// its own mesh).
TEST(HybridSharding, PpoTaskWithFourEnginesOnTwoByTwoMeshesEqualsOneShardGroupOfFour) {
  const auto dir = make_temp_dir("hybrid_grpo");
  auto run = [&](const std::string& name, int fsdp_size) {
    std::vector<std::string> argv = {
        bin("shardrl"),
        "train",
        std::string(SHARDRL_SOURCE_DIR "/examples/configs/arithmetic_grpo.yaml"),
        "trainer.nproc_per_node=4",
        "trainer.default_local_dir=" + dir + "/" + name,
        "sft.cache_dir=" + dir + "/" + name + "/cache",  // each run trains its own SFT engine
        "sft.steps=4",
        "sft.batch_size=16",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=" + std::to_string(fsdp_size),
        "actor_rollout_ref.ref.fsdp_config.fsdp_size=" + std::to_string(fsdp_size),
        "critic.fsdp_config.fsdp_size=" + std::to_string(fsdp_size),
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-3"};
    auto result = run_process(argv, {{"OMP_NUM_THREADS", "1"}}, 400);
    EXPECT_EQ(result.exit_code, 0) << result.output;
    return read_jsonl(dir + "/" + name + "/metrics.jsonl");
  };
  auto hybrid = run("hybrid", 2);
  auto full = run("full", 4);
  ASSERT_EQ(full.size(), 3u);
  expect_close_metrics(hybrid, full,
                       {"reward_mean", "loss", "kl", "grad_norm", "critic/vf_loss",
                        "critic/grad_norm", "critic/values/mean"},
                       1e-4);
}

}  // namespace
}  // namespace shardrl::testing
