// One rank of the sharded SD3 diffusion-RL test: a CPS rollout with CFG on the sharded model,
// the rewards' group advantages gathered over the ranks, and the Flow-GRPO loss and backward;
// writes what it saw to OUT/rank_<r>.json.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "shardrl/dist.h"
#include "workers/sd3_rl_scenario.h"

using namespace shardrl;

namespace {

std::vector<double> values(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kDouble).contiguous();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

int run(const std::string& out) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto model = testing::build_sd3(testing::SD3Scenario{});
  models::shard_sd3(model, mesh, models::WrapPolicy(fsdp::Options{}, false));
  const int64_t rank = world->rank();
  auto rollout = testing::sd3_rl_rollout(model, rank);
  auto rewards = testing::sd3_rl_rewards(rollout);
  auto adv = algos::group_advantages(rewards, testing::kSD3RlGroup, {}, &world->group());
  auto loss = testing::sd3_rl_loss(model, rollout, adv.advantages);
  loss.loss.backward();
  nlohmann::json j{{"window", {rollout.window.begin, rollout.window.end}},
                   {"rewards", values(rewards)},
                   {"advantages", values(adv.advantages)},
                   {"group_ids", adv.group_ids},
                   {"reward_mean", adv.reward_mean},
                   {"loss", loss.loss.item<double>()},
                   {"ppo_kl", loss.metrics.at("ppo_kl").item<double>()}};
  std::ofstream(out + "/rank_" + std::to_string(rank) + ".json") << j.dump();
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL sharded SD3 diffusion-RL test worker"};
  std::string out = ".";
  app.add_option("--out", out);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(out);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
