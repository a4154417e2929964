// One rank of the SD3 parity test: flow-matching training of the SD3 scenario with every
// transformer block an FSDP unit; writes the per-step losses and, at the end, the gathered
// parameters. With --lora only a LoRA adapter ("default") on the attention projections trains;
// with --save the trained model is saved as a checkpoint carrying the export info an engine
// records (family "sd3", diffusers' config.json, the adapter's PEFT config).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "shardrl/checkpoint.h"
#include "shardrl/dist.h"
#include "shardrl/optim.h"
#include "workers/param_files.h"
#include "workers/sd3_scenario.h"

using namespace shardrl;

namespace {

struct Options {
  std::string out = ".", save_root;
  bool checkpoint = false, lora = false;
};

int train(const testing::SD3Scenario& s, const Options& o) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto model = testing::build_sd3(s);
  const auto lora = testing::sd3_lora_config();
  if (o.lora) models::lora::apply_lora(*model, lora, "default");
  models::shard_sd3(model, mesh, models::WrapPolicy(fsdp::Options{}, o.checkpoint));
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
  if (!o.save_root.empty()) {
    nlohmann::json extra = {{"family", "sd3"}, {"config", model->config().to_json()}};
    if (o.lora) {
      extra["lora"] = {{"default", nlohmann::json::parse(models::lora::peft_adapter_config(lora))}};
    }
    checkpoint::save(o.save_root, s.steps, fsdp_model, *optimizer, nullptr, extra);
  }
  auto full = fsdp_model.full_parameters();
  if (world->rank() == 0) {
    testing::write_params(full, o.out);
    std::ofstream(o.out + "/losses.json") << nlohmann::json{{"loss", losses}}.dump();
  }
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL SD3 multi-rank test worker"};
  testing::SD3Scenario s;
  Options o;
  app.add_option("--steps", s.steps);
  app.add_option("--lr", s.lr);
  app.add_option("--out", o.out);
  app.add_flag("--checkpoint", o.checkpoint, "Activation checkpointing per block");
  app.add_flag("--lora", o.lora, "Train a LoRA adapter on the attention projections only");
  app.add_option("--save", o.save_root, "Checkpoint root to save the trained model under");
  CLI11_PARSE(app, argc, argv);
  try {
    return train(s, o);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
