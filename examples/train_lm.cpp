// The first demo: a byte-level language model trained with FSDP on real English text (the
// licence texts every Debian system ships), then sampled. Start it on N ranks:
//   shardrl launch -n 2 -- build/bin/train_lm
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/lr_schedule.h"
#include "shardrl/models/transformer.h"
#include "shardrl/optim.h"

using namespace shardrl;

namespace {

torch::Tensor read_corpus(const std::string& path) {
  std::vector<std::string> files;
  if (std::filesystem::is_directory(path)) {
    for (const auto& entry : std::filesystem::directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("--corpus: cannot read '{}'", f));
    std::stringstream ss;
    ss << in.rdbuf();
    text += ss.str();
  }
  if (text.size() < 4096)
    throw std::runtime_error(fmt::format("--corpus '{}' holds too little text", path));
  auto bytes = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes.to(torch::kLong);
}

std::string decode(const torch::Tensor& tokens) {
  std::string s;
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    const char c = static_cast<char>(tokens[i].item<int64_t>());
    s += (c == '\n' || (c >= 32 && c < 127)) ? c : '?';
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Byte-level LM pretraining with ShardRL FSDP"};
  std::string corpus = "/usr/share/common-licenses", param_dtype = "fp32";
  int64_t steps = 200, batch = 32, seq = 64, d_model = 128, layers = 4, sample_len = 160;
  double lr = 3e-3, clip_grad = 1.0;
  uint64_t seed = 0;
  app.add_option("--corpus", corpus, "Text file or directory of text files");
  app.add_option("--steps", steps);
  app.add_option("--batch", batch, "Global batch (sequences per step)");
  app.add_option("--seq", seq);
  app.add_option("--d-model", d_model);
  app.add_option("--layers", layers);
  app.add_option("--lr", lr);
  app.add_option("--clip-grad", clip_grad);
  app.add_option("--param-dtype", param_dtype, "mixed_precision.param_dtype: fp32 or bf16");
  app.add_option("--sample-len", sample_len);
  app.add_option("--seed", seed);
  CLI11_PARSE(app, argc, argv);

  try {
    auto world = dist::World::init_from_env();
    auto mesh = dist::DeviceMesh::create(*world);
    const bool lead = world->rank() == 0;
    auto data = read_corpus(corpus);

    models::TransformerConfig config;
    config.vocab_size = 256;
    config.max_seq_len = seq;
    config.d_model = d_model;
    config.n_layers = layers;
    torch::manual_seed(seed);  // every rank builds the same initial weights, then keeps its shard
    models::Transformer model(config);
    fsdp::Options options;
    options.mixed_precision.param_dtype =
        fsdp::parse_dtype(param_dtype, "mixed_precision.param_dtype");
    options.mixed_precision.output_dtype = torch::kFloat;
    models::shard_transformer(model, mesh, options);
    auto sharded = model.fsdp();

    optim::AdamWConfig adam;
    adam.lr = lr;
    adam.weight_decay = 0.1;
    auto optimizer = optim::make_adamw(optim::from_sharded(sharded.sharded_parameters()), adam);
    optim::LRScheduleConfig schedule;
    schedule.warmup_style = "cosine";
    schedule.lr_warmup_steps_ratio = 0.1;
    schedule.total_training_steps = steps;
    schedule.min_lr_ratio = 0.1;
    optim::LRScheduler scheduler(*optimizer, schedule);

    if (lead) {
      std::cout << fmt::format(
                       "train_lm: {} params, {} ranks, corpus {} ({} bytes), batch {}x{} tokens\n",
                       config.parameter_count(), world->size(), corpus, data.numel(), batch, seq)
                << std::flush;
    }
    const int64_t local = batch / mesh.data_parallel_size();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
    for (int64_t step = 0; step < steps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      // Same global batch everywhere (same seed); each rank trains on its slice.
      auto starts = torch::randint(data.numel() - seq, {batch}, gen, torch::kLong);
      auto mine = starts.narrow(0, mesh.data_parallel_rank() * local, local);
      std::vector<torch::Tensor> rows;
      for (int64_t i = 0; i < local; ++i)
        rows.push_back(data.narrow(0, mine[i].item<int64_t>(), seq));
      auto tokens = torch::stack(rows);
      sharded.zero_grad();
      auto loss = models::next_token_loss(model(tokens), tokens);
      loss.backward();
      auto result = optim::clip_and_step(sharded, *optimizer, clip_grad);
      const double lr_now = scheduler.current_lr();
      scheduler.step();
      auto mean_loss = loss.detach().reshape({1}).clone();
      world->group().all_reduce(mean_loss);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (lead && (step % 10 == 0 || step == steps - 1)) {
        auto mem = sharded.memory();
        std::cout << fmt::format(
                         "step {:4d}/{}  loss {:.4f}  grad_norm {:.3f}  lr {:.2e}  {:.0f} tok/s  "
                         "shard state {:.1f} MB/rank\n",
                         step + 1, steps, mean_loss.item<double>() / world->size(),
                         result.grad_norm, lr_now, batch * seq / seconds,
                         (mem.sharded_param_bytes + mem.sharded_grad_bytes +
                          optim::optimizer_state_bytes(*optimizer)) /
                             1e6)
                  << std::flush;
      }
    }

    // Sampling runs on every rank: each forward all-gathers the units, so all ranks take part.
    torch::NoGradGuard no_grad;
    const std::string prompt = "This License";
    auto context = torch::empty({static_cast<int64_t>(prompt.size())}, torch::kLong);
    for (size_t i = 0; i < prompt.size(); ++i) context[i] = static_cast<unsigned char>(prompt[i]);
    auto sample_gen = at::make_generator<at::CPUGeneratorImpl>(seed + 2);
    for (int64_t i = 0; i < sample_len; ++i) {
      auto window = context.narrow(0, std::max<int64_t>(0, context.numel() - seq),
                                   std::min(seq, context.numel()));
      auto logits = model(window.unsqueeze(0)).select(1, -1).squeeze(0) / 0.8;
      auto next = torch::multinomial(torch::softmax(logits, -1), 1, false, sample_gen);
      context = torch::cat({context, next});
    }
    if (lead) std::cout << "sample:\n" << decode(context) << "\n" << std::flush;
    world->group().barrier();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "train_lm: " << e.what() << std::endl;
    return 1;
  }
}
