// Text encoder benchmark: all-MiniLM-L6-v2 (a sentence-transformers folder) encoding one batch of
// prompts, tokenizer included, as the diffusion trainer conditions on them.
//
//   build/bin/bench_text_encoder --model DIR --prompts prompts.json --threads 1
//
// prompts.json is ["a photo of a sneaker", ...]. Prints one JSON object: the median seconds of
// --repeats timed encodes after a warm-up, and of the tokenizer alone
// (bench/text_encoder_baseline.py runs sentence-transformers' encode on the same prompts and then
// this program).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>

#include "shardrl/models/text_encoder.h"

using namespace shardrl;
using nlohmann::json;

namespace {

template <class F>
double median_seconds(int64_t repeats, F&& run) {
  std::vector<double> seconds;
  for (int64_t r = 0; r <= repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (r > 0) seconds.push_back(took.count());  // the first run warms up
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Text encoder (MiniLM) latency for one batch of prompts"};
  std::string model_dir, prompts_path;
  int64_t repeats = 20;
  int threads = 1;
  app.add_option("--model", model_dir, "sentence-transformers model folder")->required();
  app.add_option("--prompts", prompts_path, "JSON list of prompts")->required();
  app.add_option("--repeats", repeats, "Timed runs (after one warm-up)");
  app.add_option("--threads", threads, "torch intra-op threads");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);

  std::ifstream in(prompts_path);
  const auto prompts = json::parse(in).get<std::vector<std::string>>();
  const auto load_start = std::chrono::steady_clock::now();
  const auto encoder = models::TextEncoder::load(model_dir);
  const std::chrono::duration<double> load = std::chrono::steady_clock::now() - load_start;
  const double encode = median_seconds(repeats, [&] { encoder.encode(prompts); });
  const double tokenize = median_seconds(
      repeats, [&] { encoder.tokenizer().encode_batch(prompts, encoder.max_seq_length()); });
  std::cout << json{{"batch", prompts.size()},
                    {"threads", threads},
                    {"load_s", load.count()},
                    {"encode_s", encode},
                    {"tokenize_s", tokenize}}
                   .dump()
            << "\n";
  return 0;
}
