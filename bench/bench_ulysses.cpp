// Ulysses sequence parallelism at a long sequence: one update step through the Engine, with every
// data-parallel rank holding one sample. Run it under `shardrl launch -n 2` with --sp 1 (two ranks,
// a sample each) and --sp 2 (two ranks splitting one sample):
//   --model llama  the LLaMA decoder, one GRPO step (the policy loss on the response log-probs, as
//                  lm_grpo trains) on a sequence of --length tokens;
//   --model sd3    the SD3 MMDiT, one flow-matching step on a --image x --image latent of 16
//                  channels (2 x 2 patches: (image / 2)^2 image tokens) and --text text tokens.
// It reports
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
#include "shardrl/models/sd3.h"
#include "shardrl/rollout/sampling.h"
#include "stats.h"

using namespace shardrl;
using namespace shardrl::bench;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

struct Args {
  std::string model = "llama";
  int sp = 1;
  int64_t length = 2048, prompt = 64, hidden = 256, intermediate = 688, layers = 4, heads = 8,
          kv_heads = 2, vocab = 8192, image = 128, text = 77;
  int steps = 3, warmup = 1;
  std::string json_out;
};

// One rank's slice of `length` positions split over sp ranks.
int64_t local_length(int64_t length, int sp) {
  return (length + sp - 1) / sp;
}

// What one rank sends in its Ulysses group per update step, from the shapes alone: per layer, the
// forward's exchanges of q, k, v (key/value heads repeated up to sp when fewer) and of the
// attention output, each (sp - 1) / sp of a slice [local tokens, heads, head_dim] in fp32, and the
// same again in the backward; then the forward's all-gather of the slice's log-probs.
uint64_t expected_llama_exchange_bytes(const Args& a) {
  if (a.sp == 1) return 0;
  const int64_t local = local_length(a.length, a.sp);
  const int64_t head_dim = a.hidden / a.heads;
  const int64_t kv = a.kv_heads % a.sp == 0 ? a.kv_heads : a.sp;
  const int64_t slice_elements = local * head_dim * (2 * a.heads + 2 * kv);
  const int64_t per_layer = 2 * slice_elements * 4 / a.sp * (a.sp - 1);
  return static_cast<uint64_t>(a.layers * per_layer + (a.sp - 1) * local * 4);
}

// The same for the MMDiT: per block, the forward exchanges q, k, v and the attention output over
// the rank's image and text slices ([tokens, hidden] fp32 each; the last block has no text
// queries, so its q and output cover the image slice only), (sp - 1) / sp of each, the backward as
// much again; then the forward all-gathers the slice's output patches (2 x 2 x 16 values a token).
uint64_t expected_sd3_exchange_bytes(const Args& a) {
  if (a.sp == 1) return 0;
  const int64_t image = local_length((a.image / 2) * (a.image / 2), a.sp);
  const int64_t joint = image + local_length(a.text, a.sp);
  int64_t elements = 0;
  for (int64_t block = 0; block < a.layers; ++block) {
    const int64_t queries = block + 1 == a.layers ? image : joint;
    elements += 2 * a.hidden * (2 * queries + 2 * joint);
  }
  return static_cast<uint64_t>(elements * 4 / a.sp * (a.sp - 1) + (a.sp - 1) * image * 64 * 4);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Ulysses sequence parallelism benchmark"};
  Args a;
  app.add_option("--model", a.model, "llama or sd3");
  app.add_option("--sp", a.sp, "ulysses_sequence_parallel_size");
  app.add_option("--image", a.image, "latent side (sd3)");
  app.add_option("--text", a.text, "text tokens (sd3)");
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
  if (a.model == "sd3") {
    config.model_type = "diffusion_model";
    config.model = {{"config",
                     {{"sample_size", a.image},
                      {"patch_size", 2},
                      {"in_channels", 16},
                      {"out_channels", 16},
                      {"num_layers", a.layers},
                      {"attention_head_dim", a.hidden / a.heads},
                      {"num_attention_heads", a.heads},
                      {"joint_attention_dim", a.hidden},
                      {"caption_projection_dim", a.hidden},
                      {"pooled_projection_dim", a.hidden},
                      {"pos_embed_max_size", a.image / 2}}}};
  } else {
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
  }
  config.ulysses_sequence_parallel_size = a.sp;
  config.optim.lr = 1e-4;
  torch::manual_seed(0);
  auto engine = engine::EngineRegistry::create(config, world);
  const auto& group = engine->mesh().sequence_parallel_group();

  // One sample a data-parallel rank (the sp ranks of a group share it).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + engine->data_parallel_rank());
  engine::Batch batch;
  engine::LossFn loss;
  if (a.model == "sd3") {
    batch = {{"latents", torch::randn({1, 16, a.image, a.image}, gen)},
             {"noise", torch::randn({1, 16, a.image, a.image}, gen)},
             {"prompt_embeds", torch::randn({1, a.text, a.hidden}, gen)},
             {"pooled", torch::randn({1, a.hidden}, gen)},
             {"sigma", torch::rand({1}, gen)}};
    loss = [](engine::Engine& e, const engine::MicroBatch& mb) {
      const auto& d = mb.data;
      const auto sigma = d.at("sigma").view({-1, 1, 1, 1});
      const auto noisy = (1 - sigma) * d.at("latents") + sigma * d.at("noise");
      auto velocity = e.model<models::SD3Transformer2DModel>()(
          noisy, d.at("prompt_embeds"), d.at("pooled"), d.at("sigma") * 1000);
      auto target = d.at("noise") - d.at("latents");
      return engine::LossOutput{(velocity - target).square().mean() / mb.count, {}, {}};
    };
  } else {
    const int64_t responses = a.length + 1 - a.prompt;
    batch = {{"sequences", torch::randint(a.vocab, {1, a.length + 1}, gen)},
             {"advantages", torch::randn({1, 1}, gen).expand({1, responses}).contiguous()},
             {"old_log_probs", torch::full({1, responses}, -9.0)},
             {"response_mask", torch::ones({1, responses})}};
    loss = [&a](engine::Engine& e, const engine::MicroBatch& mb) {
      const auto& d = mb.data;
      auto log_probs = rollout::response_log_probs(e.model<models::LlamaForCausalLM>(),
                                                   d.at("sequences"), a.prompt, 1.0);
      auto out = algos::compute_policy_loss(d.at("old_log_probs"), log_probs, d.at("advantages"),
                                            d.at("response_mask"), algos::PolicyLossConfig{});
      return engine::LossOutput{out.pg_loss / mb.count, {}, {}};
    };
  }

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
    const auto expected =
        a.model == "sd3" ? expected_sd3_exchange_bytes(a) : expected_llama_exchange_bytes(a);
    json out = {
        {"bench", "ulysses"},
        {"model_family", a.model},
        {"world_size", world->size()},
        {"ulysses_sequence_parallel_size", a.sp},
        {"data_parallel_size", engine->data_parallel_size()},
        {"sequence_length", a.model == "sd3" ? (a.image / 2) * (a.image / 2) + a.text : a.length},
        {"model", a.model == "sd3" ? json{{"hidden", a.hidden},
                                          {"layers", a.layers},
                                          {"heads", a.heads},
                                          {"image", a.image},
                                          {"text", a.text}}
                                   : json{{"hidden", a.hidden},
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
