// The decoder's attention at long sequences: time and activation memory of a training step
// (forward and backward) through a stack of LlamaAttention layers (x = x + attention(x), causal,
// GQA), one rank, for
//   --attention sdpa    LlamaAttention::forward: at::scaled_dot_product_attention (the CPU's flash
//                       kernel keeps a log-sum-exp per query for backward, no [T, T] scores);
//   --attention matmul  the decoder's attention before it, reproduced here on the same modules'
//                       weights: scores q k^T / sqrt(head_dim) as [heads, T, T], the future masked,
//                       softmax, then the values; autograd keeps the [heads, T, T] probabilities of
//                       every layer for backward.
//   --sequences K       the T tokens are K packed sequences (verl's use_remove_padding), each
//                       query seeing its own sequence only, positions restarting in each: sdpa
//                       runs one causal call per sequence (LlamaAttention with
//                       AttentionMask::sequence_lengths), --attention block-mask one call over
//                       all T tokens with a block-diagonal causal mask [T, T].
// Both give the same output and input gradient (checked at a short length before timing). Run each
// way in its own process so that one's allocations do not hide the other's peak:
//   bench_attention --attention sdpa --length 4096 --json-out sdpa_4096.json
// Activation memory: the peak resident set during a step above the resident set before it (VmHWM
// reset before each step). Timing is a benchmark, never a test: it depends on a quiet machine.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>

#include "rss.h"
#include "shardrl/models/llama.h"
#include "stats.h"

using namespace shardrl;
using Clock = std::chrono::steady_clock;

namespace {

using shardrl::bench::median;

struct Args {
  std::string attention = "sdpa";
  int64_t length = 2048, hidden = 256, heads = 4, kv_heads = 2, layers = 2, sequences = 1;
  int steps = 3, warmup = 1, threads = 2;
  std::string json_out;
};

// T tokens as `count` sequences of lengths as equal as they can be.
std::vector<int64_t> sequence_lengths(int64_t T, int64_t count) {
  std::vector<int64_t> lengths(count, T / count);
  for (int64_t i = 0; i < T % count; ++i) ++lengths[i];
  return lengths;
}

// Rotation angles of the standard RoPE (theta 10000), positions restarting at 0 in each sequence:
// cos, sin [T, hd].
std::pair<torch::Tensor, torch::Tensor> rope(const std::vector<int64_t>& lengths, int64_t hd) {
  std::vector<torch::Tensor> positions;
  for (int64_t length : lengths) positions.push_back(torch::arange(length, torch::kDouble));
  const auto inv = 1.0 / torch::pow(10000.0, torch::arange(0, hd, 2, torch::kDouble) / hd);
  const auto angles = torch::outer(torch::cat(positions), inv).to(torch::kFloat);
  const auto both = torch::cat({angles, angles}, -1);
  return {both.cos(), both.sin()};
}

// Each query sees the keys of its own sequence up to itself: 0 there, -inf elsewhere, [T, T].
torch::Tensor block_diagonal_causal_mask(const std::vector<int64_t>& lengths) {
  std::vector<torch::Tensor> ids;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ids.push_back(torch::full({lengths[i]}, static_cast<int64_t>(i), torch::kLong));
  }
  const auto sequence = torch::cat(ids);
  const int64_t T = sequence.numel();
  const auto allowed =
      (sequence.unsqueeze(1) == sequence.unsqueeze(0)) & torch::ones({T, T}, torch::kBool).tril();
  return torch::zeros({T, T}).masked_fill(~allowed, -std::numeric_limits<float>::infinity());
}

torch::Tensor rotate_half(const torch::Tensor& t) {
  const auto half = t.chunk(2, -1);
  return torch::cat({-half[1], half[0]}, -1);
}

