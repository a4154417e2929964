// Rollout benchmark: batched sampling with the KV cache on a Hugging Face-layout model directory
// (e.g. `shardrl import` of SmolLM2), the rollout of the lm_grpo task, on given prompt token ids.
//
//   build/bin/bench_rollout --model runs/smollm2/model --prompts prompts.json --new-tokens 64
//
// prompts.json is [[ids...], ...], one row per prompt, left-padded here with --pad-id. Every row
// generates exactly --new-tokens tokens (no eos), so the count is the same for any baseline that
// does the same (bench/rollout_baseline.py runs transformers' generate on the same prompts and
// then this program). Prints one JSON object: the median of --repeats timed runs after a warm-up.
// Threads: torch's intra-op threads, --threads.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>

#include "shardrl/models/llama.h"
#include "shardrl/models/sampling.h"

using namespace shardrl;
using nlohmann::json;

int main(int argc, char** argv) {
  CLI::App app{"Batched KV-cache rollout throughput"};
  std::string model_dir, prompts_path;
  int64_t new_tokens = 64, pad_id = 0, repeats = 3;
  int threads = 1;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  app.add_option("--prompts", prompts_path, "JSON [[token ids], ...]")->required();
  app.add_option("--new-tokens", new_tokens, "Tokens generated per row");
  app.add_option("--pad-id", pad_id, "Left-padding token id");
  app.add_option("--repeats", repeats, "Timed runs (after one warm-up)");
  app.add_option("--threads", threads, "torch intra-op threads");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);

  std::ifstream in(prompts_path);
  const auto rows = json::parse(in).get<std::vector<std::vector<int64_t>>>();
  size_t width = 0;
  for (const auto& r : rows) width = std::max(width, r.size());
  const auto B = static_cast<int64_t>(rows.size()), P = static_cast<int64_t>(width);
  auto prompts = torch::full({B, P}, pad_id, torch::kLong);
  auto mask = torch::zeros({B, P}, torch::kLong);
  for (int64_t i = 0; i < B; ++i) {
    const auto len = static_cast<int64_t>(rows[i].size());
    prompts[i].narrow(0, P - len, len).copy_(torch::tensor(rows[i], torch::kLong));
    mask[i].narrow(0, P - len, len).fill_(1);
  }
  auto model = models::load_llama(model_dir);
  model->eval();
  models::SamplingOptions options;
  options.max_new_tokens = new_tokens;
  options.temperature = 1.0;
  options.eos_token_id = -1;  // every row generates new_tokens tokens
  std::vector<double> seconds;
  for (int64_t r = 0; r <= repeats; ++r) {
    options.generator = at::make_generator<at::CPUGeneratorImpl>(r);
    const auto start = std::chrono::steady_clock::now();
    const auto rollout = models::sample(model, prompts, options, mask);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rollout.responses.size(1) != new_tokens) throw std::runtime_error("short rollout");
    if (r > 0) seconds.push_back(s);  // run 0 warms up the allocator and the kernels
  }
  auto sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::cout
      << json{{"impl", "shardrl"},  {"batch", B},
              {"prompt_width", P},  {"new_tokens", new_tokens},
              {"threads", threads}, {"seconds", seconds},
              {"median_s", median}, {"tokens_per_s", static_cast<double>(B * new_tokens) / median}}
             .dump()
      << std::endl;
  return 0;
}
