// One rank of the SD3 parity test: flow-matching training of the SD3 scenario with every
// transformer block an FSDP unit; writes the per-step losses and, at the end, the gathered
// parameters.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "shardrl/dist.h"
#include "shardrl/optim.h"
#include "workers/param_files.h"
#include "workers/sd3_scenario.h"

using namespace shardrl;

namespace {

int train(const testing::SD3Scenario& s, const std::string& out, bool checkpoint) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto model = testing::build_sd3(s);
  models::shard_sd3(model, mesh, models::WrapPolicy(fsdp::Options{}, checkpoint));
  auto fsdp_model = model.fsdp();
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), adam);
  const int64_t local = s.batch / world->size(), first = world->rank() * local;
  nlohmann::json losses = nlohmann::json::array();
  for (int64_t step = 0; step < s.steps; ++step) {
    auto b = testing::sd3_batch(s, step);
    auto mine = [&](const torch::Tensor& t) { return t.narrow(0, first, local); };
    fsdp_model.zero_grad();
    auto v = model(mine(b.xt), mine(b.prompt_embeds), mine(b.pooled), mine(b.timestep));
    auto loss = torch::mse_loss(v, mine(b.target));
    loss.backward();
    optim::clip_and_step(fsdp_model, *optimizer, 0.0);
    auto total = loss.detach().clone();
    world->group().all_reduce(total);
    losses.push_back(total.item<double>() / world->size());
  }
  auto full = fsdp_model.full_parameters();
  if (world->rank() == 0) {
    testing::write_params(full, out);
    std::ofstream(out + "/losses.json") << nlohmann::json{{"loss", losses}}.dump();
  }
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL SD3 multi-rank test worker"};
  testing::SD3Scenario s;
  std::string out = ".";
  app.add_option("--steps", s.steps);
  app.add_option("--out", out);
  bool checkpoint = false;
  app.add_flag("--checkpoint", checkpoint, "Activation checkpointing per block");
  CLI11_PARSE(app, argc, argv);
  try {
    return train(s, out, checkpoint);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
