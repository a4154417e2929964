// One rank of the DiT parity test: flow-matching training of the DiT scenario with FSDP; writes
// the per-step losses and, at the end, the gathered parameters.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "shardrl/dist.h"
#include "shardrl/optim.h"
#include "workers/dit_scenario.h"
#include "workers/param_files.h"

using namespace shardrl;

namespace {

int train(const testing::DiTScenario& s, const std::string& out, bool checkpoint) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto model = testing::build_dit(s);
  models::shard_dit(model, mesh, models::WrapPolicy(fsdp::Options{}, checkpoint));
  auto fsdp_model = model.fsdp();
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), adam);
  const int64_t local = s.batch / world->size(), first = world->rank() * local;
  nlohmann::json losses = nlohmann::json::array();
  for (int64_t step = 0; step < s.steps; ++step) {
    auto b = testing::dit_batch(s, step);
    fsdp_model.zero_grad();
    auto v = model(b.xt.narrow(0, first, local), b.t.narrow(0, first, local),
                   b.y.narrow(0, first, local));
    auto loss = torch::mse_loss(v, b.target.narrow(0, first, local));
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
  CLI::App app{"ShardRL DiT multi-rank test worker"};
  testing::DiTScenario s;
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