// The decoder's attention before at::scaled_dot_product_attention (commit baa22ea), on `attn`'s
// projections: the query heads of each key/value head stacked as rows of one matrix, scores
// [B, heads, T, T], the future masked, softmax in fp32, then the values.
torch::Tensor matmul_attention(models::LlamaAttention& attn, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin, const Args& a) {
  const int64_t B = x.size(0), T = x.size(1), hd = a.hidden / a.heads;
  auto split = [&](models::lora::LoraLinear& proj, int64_t n) {
    return proj(x).view({B, T, n, hd}).transpose(1, 2);
  };
  auto q = split(attn->q_proj, a.heads), k = split(attn->k_proj, a.kv_heads),
       v = split(attn->v_proj, a.kv_heads);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  const int64_t rep = a.heads / a.kv_heads;
  const auto blocked = torch::ones({T, T}, torch::kBool).triu(1);
  auto scores = torch::matmul(q.reshape({B, a.kv_heads, rep * T, hd}), k.transpose(-2, -1))
                    .view({B, a.heads, T, T}) /
                std::sqrt(static_cast<double>(hd));
  scores = scores.masked_fill(blocked, -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(scores.to(torch::kFloat), -1).to(q.scalar_type());
  auto out = torch::matmul(probs.view({B, a.kv_heads, rep * T, T}), v).view({B, a.heads, T, hd});
  return attn->o_proj(out.transpose(1, 2).reshape({B, T, a.heads * hd}));
}

// Output of the stack and the gradient of sum(output * weights) for its input.
std::pair<torch::Tensor, torch::Tensor> step(std::vector<models::LlamaAttention>& layers,
                                             const std::string& way, const torch::Tensor& input,
                                             const torch::Tensor& weights, const Args& a) {
  const auto lengths = sequence_lengths(input.size(1), a.sequences);
  const auto [cos, sin] = rope(lengths, a.hidden / a.heads);
  models::AttentionMask mask;
  if (way == "sdpa" && lengths.size() > 1) mask.sequence_lengths = lengths;
  if (way == "block-mask") mask.allowed = block_diagonal_causal_mask(lengths);
  auto x = input.clone().requires_grad_(true);
  torch::Tensor h = x;
  for (auto& attn : layers) {
    h = h + (way == "matmul" ? matmul_attention(attn, h, cos, sin, a)
                             : attn(h, cos, sin, mask, nullptr, 0));
  }
  (h * weights).sum().backward();
  return {h.detach(), x.grad()};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The decoder's attention at long sequences: SDPA against the materialised scores"};
  Args a;
  app.add_option("--attention", a.attention, "sdpa, matmul (one sequence) or block-mask")
      ->check(CLI::IsMember({"sdpa", "matmul", "block-mask"}));
  app.add_option("--length", a.length, "tokens of the sequence");
  app.add_option("--sequences", a.sequences, "packed sequences the tokens are")
      ->check(CLI::PositiveNumber);
  app.add_option("--hidden", a.hidden);
  app.add_option("--heads", a.heads);
  app.add_option("--kv-heads", a.kv_heads);
  app.add_option("--layers", a.layers);
  app.add_option("--steps", a.steps, "measured steps");
  app.add_option("--warmup", a.warmup);
  app.add_option("--threads", a.threads, "intra-op threads");
  app.add_option("--json-out", a.json_out);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(a.threads);
  torch::manual_seed(0);

  models::LlamaConfig c;
  c.vocab_size = 16;
  c.hidden_size = a.hidden;
  c.intermediate_size = a.hidden;
  c.num_hidden_layers = a.layers;
  c.num_attention_heads = a.heads;
  c.num_key_value_heads = a.kv_heads;
  c.max_position_embeddings = a.length;
  c.validate();
  std::vector<models::LlamaAttention> layers;
  for (int64_t i = 0; i < a.layers; ++i) layers.emplace_back(c);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);

  TORCH_CHECK(a.attention != "matmul" || a.sequences == 1, "--attention matmul is one sequence");
  // The two ways agree (output and input gradient) at a short length.
  {
    const auto x = torch::randn({1, 256, a.hidden}, gen), w = torch::randn({1, 256, a.hidden}, gen);
    const std::string other = a.sequences > 1 ? "block-mask" : "matmul";
    const auto [out, grad] = step(layers, "sdpa", x, w, a);
    const auto [ref_out, ref_grad] = step(layers, other, x, w, a);
    const double out_diff = (out - ref_out).abs().max().item<double>();
    const double grad_diff = (grad - ref_grad).abs().max().item<double>();
    TORCH_CHECK(out_diff < 1e-4 && grad_diff < 1e-4, "sdpa and ", other, " differ: output by ",
                out_diff, ", input gradient by ", grad_diff);
    for (auto& attn : layers) attn->zero_grad();
  }

  const auto x = torch::randn({1, a.length, a.hidden}, gen);
  const auto w = torch::randn({1, a.length, a.hidden}, gen);
  std::vector<double> seconds, peaks;
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    for (auto& attn : layers) attn->zero_grad();
    const int64_t before = bench::trimmed_rss();
    bench::reset_peak_rss();
    const auto t0 = Clock::now();
    step(layers, a.attention, x, w, a);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s < a.warmup) continue;
    seconds.push_back(elapsed);
    peaks.push_back(static_cast<double>(bench::proc_status_bytes("VmHWM") - before));
  }
  const nlohmann::json out = {
      {"bench", "attention"},
      {"attention", a.attention},
      {"sequence_length", a.length},
      {"sequences", a.sequences},
      {"model",
       {{"hidden", a.hidden}, {"heads", a.heads}, {"kv_heads", a.kv_heads}, {"layers", a.layers}}},
      {"threads", a.threads},
      {"step_seconds", seconds},
      {"median_step_seconds", median(seconds)},
      {"peak_activation_bytes", *std::max_element(peaks.begin(), peaks.end())},
      {"median_peak_activation_bytes", median(peaks)}};
  std::cout << out.dump(2) << "\n";
  if (!a.json_out.empty()) std::ofstream(a.json_out) << out.dump(2) << "\n";
  return 0;
}
