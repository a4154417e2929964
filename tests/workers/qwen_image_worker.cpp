// One rank of the Qwen-Image training tests (tests/test_qwen_image.cpp): an Engine of model_type
// diffusion_model, whose registry builds the Qwen-Image transformer from the config's _class_name,
// trains the scenario of qwen_image_scenario.h with a flow-matching loss on its data-parallel share
// of the global batch (every layout sees the same global batch). --sp splits each sample's tokens
// over a Ulysses group, --checkpointing recomputes each block's activations in backward,
// --lora-rank trains an adapter on verl-omni's 12 target modules only, --save writes the
// engine's checkpoint (family "qwen_image", as a trainer's) after the last step.
// OUT/metrics.txt: "loss grad_norm" a step; OUT/final: the gathered params.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "shardrl/engine.h"
#include "workers/param_files.h"
#include "workers/qwen_image_scenario.h"

using namespace shardrl;

namespace {

struct Args {
  std::string out, save_root;
  int sp = 1;
  int64_t micro_batch = 2, lora_rank = 0;
  bool checkpointing = false;
};

int train(const testing::QwenImageScenario& s, const Args& a) {
  auto world = dist::World::init_from_env();
  engine::EngineConfig config;
  config.model_type = "diffusion_model";
  config.model = {{"config", testing::qwen_image_test_config().to_json()},
                  {"lora_rank", a.lora_rank},
                  {"lora_alpha", 2 * a.lora_rank},
                  {"enable_gradient_checkpointing", a.checkpointing}};
  config.ulysses_sequence_parallel_size = a.sp;
  config.micro_batch_size_per_gpu = a.micro_batch;
  config.optim.lr = s.lr;
  config.optim.weight_decay = 0.0;
  config.optim.clip_grad = 0.0;
  torch::manual_seed(s.seed);  // the same initial weights in every layout
  auto engine = engine::EngineRegistry::create(config, world);
  const auto shapes = testing::qwen_image_test_shapes(s);
  const engine::LossFn loss = [&shapes](engine::Engine& e, const engine::MicroBatch& mb) {
    const auto& d = mb.data;
    auto v = e.model<models::QwenImageTransformer2DModel>()(
        d.at("xt"), d.at("prompt_embeds"), d.at("prompt_mask"), d.at("timestep"), shapes);
    return engine::LossOutput{torch::mse_loss(v, d.at("target")) / mb.count, {}, {}};
  };
  const int64_t dp = engine->data_parallel_size(), dp_rank = engine->data_parallel_rank();
  std::ofstream metrics_out;
  if (world->rank() == 0) {
    std::filesystem::create_directories(a.out);
    metrics_out.open(a.out + "/metrics.txt");
  }
  for (int64_t step = 0; step < s.steps; ++step) {
    const auto b = testing::qwen_image_batch(s, step);
    const engine::Batch global = {{"xt", b.xt},
                                  {"prompt_embeds", b.prompt_embeds},
                                  {"prompt_mask", b.prompt_mask},
                                  {"timestep", b.timestep},
                                  {"target", b.target}};
    const auto mine = engine::slice_batch(global, dp_rank * (s.batch / dp), s.batch / dp);
    const auto metrics = engine->train_batch(mine, loss);
    if (world->rank() == 0) {
      metrics_out << fmt::format("{:.9e} {:.9e}\n", metrics.at("loss"), metrics.at("grad_norm"))
                  << std::flush;
    }
  }
  if (!a.save_root.empty()) engine->save_checkpoint(a.save_root, s.steps);
  const auto params = engine->fsdp().full_parameters();
  if (world->rank() == 0) {
    std::filesystem::create_directories(a.out + "/final");
    testing::write_params(params, a.out + "/final");
  }
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL Qwen-Image multi-rank test worker"};
  testing::QwenImageScenario s;
  Args a;
  app.add_option("--out", a.out)->required();
  app.add_option("--steps", s.steps);
  app.add_option("--lr", s.lr);
  app.add_option("--sp", a.sp, "ulysses_sequence_parallel_size");
  app.add_option("--micro-batch", a.micro_batch, "rows a micro-batch");
  app.add_option("--lora-rank", a.lora_rank, "train a LoRA adapter of this rank only");
  app.add_flag("--checkpointing", a.checkpointing, "activation checkpointing per block");
  app.add_option("--save", a.save_root, "checkpoint root to save the trained engine under");
  CLI11_PARSE(app, argc, argv);
  try {
    return train(s, a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
