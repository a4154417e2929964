// One rank of the offload tests that look inside the state: grouped optimizers (every
// sub-optimizer's state moves, stepped or not) and the resident memory a file-tier offload frees.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <malloc.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "shardrl/dist.h"
#include "shardrl/offload.h"
#include "shardrl/optim.h"
#include "workers/scenario.h"

using namespace shardrl;

namespace {

// Every tensor the round trip must keep: shards, grads, every sub-optimizer's state.
std::vector<torch::Tensor> training_state(fsdp::FSDPModule& model,
                                          torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.sharded_parameters()) {
    out.push_back(p.shard);
    if (p.shard.grad().defined()) out.push_back(p.shard.grad());
  }
  for (auto* leaf : optim::leaf_optimizers(optimizer)) {
    for (const auto& group : leaf->param_groups()) {
      for (const auto& p : group.params()) {
        if (auto* state = optim::find_state(*leaf, p)) {
          for (const auto& t : optim::state_tensors(*state)) out.push_back(t);
        }
      }
    }
  }
  return out;
}

std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

int64_t count_resident(const std::vector<torch::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.storage().nbytes() > 0;
  return n;
}

int64_t count_changed(const std::vector<torch::Tensor>& tensors,
                      const std::vector<torch::Tensor>& before) {
  int64_t n = 0;
  for (size_t i = 0; i < tensors.size(); ++i) n += !torch::equal(tensors[i], before[i]);
  return n;
}

int64_t state_count(torch::optim::Optimizer& optimizer) {
  return static_cast<int64_t>(optimizer.state().size());
}

void train_step(testing::Scenario& s, models::Transformer& model, fsdp::FSDPModule& fsdp_model,
                torch::optim::Optimizer& optimizer, int64_t step, int rank, int size,
                const std::function<bool(const std::string&)>& keep_grad) {
  const int64_t local = s.batch / size;
  auto tokens =
      testing::global_batch(s, step, model->config().vocab_size).narrow(0, rank * local, local);
  fsdp_model.zero_grad();
  models::next_token_loss(model(tokens), tokens).backward();
  for (auto& p : fsdp_model.sharded_parameters()) {
    if (!keep_grad(p.name)) p.shard.mutable_grad() = torch::Tensor();
  }
  optim::clip_and_step(fsdp_model, optimizer, 1.0);
}

// Base and "adapter" params (block 1) in two AdamWs with their own settings; first only the
// one named by `stepped` has grads, so the other has no state when everything is offloaded.
int grouped(testing::Scenario s, const std::string& out, int stepped) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto model = testing::build_model(s);
  models::shard_transformer(model, mesh, {});
  auto fsdp_model = model.fsdp();
  auto in_adapter = [](const std::string& name) {
    return name.find("blocks.1.") != std::string::npos;
  };
  std::vector<optim::NamedParameter> base, adapter;
  for (const auto& p : optim::from_sharded(fsdp_model.sharded_parameters())) {
    (in_adapter(p.name) ? adapter : base).push_back(p);
  }
  optim::AdamWConfig base_config, adapter_config;
  base_config.lr = 1e-3;
  adapter_config.lr = 1e-2;
  adapter_config.weight_decay = 0.0;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> parts;
  parts.push_back(optim::make_adamw(base, base_config));
  parts.push_back(optim::make_adamw(adapter, adapter_config));
  optim::GroupedOptimizer optimizer(std::move(parts));

  nlohmann::json report;
  auto round_trip = [&](const std::string& phase) {
    auto state = training_state(fsdp_model, optimizer);
    auto before = snapshot(state);
    offload::offload(fsdp_model, &optimizer);
    auto m = offload::memory(fsdp_model, &optimizer);
    nlohmann::json r = {
        {"tensors", state.size()},
        {"top_level_state", state_count(optimizer)},
        {"sub_state", {state_count(optimizer.optimizer(0)), state_count(optimizer.optimizer(1))}},
        {"resident_after_offload", count_resident(state)},
        {"optimizer_resident", m.optimizer.resident},
        {"optimizer_offloaded", m.optimizer.offloaded}};
    offload::onload(fsdp_model, &optimizer);
    r["changed_after_onload"] = count_changed(state, before);
    r["optimizer_bytes_after_onload"] = optim::optimizer_state_bytes(optimizer);
    report[phase] = r;
  };

  const int rank = world->rank(), size = world->size();
  train_step(s, model, fsdp_model, optimizer, 0, rank, size,
             [&](const std::string& name) { return in_adapter(name) == (stepped == 1); });
  round_trip("one_stepped");
  // The LR scheduler's view: an lr set on the grouped optimizer's groups reaches the parts.
  for (auto& group : optimizer.param_groups()) group.options().set_lr(group.options().get_lr() / 2);
  train_step(s, model, fsdp_model, optimizer, 1, rank, size,
             [](const std::string&) { return true; });
  report["adapter_lr_after_step"] = optimizer.optimizer(1).param_groups()[0].options().get_lr();
  round_trip("both_stepped");
  std::ofstream(out + "/grouped_" + std::to_string(rank) + ".json") << report.dump();
  world->group().barrier();
  return 0;
}

