// One rank of a checkpoint test, started by `shardrl launch` (or alone as a world of one).
//   train: trains the test scenario with a cosine LR schedule from step 0 or from a checkpoint,
//          saving where told; writes losses, LRs, RNG probes and the gathered parameters.
//   load:  loads a checkpoint (for the damage tests) and reports its step.
//   init:  initialises a freshly built model from HF-style safetensors (load_hf, or
//          load_hf_from_rank0 with --from-rank0; built under fsdp::EmptyInit with --empty-init,
//          checking that nothing was allocated unsharded and nothing runs before the load) and
//          writes its parameters.
//   sync:  streams the model's full parameters with for_each_full_parameter and checks each
//          against full_parameters() and that training state is unchanged.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>
#include <iostream>
#include <set>

#include "shardrl/checkpoint.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/lr_schedule.h"
#include "shardrl/optim.h"
#include "workers/param_files.h"
#include "workers/scenario.h"

using namespace shardrl;
using nlohmann::json;

namespace {

struct Args {
  testing::Scenario s;
  std::string root, load_dir, hf_dir, out = ".", export_dtype = "bf16";
  int64_t end_step = 6;
  bool resume = false;
  std::vector<int64_t> save_at;
  int keep = 0;
  double max_mem_gb = 0;
  int die_rank = -1;
  int64_t die_save_step = -1, die_after_bytes = 0;
  int fsdp_size = -1;
  bool from_rank0 = false;
  bool empty_init = false;
};

optim::LRScheduleConfig schedule() {
  optim::LRScheduleConfig c;
  c.warmup_style = "cosine";
  c.lr_warmup_steps = 2;
  c.total_training_steps = 8;
  c.min_lr_ratio = 0.1;
  return c;
}

// A sharded model, its optimizer and scheduler, as every subcommand builds them.
struct Trainer {
  std::shared_ptr<dist::World> world;
  dist::DeviceMesh mesh;
  models::Transformer model{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::unique_ptr<optim::LRScheduler> scheduler;

  explicit Trainer(const Args& a) {
    dist::InitOptions init;
    init.timeout = std::chrono::seconds(30);
    world = dist::World::init_from_env(init);
    mesh = dist::DeviceMesh::create(*world, a.fsdp_size);
    if (a.empty_init) {
      fsdp::EmptyInit empty;
      model = testing::build_model(a.s);
      for (const auto& item : model->named_parameters()) {
        if (item.value().storage().nbytes() != 0) {
          throw std::runtime_error("EmptyInit allocated parameter " + item.key());
        }
      }
    } else {
      model = testing::build_model(a.s);
    }
    models::shard_transformer(model, mesh, fsdp::Options{});
    optim::AdamWConfig adam;
    adam.lr = a.s.lr;
    optimizer = optim::make_adamw(optim::from_sharded(model.fsdp().sharded_parameters()), adam);
    scheduler = std::make_unique<optim::LRScheduler>(*optimizer, schedule());
  }
};

int train(const Args& a) {
  Trainer t(a);
  auto fsdp_model = t.model.fsdp();
  const int rank = t.world->rank();
  checkpoint::SaveOptions save_options;
  save_options.max_ckpt_to_keep = a.keep;
  save_options.max_mem_gb = a.max_mem_gb;
  int64_t saving = -1;
  save_options.progress = [&](const std::string& path, int64_t bytes) {
    if (rank == a.die_rank && saving == a.die_save_step && bytes >= a.die_after_bytes) {
      std::cerr << "dying during the save of step " << saving << " in " << path << " after "
                << bytes << " bytes" << std::endl;
      std::raise(SIGKILL);
    }
  };

  int64_t start = 0;
  std::optional<std::string> from = a.load_dir.empty() ? std::nullopt : std::optional(a.load_dir);
  if (a.resume && !from) from = checkpoint::find_latest(a.root);
  if (from) {
    auto loaded = checkpoint::load(*from, fsdp_model, t.optimizer.get(), t.scheduler.get());
    start = loaded.step;
    if (rank == 0) std::cout << "resumed from " << *from << " at step " << start << std::endl;
  }

  const int64_t vocab = t.model->config().vocab_size;
  const int dp = t.mesh.data_parallel_size(), dp_rank = t.mesh.data_parallel_rank();
  const int64_t local = a.s.batch / dp;
  json losses = json::array(), lrs = json::array(), probes = json::array();
  const std::set<int64_t> save_at(a.save_at.begin(), a.save_at.end());
  for (int64_t step = start; step < a.end_step; ++step) {
    auto tokens = testing::global_batch(a.s, step, vocab).narrow(0, dp_rank * local, local);
    fsdp_model.zero_grad();
    auto loss = models::next_token_loss(t.model(tokens), tokens);
    loss.backward();
    optim::clip_and_step(fsdp_model, *t.optimizer, a.s.max_norm);
    lrs.push_back(t.scheduler->step());
    // Consumes the RNG every step, so a wrongly restored generator shows.
    probes.push_back(torch::rand({1}).item<double>());
    torch::Tensor sum = loss.detach().reshape({1});
    t.world->group().all_reduce(sum);
    losses.push_back(sum.item<double>() / t.world->size());
    if (save_at.count(step + 1)) {
      saving = step + 1;
      checkpoint::save(a.root, step + 1, fsdp_model, *t.optimizer, t.scheduler.get(),
                       {{"config", t.model->config().to_json()}}, save_options);
    }
  }
  auto full = fsdp_model.full_parameters();
  if (rank == 0) {
    testing::write_params(full, a.out);
    std::ofstream(a.out + "/losses.json")
        << json{{"start", start}, {"loss", losses}, {"lr", lrs}, {"rng", probes}}.dump();
  }
  t.world->group().barrier();
  return 0;
}

int load_only(const Args& a) {
  Trainer t(a);
  auto fsdp_model = t.model.fsdp();
  const std::string dir =
      a.load_dir.empty() ? checkpoint::find_latest(a.root).value_or("") : a.load_dir;
  if (dir.empty()) throw std::runtime_error("no checkpoint under " + a.root);
  auto loaded = checkpoint::load(dir, fsdp_model, t.optimizer.get(), t.scheduler.get());
  if (t.world->rank() == 0) {
    std::cout << "loaded " << dir << " step " << loaded.step << " saved at "
              << loaded.saved_world_size << " ranks" << std::endl;
  }
  return 0;
}

int sync(const Args& a) {
  Trainer t(a);
  auto fsdp_model = t.model.fsdp();
  checkpoint::load(a.load_dir, fsdp_model, t.optimizer.get(), t.scheduler.get());
  const auto dtype = fsdp::parse_dtype(a.export_dtype, "--dtype");
  std::vector<torch::Tensor> before;
  for (const auto& p : fsdp_model.sharded_parameters()) before.push_back(p.shard.detach().clone());
  const auto expected = fsdp_model.full_parameters();
  int64_t count = 0;
  checkpoint::for_each_full_parameter(
      fsdp_model, dtype, "transformer.", [&](const std::string& name, const torch::Tensor& full) {
        const auto& want = expected.at(name.substr(std::string("transformer.").size()));
        if (full.scalar_type() != dtype || !torch::equal(full, want.to(dtype))) {
          throw std::runtime_error("for_each_full_parameter: " + name + " differs");
        }
        // At most the tensor being yielded is unsharded.
        if (fsdp_model.memory().unsharded_param_bytes != 0) {
          throw std::runtime_error("for_each_full_parameter: unsharded params allocated");
        }
        ++count;
      });
  const auto after = fsdp_model.sharded_parameters();
  for (size_t i = 0; i < after.size(); ++i) {
    if (!torch::equal(after[i].shard.detach(), before[i])) {
      throw std::runtime_error("for_each_full_parameter changed shard " + after[i].name);
    }
  }
  if (count != static_cast<int64_t>(expected.size())) {
    throw std::runtime_error("for_each_full_parameter yielded " + std::to_string(count) + " of " +
                             std::to_string(expected.size()) + " tensors");
  }
  if (t.world->rank() == 0) std::cout << "synced " << count << " tensors" << std::endl;
  return 0;
}

int init_from_hf(const Args& a) {
  Trainer t(a);
  auto fsdp_model = t.model.fsdp();
  if (a.empty_init) {
    const size_t params = t.model->parameters().size();
    if (fsdp_model.awaiting_load().size() != params) {
      throw std::runtime_error("EmptyInit: " + std::to_string(fsdp_model.awaiting_load().size()) +
                               " of " + std::to_string(params) + " params await a load");
    }
    try {
      t.model(torch::zeros({1, 4}, torch::kLong));
      throw std::logic_error("a forward before the load ran");
    } catch (const c10::Error& e) {
      if (std::string(e.what()).find("fsdp::EmptyInit") == std::string::npos) throw;
    }
  }
  if (a.from_rank0) {
    checkpoint::load_hf_from_rank0(a.hf_dir, fsdp_model);
  } else {
    checkpoint::load_hf(a.hf_dir, fsdp_model);
  }
  if (!fsdp_model.awaiting_load().empty()) {
    throw std::runtime_error("still awaiting a load: " + fsdp_model.awaiting_load().front());
  }
  auto full = fsdp_model.full_parameters();
  if (t.world->rank() == 0) testing::write_params(full, a.out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL checkpoint test worker"};
  Args a;
  a.s.steps = 0;  // unused: end_step bounds training
  auto common = [&](CLI::App* cmd) {
    cmd->add_option("--root", a.root, "Checkpoint root");
    cmd->add_option("--load", a.load_dir, "Checkpoint directory to start from");
    cmd->add_option("--out", a.out);
    cmd->add_option("--layers", a.s.layers);
    cmd->add_option("--lr", a.s.lr);
    cmd->add_option("--seed", a.s.seed);
    cmd->add_option("--fsdp-size", a.fsdp_size);
    cmd->add_flag("--unused-params", a.s.unused_params);
  };
  auto* train_cmd = app.add_subcommand("train", "Train, resuming and saving as told");
  common(train_cmd);
  train_cmd->add_option("--end-step", a.end_step, "Train until this many steps are done");
  train_cmd->add_flag("--resume", a.resume, "Start from the latest checkpoint under --root");
  train_cmd->add_option("--save-at", a.save_at, "Save after these steps");
  train_cmd->add_option("--keep", a.keep, "max_ckpt_to_keep");
  train_cmd->add_option("--max-mem-gb", a.max_mem_gb);
  train_cmd->add_option("--die-rank", a.die_rank, "Rank that SIGKILLs itself during a save");
  train_cmd->add_option("--die-save-step", a.die_save_step, "The save it dies in");
  train_cmd->add_option("--die-after-bytes", a.die_after_bytes, "After writing this many bytes");
  auto* load_cmd = app.add_subcommand("load", "Load a checkpoint and report its step");
  common(load_cmd);
  auto* sync_cmd = app.add_subcommand("sync", "Check for_each_full_parameter on a checkpoint");
  common(sync_cmd);
  sync_cmd->add_option("--dtype", a.export_dtype);
  auto* init_cmd = app.add_subcommand("init", "Initialise the shards from HF-style safetensors");
  common(init_cmd);
  init_cmd->add_option("--hf", a.hf_dir)->required();
  init_cmd->add_flag("--from-rank0", a.from_rank0, "Only rank 0 reads; the others get their rows");
  init_cmd->add_flag("--empty-init", a.empty_init, "Build the model under fsdp::EmptyInit");
  app.require_subcommand(1);
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand(train_cmd)) return train(a);
    if (app.got_subcommand(load_cmd)) return load_only(a);
    if (app.got_subcommand(init_cmd)) return init_from_hf(a);
    return sync(a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
