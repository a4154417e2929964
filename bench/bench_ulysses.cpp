// Ulysses sequence parallelism at a long sequence: one GRPO update step (the policy loss on the
// response log-probs, as lm_grpo trains) of the LLaMA decoder through the Engine, with every
// data-parallel rank holding one sequence of --length tokens. Run it under `shardrl launch -n 2`
// with --sp 1 (two ranks, a sequence each) and --sp 2 (two ranks splitting one sequence):
//   - activation memory per rank: the peak resident set during a step above the resident set
//     before it (VmHWM, reset before each step);
//   - step time (median);
//   - the bytes each rank sends in its Ulysses group per step, against what the shapes give.
// Timing is a benchmark, never a test: it depends on the machine being quiet.
#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>

#include "rss.h"
#include "shardrl/algos.h"
#include "shardrl/engine.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/sampling.h"

using namespace shardrl;
using namespace shardrl::bench;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

struct Args {
  int sp = 1;
  int64_t length = 2048, prompt = 64, hidden = 256, intermediate = 688, layers = 4, heads = 8,
          kv_heads = 2, vocab = 8192;
  int steps = 3, warmup = 1;
  std::string json_out;
};

// What one rank sends in its Ulysses group per update step, from the shapes alone: per layer, the
// forward's exchanges of q, k, v (key/value heads repeated up to sp when fewer) and of the
// attention output, each (sp - 1) / sp of a slice [local tokens, heads, head_dim] in fp32, and the
// same again in the backward; then the forward's all-gather of the slice's log-probs.
uint64_t expected_exchange_bytes(const Args& a) {
  if (a.sp == 1) return 0;
  const int64_t local = (a.length + a.sp - 1) / a.sp;
  const int64_t head_dim = a.hidden / a.heads;
  const int64_t kv = a.kv_heads % a.sp == 0 ? a.kv_heads : a.sp;
  const int64_t slice_elements = local * head_dim * (2 * a.heads + 2 * kv);
  const int64_t per_layer = 2 * slice_elements * 4 / a.sp * (a.sp - 1);
  return static_cast<uint64_t>(a.layers * per_layer + (a.sp - 1) * local * 4);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Ulysses sequence parallelism benchmark"};
  Args a;
  app.add_option("--sp", a.sp, "ulysses_sequence_parallel_size");
  app.add_option("--length", a.length, "tokens of each sequence");
  app.add_option("--prompt", a.prompt, "prompt tokens of each sequence (the rest is response)");
  app.add_option("--hidden", a.hidden);
  app.add_option("--intermediate", a.intermediate);
  app.add_option("--layers", a.layers);
  app.add_option("--heads", a.heads);
  app.add_option("--kv-heads", a.kv_heads);
  app.add_option("--vocab", a.vocab);
  app.add_option("--steps", a.steps, "measured steps");
  app.add_option("--warmup", a.warmup);
  app.add_option("--json-out", a.json_out);
  CLI11_PARSE(app, argc, argv);

  auto world = dist::World::init_from_env();
  engine::EngineConfig config;
  config.model_type = "language_model";
  config.model = {{"family", "llama"},
                  {"config",
                   {{"vocab_size", a.vocab},
                    {"hidden_size", a.hidden},
                    {"intermediate_size", a.intermediate},
                    {"num_hidden_layers", a.layers},
                    {"num_attention_heads", a.heads},
                    {"num_key_value_heads", a.kv_heads},
                    {"max_position_embeddings", a.length + 1},
                    {"tie_word_embeddings", true}}}};
  config.ulysses_sequence_parallel_size = a.sp;
  config.optim.lr = 1e-4;
  torch::manual_seed(0);
  auto engine = engine::EngineRegistry::create(config, world);
  const auto& group = engine->mesh().sequence_parallel_group();

  // One sequence of length + 1 tokens a data-parallel rank (the sp ranks of a group share it).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + engine->data_parallel_rank());
  const int64_t responses = a.length + 1 - a.prompt;
  engine::Batch batch{{"sequences", torch::randint(a.vocab, {1, a.length + 1}, gen)},
                      {"advantages", torch::randn({1, 1}, gen).expand({1, responses}).contiguous()},
                      {"old_log_probs", torch::full({1, responses}, -9.0)},
                      {"response_mask", torch::ones({1, responses})}};
  const engine::LossFn loss = [&a](engine::Engine& e, const engine::MicroBatch& mb) {
    const auto& d = mb.data;
    auto log_probs = models::response_log_probs(e.model<models::LlamaForCausalLM>(),
                                                d.at("sequences"), a.prompt, 1.0);
    auto out = algos::compute_policy_loss(d.at("old_log_probs"), log_probs, d.at("advantages"),
                                          d.at("response_mask"), algos::PolicyLossConfig{});
    return engine::LossOutput{out.pg_loss / mb.count, {}, {}};
  };

  std::vector<double> seconds, peaks;
  std::vector<uint64_t> exchanged;
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    const int64_t before = trimmed_rss();
    reset_peak_rss();
    const uint64_t sent_before = group ? group->bytes_sent() : 0;
    const auto t0 = Clock::now();
    engine->train_batch(batch, loss);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step < a.warmup) continue;
    seconds.push_back(s);
    peaks.push_back(static_cast<double>(proc_status_bytes("VmHWM") - before));
    exchanged.push_back((group ? group->bytes_sent() : 0) - sent_before);
  }
  // The largest peak over the ranks, and each rank's exchange: every rank should send the same.
  auto peak = torch::tensor({*std::max_element(peaks.begin(), peaks.end())}, torch::kDouble);
  world->group().all_reduce(peak, dist::ReduceOp::kMax);
  for (size_t i = 1; i < exchanged.size(); ++i) {
    TORCH_CHECK(exchanged[i] == exchanged[0], "the exchange changed between steps");
  }
  if (world->rank() == 0) {
    const auto expected = expected_exchange_bytes(a);
    json out = {{"bench", "ulysses"},
                {"world_size", world->size()},
                {"ulysses_sequence_parallel_size", a.sp},
                {"data_parallel_size", engine->data_parallel_size()},
                {"sequence_length", a.length},
                {"model",
                 {{"hidden", a.hidden},
                  {"intermediate", a.intermediate},
                  {"layers", a.layers},
                  {"heads", a.heads},
                  {"kv_heads", a.kv_heads},
                  {"vocab", a.vocab}}},
                {"step_seconds", seconds},
                {"median_step_seconds", median(seconds)},
                {"peak_activation_bytes_per_rank", peak.item<double>()},
                {"exchange_bytes_per_step", exchanged.front()},
                {"expected_exchange_bytes_per_step", expected},
                {"exchange_matches_theory", exchanged.front() == expected}};
    std::cout << out.dump(2) << "\n";
    if (!a.json_out.empty()) std::ofstream(a.json_out) << out.dump(2) << "\n";
  }
  return 0;
}
