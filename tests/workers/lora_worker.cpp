// One rank of the LoRA sharding tests: trains the LoRA scenario with FSDP and writes, per step,
// the bytes the backward sent (reduce-scatters only: params stay gathered after forward, so the
// backward gathers nothing), which shards got grads, and at the end the gathered params. With
// --save it also saves a checkpoint carrying the "default" adapter's PEFT config, and with
// --export-adapter it exports that adapter from the live sharded model.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "shardrl/checkpoint.h"
#include "shardrl/dist.h"
#include "shardrl/optim.h"
#include "workers/lora_scenario.h"
#include "workers/param_files.h"

using namespace shardrl;

namespace {

struct Outputs {
  std::string out = ".", save_root, export_adapter;
};

int train(const testing::LoraScenario& s, const Outputs& o) {
  const std::string& out = o.out;
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  fsdp::Options options;
  options.reshard_after_forward = false;
  auto net = testing::build_lora_net(s);
  for (auto& b : net->blocks) fsdp::fully_shard(b, mesh, options);
  fsdp::fully_shard(net, mesh, options);
  auto model = net.fsdp();
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_sharded(model.sharded_parameters()), adam);

  const int64_t local = s.batch / world->size();
  nlohmann::json losses = nlohmann::json::array(), bytes = nlohmann::json::array(),
                 with_grad = nlohmann::json::array();
  for (int64_t step = 0; step < s.steps; ++step) {
    auto [x, y] = testing::lora_batch(s, step);
    x = x.narrow(0, world->rank() * local, local);
    y = y.narrow(0, world->rank() * local, local);
    model.zero_grad();
    auto loss = torch::mse_loss(net(x), y);
    model.reset_bytes_sent();
    loss.backward();
    bytes.push_back(model.bytes_sent());
    nlohmann::json names = nlohmann::json::array();
    for (const auto& p : model.sharded_parameters()) {
      if (p.shard.grad().defined()) names.push_back(p.name);
    }
    with_grad.push_back(names);
    optim::clip_and_step(model, *optimizer, 0.0);
    models::lora::ema_update(models::lora::named_tensors(model.sharded_parameters()), "old",
                             "default", s.ema_decay);
    auto total = loss.detach().clone();
    world->group().all_reduce(total);
    losses.push_back(total.item<double>() / world->size());
  }
  if (!o.save_root.empty()) {
    const nlohmann::json extra = {
        {"lora",
         {{"default",
           nlohmann::json::parse(models::lora::peft_adapter_config(testing::lora_config()))}}}};
    checkpoint::save(o.save_root, s.steps, model, *optimizer, nullptr, extra);
  }
  if (!o.export_adapter.empty()) {
    models::lora::export_peft_adapter(model, testing::lora_config(), "default", o.export_adapter);
  }
  auto full = model.full_parameters();
  if (world->rank() == 0) {
    testing::write_params(full, out);
  }
  std::ofstream(out + "/run_" + std::to_string(world->rank()) + ".json")
      << nlohmann::json{{"loss", losses}, {"bytes_sent", bytes}, {"with_grad", with_grad}}.dump();
  world->group().barrier();
  return 0;
}

// One micro-batch's reference forward (adapters disabled, no grad) and policy forward + backward,
// three ways: separately (each forward gathers), separately with reshard_after_forward = false
// (the backward gathers nothing), and inside one UnshardScope. Writes the bytes each phase sent,
// the outputs and the grads.
int shared_gather(const testing::LoraScenario& s, const std::string& out) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto net = testing::build_lora_net(s);
  for (auto& b : net->blocks) fsdp::fully_shard(b, mesh, fsdp::Options{});
  fsdp::fully_shard(net, mesh, fsdp::Options{});
  auto model = net.fsdp();
  // Non-zero B, so the policy differs from the reference.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model.sharded_parameters()) {
      if (p.name.find("lora_B") != std::string::npos) p.shard.normal_(0, 0.1);
    }
  }
  const int64_t local = s.batch / world->size();
  auto x = testing::lora_batch(s, 0).first.narrow(0, world->rank() * local, local);

  nlohmann::json bytes, results;
  auto reference = [&] {
    torch::NoGradGuard no_grad;
    models::lora::DisableAdapters off(*net);
    return net(x);
  };
  auto grads = [&] {
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : model.sharded_parameters()) {
      if (p.shard.grad().defined()) g[p.name] = p.shard.grad().clone();
    }
    model.zero_grad();
    return g;
  };
  auto record = [&](const std::string& way, const torch::Tensor& ref, const torch::Tensor& policy) {
    const std::string dir = out + "/" + way + "_" + std::to_string(world->rank());
    std::filesystem::create_directories(dir + "/out");
    std::filesystem::create_directories(dir + "/grads");
    testing::write_params({{"ref", ref}, {"policy", policy.detach()}}, dir + "/out");
    testing::write_params(grads(), dir + "/grads");
  };

  model.reset_bytes_sent();
  auto ref = reference();
  bytes["separate_ref"] = model.bytes_sent();
  model.reset_bytes_sent();
  auto policy = net(x);
  bytes["separate_policy"] = model.bytes_sent();
  model.reset_bytes_sent();
  policy.pow(2).mean().backward();
  bytes["separate_backward"] = model.bytes_sent();
  record("separate", ref, policy);

  model.set_reshard_after_forward(false);
  model.reset_bytes_sent();
  policy = net(x);
  policy.pow(2).mean().backward();
  bytes["kept_policy_and_backward"] = model.bytes_sent();
  model.set_reshard_after_forward(true);
  grads();

  model.reset_bytes_sent();
  {
    fsdp::UnshardScope gathered(model);
    bytes["scope_unshard"] = model.bytes_sent();
    ref = reference();
    policy = net(x);
    bytes["scope_forwards"] = model.bytes_sent();
    policy.pow(2).mean().backward();
    bytes["scope_total"] = model.bytes_sent();
    bytes["scope_unsharded_param_bytes"] = model.memory().unsharded_param_bytes;
  }
  bytes["after_scope_unsharded_param_bytes"] = model.memory().unsharded_param_bytes;
  record("scope", ref, policy);

  int64_t shard_bytes = 0;
  for (const auto& p : model.sharded_parameters()) shard_bytes += p.shard.numel() * 4;
  bytes["full_gather"] = (world->size() - 1) * shard_bytes;
  std::ofstream(out + "/gather_" + std::to_string(world->rank()) + ".json") << bytes.dump();
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL LoRA multi-rank test worker"};
  testing::LoraScenario s;
  Outputs o;
  app.add_option("--steps", s.steps);
  app.add_option("--out", o.out);
  app.add_option("--save", o.save_root, "Checkpoint root to save the trained model under");
  app.add_option("--export-adapter", o.export_adapter, "Export 'default' here (PEFT files)");
  bool shared = false;
  app.add_flag("--shared-gather", shared, "compare one UnshardScope with separate forwards");
  CLI11_PARSE(app, argc, argv);
  try {
    return shared ? shared_gather(s, o.out) : train(s, o);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
