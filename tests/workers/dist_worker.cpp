// One rank of a multi-rank test, started by `shardrl launch`. Trains the scenario with FSDP and
// writes what the test compares: per-step losses, the gathered parameters, memory per rank.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>
#include <iostream>
#include <thread>

#include "fsdp/trace.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/offload.h"
#include "shardrl/optim.h"
#include "workers/param_files.h"
#include "workers/scenario.h"

using namespace shardrl;

namespace {

// Offload in the run: a training policy, and a manual offload and onload of everything after the
// backward of one step.
struct OffloadArgs {
  offload::Options policy;
  int64_t round_trip_step = -1;
  bool any() const {
    return policy.param_offload || policy.optimizer_offload || round_trip_step >= 0;
  }
};

// The host-shared images of unsharded params this process maps (Options::host_shared_params):
// their /dev/shm files are unlinked once mapped, but /proc/self/maps still names them.
int host_images_mapped() {
  std::ifstream maps("/proc/self/maps");
  int images = 0;
  for (std::string line; std::getline(maps, line);)
    images +=
        line.find("/shardrl-") != std::string::npos && line.find("-image") != std::string::npos;
  return images;
}

int train(const testing::Scenario& s, const std::string& out, int fsdp_size,
          const std::string& param_dtype, const std::string& reduce_dtype, bool no_sync,
          int die_rank, int die_step, int hang_rank, int timeout_ms, bool reshard_after_forward,
          int prefetch, bool trace, const OffloadArgs& offloading, bool private_unsharded) {
  dist::InitOptions init;
  init.timeout = std::chrono::milliseconds(timeout_ms);
  auto world = dist::World::init_from_env(init);
  auto mesh = dist::DeviceMesh::create(*world, fsdp_size);

  fsdp::Options options;
  options.mixed_precision.param_dtype =
      fsdp::parse_dtype(param_dtype, "mixed_precision.param_dtype");
  options.mixed_precision.reduce_dtype =
      fsdp::parse_dtype(reduce_dtype, "mixed_precision.reduce_dtype");
  options.mixed_precision.output_dtype = torch::kFloat;
  options.reshard_after_forward = reshard_after_forward;
  options.prefetch = prefetch;
  options.host_shared_params = !private_unsharded;

  auto model = testing::build_model(s);
  const int64_t vocab = model->config().vocab_size;
  models::shard_transformer(model, mesh, options);
  auto fsdp_model = model.fsdp();
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), adam);
  if (offloading.any()) offload::set_policy(fsdp_model, optimizer.get(), offloading.policy);
  nlohmann::json offloaded = nlohmann::json::array();
  // The FSDP schedule of each step's forwards and backwards (fsdp/trace.h).
  nlohmann::json traced = nlohmann::json::array();
  fsdp::trace::set_enabled(trace);

  const int dp = mesh.data_parallel_size();
  const int dp_rank = mesh.data_parallel_rank();
  const int64_t local = s.batch / dp, micro_rows = local / s.micro;
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array(),
                 bytes = nlohmann::json::array(), skipped = nlohmann::json::array();
  for (int64_t step = 0; step < s.steps; ++step) {
    if (world->rank() == die_rank && step == die_step) std::raise(SIGKILL);
    // Alive but stuck outside any collective: the others must time out, not hang.
    if (world->rank() == hang_rank && step == die_step)
      std::this_thread::sleep_for(std::chrono::minutes(10));
    // On a GPU the batch moves to the mesh's device, as a data loader would put it there; the
    // loss compares logits with these tokens on that device.
    auto batch =
        testing::global_batch(s, step, vocab).narrow(0, dp_rank * local, local).to(mesh.device());
    fsdp_model.zero_grad();
    fsdp_model.reset_bytes_sent();
    torch::Tensor loss_sum = torch::zeros({1}, torch::device(mesh.device()));
    for (int64_t m = 0; m < s.micro; ++m) {
      fsdp_model.set_requires_gradient_sync(!no_sync || m == s.micro - 1);
      auto tokens = batch.narrow(0, m * micro_rows, micro_rows);
      auto loss = models::next_token_loss(model(tokens), tokens) / static_cast<double>(s.micro);
      if (step == s.nan_step) loss = loss * std::numeric_limits<float>::quiet_NaN();
      loss.backward();
      loss_sum += loss.detach();
    }
    bytes.push_back(fsdp_model.bytes_sent());
    if (trace) {
      nlohmann::json events = nlohmann::json::array();
      for (const auto& r : fsdp::trace::take()) {
        events.push_back({{"event", fsdp::trace::name(r.event)},
                          {"unit", r.unit},
                          {"dtype", std::string(c10::toString(r.dtype))},
                          {"bytes", r.bytes},
                          {"gathered", r.gathered}});
      }
      traced.push_back(events);
    }
    if (step == offloading.round_trip_step) {
      offload::offload(fsdp_model, optimizer.get());
      auto m = offload::memory(fsdp_model, optimizer.get());
      offloaded.push_back({m.params.offloaded, m.grads.offloaded, m.optimizer.offloaded});
      offload::onload(fsdp_model, optimizer.get());
    }
    auto result = optim::clip_and_step(fsdp_model, *optimizer, s.max_norm);
    world->group().all_reduce(loss_sum);
    losses.push_back(loss_sum.item<double>() / world->size());
    skipped.push_back(result.skipped);
    norms.push_back(result.grad_norm);
    if (offloading.policy.param_offload || offloading.policy.optimizer_offload) {
      auto m = offload::memory(fsdp_model, optimizer.get());
      offloaded.push_back({m.params.offloaded, m.grads.offloaded, m.optimizer.offloaded});
    }
  }

  auto mem = fsdp_model.memory();
  nlohmann::json memory = {{"sharded_param_bytes", mem.sharded_param_bytes},
                           {"sharded_grad_bytes", mem.sharded_grad_bytes},
                           {"unsharded_param_bytes", mem.unsharded_param_bytes},
                           {"unsharded_grad_bytes", mem.unsharded_grad_bytes},
                           {"optimizer_bytes", optim::optimizer_state_bytes(*optimizer)},
                           {"offloaded", offloaded},
                           {"host_images", host_images_mapped()}};
  auto full = fsdp_model.full_parameters();
  if (world->rank() == 0) {
    testing::write_params(full, out);
    std::ofstream(out + "/losses.json") << nlohmann::json{
        {"loss", losses},
        {"grad_norm", norms},
        {"bytes_sent", bytes},
        {"skipped", skipped}}.dump();
  }
  std::ofstream(out + "/memory_" + std::to_string(world->rank()) + ".json") << memory.dump();
  if (trace)
    std::ofstream(out + "/trace_" + std::to_string(world->rank()) + ".json") << traced.dump();
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL multi-rank test worker"};
  testing::Scenario s;
  std::string out = ".", param_dtype = "fp32", reduce_dtype = "fp32";
  int fsdp_size = -1, die_rank = -1, die_step = -1, hang_rank = -1, timeout_ms = 60000,
      prefetch = 1;
  bool no_sync = false, keep_unsharded = false, trace = false, private_unsharded = false;
  OffloadArgs offloading;
  auto* train_cmd = app.add_subcommand("train", "FSDP training of the test transformer");
  train_cmd->add_option("--steps", s.steps);
  train_cmd->add_option("--batch", s.batch);
  train_cmd->add_option("--seq", s.seq);
  train_cmd->add_option("--micro", s.micro);
  train_cmd->add_option("--layers", s.layers);
  train_cmd->add_option("--lr", s.lr);
  train_cmd->add_option("--max-norm", s.max_norm);
  train_cmd->add_option("--seed", s.seed);
  train_cmd->add_flag("--unused-params", s.unused_params);
  train_cmd->add_option("--freeze", s.freeze);
  train_cmd->add_option("--out", out);
  train_cmd->add_option("--fsdp-size", fsdp_size);
  train_cmd->add_option("--param-dtype", param_dtype);
  train_cmd->add_option("--reduce-dtype", reduce_dtype);
  train_cmd->add_flag("--no-sync", no_sync);
  train_cmd->add_flag("--keep-unsharded", keep_unsharded);
  train_cmd->add_option("--die-rank", die_rank);
  train_cmd->add_option("--die-step", die_step, "Step at which --die-rank or --hang-rank acts");
  train_cmd->add_option("--hang-rank", hang_rank);
  train_cmd->add_option("--prefetch", prefetch);
  train_cmd->add_flag("--trace", trace, "Write each step's FSDP schedule to trace_<rank>.json");
  train_cmd->add_option("--nan-step", s.nan_step);
  train_cmd->add_option("--timeout-ms", timeout_ms);
  train_cmd->add_flag("--param-offload", offloading.policy.param_offload);
  train_cmd->add_flag("--optimizer-offload", offloading.policy.optimizer_offload);
  train_cmd->add_option("--offload-dir", offloading.policy.dir);
  train_cmd->add_option("--offload-round-trip-step", offloading.round_trip_step);
  train_cmd->add_flag("--private-unsharded", private_unsharded,
                      "host_shared_params = false: each rank gathers into its own memory");
  app.require_subcommand(1);
  CLI11_PARSE(app, argc, argv);
  try {
    return train(s, out, fsdp_size, param_dtype, reduce_dtype, no_sync, die_rank, die_step,
                 hang_rank, timeout_ms, !keep_unsharded, prefetch, trace, offloading,
                 private_unsharded);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
