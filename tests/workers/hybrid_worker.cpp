// One rank of the hybrid-sharding test with two models in one process (test_hybrid.cpp): an
// actor engine and a forward-only reference engine, each on its own DeviceMesh of --fsdp-size.
// Each step the reference scores the batch and the actor trains on next-token loss plus a pull
// towards the reference's log-probs. Writes the actor's metrics and final params.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>

#include "shardrl/engine.h"
#include "shardrl/models/transformer.h"
#include "workers/param_files.h"

using namespace shardrl;

namespace {

engine::EngineConfig config(int fsdp_size, bool forward_only) {
  engine::EngineConfig c;
  c.model = {{"family", "gpt"},
             {"config",
              {{"vocab_size", 61},
               {"max_seq_len", 12},
               {"d_model", 32},
               {"n_heads", 4},
               {"n_layers", 2}}}};
  c.fsdp_size = fsdp_size;
  c.forward_only = forward_only;
  c.micro_batch_size_per_gpu = 2;
  c.optim.lr = 1e-2;
  return c;
}

torch::Tensor log_probs(engine::Engine& e, const engine::MicroBatch& mb) {
  return torch::log_softmax(e.model<models::Transformer>()(mb.data.at("tokens")), -1);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hybrid sharding test worker: actor + reference"};
  std::string out;
  int fsdp_size = -1;
  int64_t steps = 3, batch = 16;
  app.add_option("--out", out)->required();
  app.add_option("--fsdp-size", fsdp_size);
  app.add_option("--steps", steps);
  CLI11_PARSE(app, argc, argv);
  try {
    auto world = dist::World::init_from_env();
    // The same initial weights for both models and at every mesh shape.
    torch::manual_seed(0);
    auto actor = engine::EngineRegistry::create(config(fsdp_size, false), world);
    torch::manual_seed(0);
    auto ref = engine::EngineRegistry::create(config(fsdp_size, true), world);
    const int64_t local = batch / actor->data_parallel_size();
    const int64_t first = actor->data_parallel_rank() * local;
    std::ofstream metrics_out(out + "/metrics." + std::to_string(world->rank()) + ".jsonl");
    for (int64_t step = 0; step < steps; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + step);
      engine::Batch global{{"tokens", torch::randint(61, {batch, 12}, gen)}};
      auto data = engine::slice_batch(global, first, local);
      data["ref_log_probs"] =
          ref->infer_batch(
                 data,
                 [](engine::Engine& e, const engine::MicroBatch& mb) {
                   return engine::LossOutput{torch::zeros({}), {}, {{"lp", log_probs(e, mb)}}};
                 })
              .at("lp");
      auto metrics = actor->train_batch(data, [](engine::Engine& e, const engine::MicroBatch& mb) {
        const auto& tokens = mb.data.at("tokens");
        auto lp = log_probs(e, mb);
        auto nll = -lp.narrow(1, 0, tokens.size(1) - 1)
                        .gather(-1, tokens.narrow(1, 1, tokens.size(1) - 1).unsqueeze(-1))
                        .mean();
        auto pull = (lp - mb.data.at("ref_log_probs")).pow(2).mean();
        auto loss = nll + 0.5 * pull;
        return engine::LossOutput{loss / mb.count, {{"pull", pull.item<double>()}}, {}};
      });
      metrics_out << nlohmann::json(metrics).dump() << "\n" << std::flush;
    }
    auto params = actor->fsdp().full_parameters();
    auto ref_params = ref->fsdp().full_parameters();
    if (world->rank() == 0) {
      std::filesystem::create_directories(out + "/actor");
      std::filesystem::create_directories(out + "/ref");
      testing::write_params(params, out + "/actor");
      testing::write_params(ref_params, out + "/ref");
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