// A model of >= 500 MB of training state (params, grads, AdamW moments) on one rank: offload to
// files must lower VmRSS by (nearly) those bytes, and onload must restore them bit for bit.
int memory(testing::Scenario s, const std::string& out, const std::string& dir) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  auto model = testing::build_model(s);
  models::shard_transformer(model, mesh, {});
  auto fsdp_model = model.fsdp();
  auto optimizer = optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), {});
  train_step(s, model, fsdp_model, *optimizer, 0, world->rank(), world->size(),
             [](const std::string&) { return true; });
  auto state = training_state(fsdp_model, *optimizer);
  auto before = snapshot(state);
  offload::Options options;
  options.dir = dir;
  offload::set_policy(fsdp_model, optimizer.get(), options);  // no policy: just the directory

  malloc_trim(0);  // what the step left free must not count as freed by the offload
  const int64_t rss_before = offload::process_rss_bytes();
  offload::offload(fsdp_model, optimizer.get());
  const int64_t rss_after = offload::process_rss_bytes();
  offload::log_memory("after offload", fsdp_model, optimizer.get());
  auto m = offload::memory(fsdp_model, optimizer.get());
  offload::onload(fsdp_model, optimizer.get());
  const int64_t rss_onloaded = offload::process_rss_bytes();
  offload::log_memory("after onload", fsdp_model, optimizer.get());
  const auto changed_after_onload = count_changed(state, before);
  // The scratch files stay for the next offload, which overwrites them in place.
  int64_t scratch_files = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir))
    scratch_files += f.is_regular_file() ? 1 : 0;
  offload::offload(fsdp_model, optimizer.get());
  offload::onload(fsdp_model, optimizer.get());
  std::ofstream(out + "/memory.json") << nlohmann::json{
      {"rss_before", rss_before},
      {"rss_after_offload", rss_after},
      {"rss_after_onload", rss_onloaded},
      {"offloaded", m.params.offloaded + m.grads.offloaded + m.optimizer.offloaded},
      {"resident", m.params.resident + m.grads.resident + m.optimizer.resident},
      {"changed_after_onload", changed_after_onload},
      {"scratch_files_after_onload", scratch_files},
      {"changed_after_second_round",
       count_changed(state, before)}}.dump();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL offload test worker"};
  testing::Scenario s;
  std::string out = ".", dir;
  int stepped = 0;
  auto* grouped_cmd = app.add_subcommand("grouped", "grouped optimizer offload round trips");
  grouped_cmd->add_option("--out", out);
  grouped_cmd->add_option("--stepped", stepped, "The sub-optimizer that steps first (0 or 1)");
  auto* memory_cmd = app.add_subcommand("memory", "resident memory freed by a file offload");
  memory_cmd->add_option("--out", out);
  memory_cmd->add_option("--dir", dir);
  memory_cmd->add_option("--d-model", s.d_model);
  memory_cmd->add_option("--layers", s.layers);
  app.require_subcommand(1);
  CLI11_PARSE(app, argc, argv);
  try {
    if (grouped_cmd->parsed()) return grouped(s, out, stepped);
    s.batch = 2;
    s.seq = 8;
    return memory(s, out, dir);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
