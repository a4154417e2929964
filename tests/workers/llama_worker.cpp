// One rank of the LLaMA parity test: next-token training of the LLaMA scenario with FSDP; writes
// the per-step losses and, at the end, the gathered parameters. With --from-hf DIR the model is
// built under fsdp::EmptyInit and its weights come from DIR through load_hf_from_rank0.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "shardrl/checkpoint.h"
#include "shardrl/dist.h"
#include "shardrl/models/transformer.h"
#include "shardrl/optim.h"
#include "workers/llama_scenario.h"
#include "workers/param_files.h"

using namespace shardrl;

namespace {

int train(const testing::LlamaScenario& s, const std::string& out, const std::string& from_hf) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  models::LlamaForCausalLM model{nullptr};
  if (from_hf.empty()) {
    model = testing::build_llama(s);
  } else {
    fsdp::EmptyInit empty;
    model = testing::build_llama(s);
  }
  models::shard_llama(model, mesh, models::WrapPolicy(fsdp::Options{}, s.checkpoint));
  auto fsdp_model = model.fsdp();
  if (!from_hf.empty()) checkpoint::load_hf_from_rank0(from_hf, fsdp_model);
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), adam);
  const int64_t local = s.batch / world->size(), first = world->rank() * local;
  nlohmann::json losses = nlohmann::json::array(), bytes = nlohmann::json::array();
  int64_t unsharded_after_forward = -1;
  for (int64_t step = 0; step < s.steps; ++step) {
    auto tokens = testing::llama_batch(s, step).narrow(0, first, local);
    fsdp_model.zero_grad();
    fsdp_model.reset_bytes_sent();
    auto loss = models::next_token_loss(model(tokens), tokens);
    // Only the root's params stay gathered until backward: the blocks, the embeddings and the
    // head are units of their own and were freed after their forward.
    if (step == 0) unsharded_after_forward = fsdp_model.memory().unsharded_param_bytes;
    loss.backward();
    bytes.push_back(fsdp_model.bytes_sent());
    optim::clip_and_step(fsdp_model, *optimizer, 0.0);
    auto total = loss.detach().clone();
    world->group().all_reduce(total);
    losses.push_back(total.item<double>() / world->size());
  }
  auto full = fsdp_model.full_parameters();
  if (world->rank() == 0) {
    testing::write_params(full, out);
    std::ofstream(out + "/losses.json") << nlohmann::json{
        {"loss", losses},
        {"bytes_sent", bytes},
        {"unsharded_after_forward",
         unsharded_after_forward}}.dump();
  }
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL LLaMA multi-rank test worker"};
  testing::LlamaScenario s;
  std::string out = ".", from_hf;
  app.add_option("--steps", s.steps);
  app.add_option("--from-hf", from_hf, "Build empty and load these weights from rank 0");
  app.add_option("--out", out);
  app.add_flag("--lora", s.lora);
  app.add_flag("--checkpoint", s.checkpoint);
  CLI11_PARSE(app, argc, argv);
  try {
    return train(s, out, from_hf);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
