// Task "lm_pretrain": next-token pretraining of a language model on a text corpus, byte-level.
// The supervised stage before GRPO, and the smallest complete use of the Engine.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "shardrl/models/llama.h"
#include "shardrl/models/transformer.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The table has checked that data.train_files exists.
torch::Tensor read_corpus(const std::string& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::directory_iterator(path))
      if (entry.is_regular_file()) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string text;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
  }
  if (text.size() < 1024) {
    throw std::invalid_argument(
        fmt::format("config key 'data.train_files': '{}' holds {} bytes of "
                    "text, too little to train on",
                    path, text.size()));
  }
  auto bytes = torch::from_blob(text.data(), {static_cast<int64_t>(text.size())}, torch::kUInt8);
  return bytes.to(torch::kLong);
}

}  // namespace

engine::LossOutput next_token_loss(engine::Engine& e, const engine::MicroBatch& mb) {
  const auto& tokens = mb.data.at("tokens");
  // The registered language-model family, whichever it is.
  auto logits = get<std::string>(e.config().model, "family") == "gpt"
                    ? e.model<models::Transformer>()(tokens)
                    : e.model<models::LlamaForCausalLM>()(tokens);
  return {models::next_token_loss(logits, tokens) / mb.count, {}, {}};
}

PlanInput lm_pretrain_plan(const json& config, const engine::Layout& layout) {
  PlanInput in{engine_config(config, "language_model", "actor"), {}};
  const int64_t dp = layout.world_size() / ulysses_sequence_parallel_size(config, "actor");
  const int64_t local = std::max<int64_t>(1, get<int64_t>(config, "data.train_batch_size") / dp);
  const int64_t micro = in.engine.micro_batch_size_per_gpu;
  in.workload.micro_batch_rows = micro > 0 ? std::min(micro, local) : local;
  in.workload.tokens_per_row = get<int64_t>(config, "data.max_seq_len");
  in.workload.gradient_checkpointing =
      get<bool>(config, "actor_rollout_ref.model.enable_gradient_checkpointing");
  in.workload.logits = true;
  return in;
}

int run_lm_pretrain(const json& config, std::shared_ptr<dist::World> world) {
  const auto corpus = read_corpus(get<std::string>(config, "data.train_files"));
  const auto seq = get<int64_t>(config, "data.max_seq_len");
  const auto global_batch = get<int64_t>(config, "data.train_batch_size");
  const auto seed = get<int64_t>(config, "trainer.seed");

  const auto& model = at(config, "actor_rollout_ref.model");
  if (model.value("family", json()) == "llama") {
    const auto path = get<std::string>(config, "actor_rollout_ref.model.path");
    // A pretrained folder brings its own config.json (the engine's builder reads it too).
    const auto c = !path.empty() && fs::exists(path + "/config.json")
                       ? models::LlamaConfig::load(path + "/config.json")
                       : models::LlamaConfig::from_json(model.at("config"));
    check_sequence_parallel_heads(config, "actor", c.num_attention_heads, c.num_key_value_heads);
  }
  torch::manual_seed(seed);  // identical initial weights on every rank
  auto engine =
      engine::EngineRegistry::create(engine_config(config, "language_model", "actor"), world);
  const int64_t dp = engine->data_parallel_size();
  if (global_batch % dp != 0) {
    throw std::invalid_argument(fmt::format(
        "config key 'data.train_batch_size' ({}) must divide by the {} data-parallel ranks",
        global_batch, dp));
  }
  const int64_t local = global_batch / dp;
  // Tokens trained a step, all ranks together, per second of the step.
  Run run(config, *world, {"perf/tokens_per_s", "tok/s"});
  for (int64_t step = run.resume(*engine) + 1; step <= run.total_steps(); ++step) {
    // Each step's windows depend on the seed and step only, so a resumed run sees the same data.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + step);
    auto starts = torch::randint(corpus.size(0) - seq, {global_batch}, gen);
    auto windows = torch::arange(seq).unsqueeze(0) + starts.unsqueeze(1);
    engine::Batch batch{{"tokens", corpus.index({windows})}};
    auto start = std::chrono::steady_clock::now();
    auto metrics = engine->train_batch(
        engine::slice_batch(batch, engine->data_parallel_rank() * local, local), next_token_loss);
    metrics["step_time"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    metrics["perf/tokens_per_s"] =
        static_cast<double>(global_batch * seq) / std::max(metrics["step_time"], 1e-9);
    run.after_step(*engine, step, metrics);
  }
  return 0;
}

Task lm_pretrain_task() {
  Task task;
  task.description = "next-token pretraining of a language model on a text corpus, byte-level";
  task.keys = {
      {"data.train_files", "/usr/share/common-licenses", text().existing_path().required(),
       "the text: a file, or a folder whose files are read in name order (each byte a token)"},
      {"data.train_batch_size", 32, integer().at_least(1),
       "sequences a step, all ranks together (divides by the data-parallel ranks)"},
      {"data.max_seq_len", 64, integer().at_least(1), "tokens a sequence"},
  };
  task.defaults = {
      {"actor_rollout_ref.model.family", "gpt"},
      {"actor_rollout_ref.model.config",
       {{"vocab_size", 256},
        {"max_seq_len", 64},
        {"d_model", 128},
        {"n_heads", 4},
        {"n_layers", 4}}},
      {"actor_rollout_ref.actor.optim.lr", 3e-3},
  };
  task.run = run_lm_pretrain;
  task.plan = lm_pretrain_plan;
  return task;
}

}  // namespace shardrl::trainer
