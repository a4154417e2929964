// Rollout benchmark: batched sampling with the KV cache on a Hugging Face-layout model directory
// (e.g. `shardrl import` of SmolLM2), the rollout of the lm_grpo task, on given prompt token ids.
//
//   build/bin/bench_rollout --model runs/smollm2/model --prompts prompts.json --new-tokens 64
//
// prompts.json is [[ids...], ...], one row per prompt, left-padded here with --pad-id; each prompt
// is sampled --n times (GRPO's rollout.n: one prefill, n rows). Without --eos-id every row
// generates exactly --new-tokens tokens; with it a row ends at that token (the job's stop on
// <|im_end|>) and the count is the tokens up to and including it, as verl counts a response. The
// same prompts, counts and rules are what bench/rollout_baseline.py gives transformers' generate
// before running this program. --rollout-dtype float16 samples as lm_grpo's rollout.dtype does:
// the weights packed into fbgemm's fp16 GEMM (the packing time is reported once, as pack_s: the
// trainer packs after every weight sync of full fine-tuning), fp32 activations. --lora-rank R adds
// an unmerged rank-R adapter on every projection, in fp32 beside the packed base, as the LoRA job's
// rollout replica carries it. Prints one JSON object: the median of
// --repeats timed runs after a warm-up. Threads: torch's intra-op threads, --threads.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>

#include "shardrl/models/llama.h"
#include "shardrl/rollout/packed_linear.h"
#include "shardrl/rollout/sampling.h"

using namespace shardrl;
using nlohmann::json;

int main(int argc, char** argv) {
  CLI::App app{"Batched KV-cache rollout throughput"};
  std::string model_dir, prompts_path;
  int64_t new_tokens = 64, pad_id = 0, repeats = 3, n = 1, eos_id = -1, lora_rank = 0;
  double temperature = 1.0;
  int threads = 1;
  std::string rollout_dtype = "float32";
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  app.add_option("--prompts", prompts_path, "JSON [[token ids], ...]")->required();
  app.add_option("--new-tokens", new_tokens, "Tokens generated per row");
  app.add_option("--pad-id", pad_id, "Left-padding token id");
  app.add_option("--repeats", repeats, "Timed runs (after one warm-up)");
  app.add_option("--threads", threads, "torch intra-op threads");
  app.add_option("--n", n, "Rows sampled per prompt (num_return_sequences)");
  app.add_option("--eos-id", eos_id, "A row ends at this token (-1: never)");
  app.add_option("--temperature", temperature, "Sampling temperature");
  app.add_option("--rollout-dtype", rollout_dtype, "Rollout weights")
      ->check(CLI::IsMember({"float32", "float16"}));
  app.add_option("--lora-rank", lora_rank,
                 "Unmerged LoRA adapter rank on every projection (0: none)");
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
  if (lora_rank > 0) {
    models::lora::LoraConfig lora;
    lora.r = lora_rank;
    lora.alpha = 2.0 * static_cast<double>(lora_rank);
    lora.target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                           "gate_proj", "up_proj", "down_proj"};
    models::lora::apply_lora(*model, lora, "default", /*trainable=*/false);
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (models::lora::is_lora_b_tensor(item.key())) item.value().normal_(0, 1e-3);  // trained B
    }
  }
  double pack_seconds = 0;
  if (rollout_dtype == "float16") {
    const auto start = std::chrono::steady_clock::now();
    rollout::pack_for_inference(*model, torch::kHalf);
    pack_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  rollout::SamplingOptions options;
  options.max_new_tokens = new_tokens;
  options.temperature = temperature;
  options.eos_token_id = eos_id;
  options.num_return_sequences = n;
  std::vector<double> seconds, tokens;
  for (int64_t r = 0; r <= repeats; ++r) {
    options.generator = at::make_generator<at::CPUGeneratorImpl>(r);
    const auto start = std::chrono::steady_clock::now();
    const auto rollout = rollout::sample(model, prompts, options, mask);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (eos_id < 0 && rollout.responses.size(1) != new_tokens) {
      throw std::runtime_error("short rollout");
    }
    if (r > 0) {  // run 0 warms up the allocator and the kernels
      seconds.push_back(s);
      tokens.push_back(rollout.response_mask.sum().item<double>());
    }
  }
  std::vector<double> rates;
  for (size_t i = 0; i < seconds.size(); ++i) rates.push_back(tokens[i] / seconds[i]);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::cout << json{{"impl", "shardrl"},
                    {"batch", B * n},
                    {"n", n},
                    {"rollout_dtype", rollout_dtype},
                    {"lora_rank", lora_rank},
                    {"prompt_width", P},
                    {"new_tokens", new_tokens},
                    {"eos_id", eos_id},
                    {"temperature", temperature},
                    {"pack_s", pack_seconds},
                    {"tokens", tokens},
                    {"threads", threads},
                    {"seconds", seconds},
                    {"median_s", median(seconds)},
                    {"tokens_per_s", median(rates)}}
                   .dump()
            << std::endl;
  return 0;
}
