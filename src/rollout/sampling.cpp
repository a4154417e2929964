#include "shardrl/rollout/sampling.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

namespace shardrl::rollout {
namespace {

void check_options(const SamplingOptions& o) {
  if (o.max_new_tokens < 0) {
    throw std::invalid_argument(
        fmt::format("SamplingOptions.max_new_tokens: must be >= 0, got {}", o.max_new_tokens));
  }
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    throw std::invalid_argument(
        fmt::format("SamplingOptions.temperature: must be finite and >= 0, got {}", o.temperature));
  }
  if (o.num_return_sequences < 1) {
    throw std::invalid_argument(fmt::format(
        "SamplingOptions.num_return_sequences: must be >= 1, got {}", o.num_return_sequences));
  }
  if (!(o.top_p > 0 && o.top_p <= 1)) {
    throw std::invalid_argument(
        fmt::format("SamplingOptions.top_p: must be in (0, 1], got {}", o.top_p));
  }
}

void check_tokens(const torch::Tensor& tokens, const std::string& name) {
  if (!tokens.defined() || tokens.dim() != 2 || tokens.scalar_type() != torch::kLong) {
    throw std::invalid_argument(
        fmt::format("{}: expected an int64 tensor [batch, length], got {}", name,
                    tokens.defined() ? tokens.toString() + " of shape " + c10::str(tokens.sizes())
                                     : std::string("an undefined tensor")));
  }
}

// -inf outside the nucleus: the highest-probability tokens until their mass reaches top_p (the
// first token always stays, so a tiny top_p is greedy). As HF's TopPLogitsWarper.
torch::Tensor top_p_filter(const torch::Tensor& logits, double top_p) {
  if (top_p >= 1) return logits;
  auto [sorted, order] = logits.sort(-1, /*descending=*/true);
  auto probs = torch::softmax(sorted, -1);
  auto mass_before = probs.cumsum(-1) - probs;
  auto drop = torch::zeros_like(mass_before, torch::kBool).scatter(-1, order, mass_before >= top_p);
  return logits.masked_fill(drop, -std::numeric_limits<float>::infinity());
}

// One token per row of `probs` [rows, vocab] (any non-negative weights), by inverting the
// cumulative distribution at one uniform per row. torch::multinomial draws an exponential, a
// log, for every vocabulary entry of every row instead (its one-sample path, with or without
// replacement): at 49k entries that was a tenth of a decode step.
torch::Tensor draw(const torch::Tensor& probs, const c10::optional<at::Generator>& generator) {
  auto cdf = probs.cumsum(-1);
  auto u = torch::rand({probs.size(0), 1}, generator, cdf.options()) * cdf.narrow(-1, -1, 1);
  // The first entry whose cumulative mass exceeds u: never one of zero weight.
  return torch::searchsorted(cdf, u, /*out_int32=*/false, /*right=*/true)
      .squeeze(1)
      .clamp_max(probs.size(-1) - 1);
}

}  // namespace

Rollout sample(models::LlamaForCausalLM& model, const torch::Tensor& prompts,
               const SamplingOptions& options, const torch::Tensor& prompt_mask) {
  check_options(options);
  check_tokens(prompts, "sample: prompts");
  if (prompt_mask.defined() && prompt_mask.sizes() != prompts.sizes()) {
    throw std::invalid_argument(fmt::format("sample: prompt_mask has shape {}, the prompts {}",
                                            c10::str(prompt_mask.sizes()),
                                            c10::str(prompts.sizes())));
  }
  torch::NoGradGuard no_grad;
  // Every token's forward would otherwise gather and free every unit again.
  std::optional<fsdp::UnshardScope> gathered;
  if (model.is_sharded()) gathered.emplace(model.fsdp());

  c10::optional<at::Generator> generator;
  if (options.generator) generator = *options.generator;
  const int64_t eos = options.eos_token_id;
  const int64_t pad = options.pad_token_id >= 0 ? options.pad_token_id : eos;
  const int64_t n = options.num_return_sequences, rows = prompts.size(0) * n;
  const auto long_options = torch::dtype(torch::kLong).device(prompts.device());
  const auto float_options = torch::dtype(torch::kFloat).device(prompts.device());

  models::KVCache cache(prompts.size(1) + options.max_new_tokens);
  std::vector<torch::Tensor> tokens, log_probs, mask, entropy;
  torch::Tensor input = prompts;
  const torch::Tensor prompt_attention =
      prompt_mask.defined() ? prompt_mask.to(prompts.device()).to(torch::kLong) : torch::Tensor();
  // Grows by a column of ones a step: the new tokens are never padding.
  torch::Tensor attention_mask = prompt_attention;
  // The batch holds the rows `active` of the rollout; `done` marks those of them that have
  // ended. Ended rows leave the batch once they are an eighth of it (the cache copy then costs
  // less than the steps it saves), as a serving engine's continuous batching drops finished
  // sequences; transformers' generate computes them to the end.
  torch::Tensor active;
  torch::Tensor done;
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    // The head on the last position only: the prompt's other logits are never used.
    auto logits =
        model(input, &cache, attention_mask, /*logits_to_keep=*/1).select(1, -1).to(torch::kFloat);
    if (step == 0) {
      // Each prompt was prefilled once; its n rows start from copies.
      active = torch::arange(rows, long_options);
      done = torch::zeros({rows}, torch::dtype(torch::kBool).device(prompts.device()));
      if (n > 1) {
        const auto prompt_of_row = active.div(n, "floor");
        logits = logits.index_select(0, prompt_of_row);
        cache.batch_select_indices(prompt_of_row);
        if (attention_mask.defined())
          attention_mask = attention_mask.index_select(0, prompt_of_row);
      }
    }
    auto scaled = options.temperature > 0 ? logits / options.temperature : logits;
    const auto all_log_probs = torch::log_softmax(scaled, -1);
    torch::Tensor next;
    if (options.temperature > 0) {
      // Without top-p the sampling distribution is the one whose log-probs are logged: one
      // exp over the vocabulary rather than a second softmax.
      next = draw(options.top_p >= 1 ? all_log_probs.exp()
                                     : torch::softmax(top_p_filter(scaled, options.top_p), -1),
                  generator);
    } else {
      next = logits.argmax(-1);
    }
    auto token_log_prob = all_log_probs.gather(-1, next.unsqueeze(-1)).squeeze(-1);
    if (eos >= 0) next = torch::where(done, torch::full_like(next, pad), next);
    // Rows out of the batch hold padding, outside the mask.
    tokens.push_back(
        torch::full({rows}, eos >= 0 ? pad : 0, long_options).index_put_({active}, next));
    mask.push_back(
        torch::zeros({rows}, float_options).index_put_({active}, (~done).to(torch::kFloat)));
    log_probs.push_back(torch::zeros({rows}, float_options)
                            .index_put_({active}, token_log_prob.masked_fill(done, 0)));
    if (options.record_entropy) {
      const auto h = -(all_log_probs.exp() * all_log_probs).sum(-1);
      entropy.push_back(
          torch::zeros({rows}, float_options).index_put_({active}, h.masked_fill(done, 0)));
    }
    if (eos >= 0) {
      done = done | (next == eos);
      const int64_t ended = done.sum().item<int64_t>();
      if (ended == done.size(0)) break;
      if (ended > 0 && ended * 8 >= done.size(0)) {
        const auto keep = (~done).nonzero().squeeze(1);
        active = active.index_select(0, keep);
        cache.batch_select_indices(keep);
        if (attention_mask.defined()) attention_mask = attention_mask.index_select(0, keep);
        next = next.index_select(0, keep);
        done = done.index_select(0, keep);
      }
    }
    input = next.unsqueeze(1);
    if (attention_mask.defined()) {
      attention_mask =
          torch::cat({attention_mask, torch::ones({next.size(0), 1}, long_options)}, 1);
    }
  }

  Rollout out;
  out.prompts = n > 1 ? prompts.repeat_interleave(n, 0) : prompts;
  if (tokens.empty()) {
    out.responses = torch::empty({rows, 0}, prompts.options());
    out.log_probs = torch::empty({rows, 0}, prompts.options().dtype(torch::kFloat));
    out.response_mask = out.log_probs.clone();
    if (options.record_entropy) out.entropy = out.log_probs.clone();
  } else {
    if (options.record_entropy) out.entropy = torch::stack(entropy, 1);
    out.responses = torch::stack(tokens, 1);
    out.log_probs = torch::stack(log_probs, 1);
    out.response_mask = torch::stack(mask, 1);
  }
  out.sequences = torch::cat({out.prompts, out.responses}, 1);
  out.attention_mask =
      torch::cat({prompt_attention.defined() ? prompt_attention.repeat_interleave(n, 0)
                                             : torch::ones_like(out.prompts),
                  torch::ones_like(out.responses)},
                 1);
  return out;
}

torch::Tensor generate(models::LlamaForCausalLM& model, const torch::Tensor& prompt,
                       const SamplingOptions& options) {
  return sample(model, prompt, options).sequences;
}

torch::Tensor response_log_probs(models::LlamaForCausalLM& model, const torch::Tensor& sequences,
                                 int64_t prompt_length, double temperature,
                                 const torch::Tensor& attention_mask) {
  check_tokens(sequences, "response_log_probs: sequences");
  const int64_t total = sequences.size(1);
  if (prompt_length < 1 || prompt_length >= total) {
    throw std::invalid_argument(fmt::format(
        "response_log_probs: prompt_length must be in [1, {}) for sequences of length {}, got {}",
        total, total, prompt_length));
  }
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    throw std::invalid_argument(fmt::format(
        "response_log_probs: temperature must be finite and >= 0, got {}", temperature));
  }
  const int64_t length = total - prompt_length;
  // Position t's logits predict token t + 1.
  if (attention_mask.defined() && attention_mask.sizes() != sequences.sizes()) {
    throw std::invalid_argument(
        fmt::format("response_log_probs: attention_mask has shape {}, the sequences {}",
                    c10::str(attention_mask.sizes()), c10::str(sequences.sizes())));
  }
  const auto mask =
      attention_mask.defined() ? attention_mask.narrow(1, 0, total - 1) : torch::Tensor();
  // Only the response positions go through the head, and only their log-probs come back (under
  // sequence parallelism, only they are gathered).
  return model(sequences.narrow(1, 0, total - 1), nullptr, mask, length,
               sequences.narrow(1, prompt_length, length), temperature);
}

namespace {

// The rows' real tokens packed (models::pack_sequences) and, for each response token under
// response_mask, the packed index of the token before it: where its log-prob is predicted and
// its value (the state before it) is read.
struct PackedResponses {
  models::PackedSequences packed;
  torch::Tensor scored;       // [S] packed indices of the positions that score
  torch::Tensor scored_flat;  // [S] the scored response tokens' flat index in sequences
  torch::Tensor in_response;  // [S] their flat index in a [rows, length] response tensor
  int64_t rows = 0, length = 0;

  // [S] per scored token -> [rows, length], 0 where response_mask is 0.
  torch::Tensor scatter(const torch::Tensor& per_token) const {
    return torch::zeros({rows * length}, per_token.options())
        .index_put({in_response}, per_token)
        .view({rows, length});
  }
};

PackedResponses pack_responses(const char* who, const torch::Tensor& sequences,
                               int64_t prompt_length, const torch::Tensor& attention_mask,
                               const torch::Tensor& response_mask, bool share_prompts = false) {
  check_tokens(sequences, fmt::format("{}: sequences", who));
  const int64_t rows = sequences.size(0), total = sequences.size(1), length = total - prompt_length;
  if (prompt_length < 1 || length < 1) {
    throw std::invalid_argument(
        fmt::format("{}: prompt_length must be in [1, {}) for sequences of length {}, got {}", who,
                    total, total, prompt_length));
  }
  if (!response_mask.defined() || response_mask.sizes() != c10::IntArrayRef{rows, length} ||
      (attention_mask.defined() && attention_mask.sizes() != sequences.sizes())) {
    throw std::invalid_argument(fmt::format(
        "{}: response_mask must be [{}, {}] and attention_mask [{}, {}] or undefined, got {} and "
        "{}",
        who, rows, length, rows, total,
        response_mask.defined() ? c10::str(response_mask.sizes()) : "undefined",
        attention_mask.defined() ? c10::str(attention_mask.sizes()) : "undefined"));
  }
  const auto device = sequences.device();
  const auto prompt_valid =
      attention_mask.defined()
          ? attention_mask.narrow(1, 0, prompt_length).to(device).to(torch::kBool)
          : torch::ones({rows, prompt_length}, torch::dtype(torch::kBool).device(device));
  // A response counts up to its mask's last 1 (its EOS); what follows is padding.
  const auto response_valid = response_mask.to(device).to(torch::kBool);
  const auto kept =
      std::get<0>(response_valid.to(torch::kLong).flip(1).cummax(1)).flip(1).to(torch::kBool);
  PackedResponses out;
  out.rows = rows;
  out.length = length;
  out.packed = models::pack_sequences(sequences, torch::cat({prompt_valid, kept}, 1),
                                      share_prompts ? prompt_length : 0);
  // Response token (row, j) is predicted at the packed index of the token before it: for the
  // first token of an answer whose prompt is shared, the shared copy's last token.
  const auto flat =
      (torch::arange(rows, torch::dtype(torch::kLong).device(device)) * total).unsqueeze(1) +
      prompt_length + torch::arange(length, torch::dtype(torch::kLong).device(device));
  out.scored_flat = flat.masked_select(response_valid);
  out.scored = out.packed.packed_index.index_select(0, out.scored_flat - 1);
  if (out.scored.numel() > 0 && out.scored.min().item<int64_t>() < 0) {
    throw std::invalid_argument(
        fmt::format("{}: a response follows a prompt with no valid token", who));
  }
  out.in_response = (out.scored_flat.div(total, "floor") * length) +
                    (out.scored_flat.remainder(total) - prompt_length);
  return out;
}

}  // namespace

torch::Tensor packed_response_log_probs(models::LlamaForCausalLM& model,
                                        const torch::Tensor& sequences, int64_t prompt_length,
                                        double temperature, const torch::Tensor& attention_mask,
                                        const torch::Tensor& response_mask, bool share_prompts) {
  const auto r = pack_responses("packed_response_log_probs", sequences, prompt_length,
                                attention_mask, response_mask, share_prompts);
  return r.scatter(
      model(r.packed, r.scored, sequences.flatten().index_select(0, r.scored_flat), temperature));
}

torch::Tensor response_values(models::LlamaForTokenClassification& model,
                              const torch::Tensor& sequences, int64_t prompt_length,
                              const torch::Tensor& attention_mask,
                              const torch::Tensor& response_mask) {
  check_tokens(sequences, "response_values: sequences");
  const int64_t total = sequences.size(1), length = total - prompt_length;
  if (prompt_length < 1 || length < 1 || !response_mask.defined() ||
      response_mask.sizes() != c10::IntArrayRef{sequences.size(0), length} ||
      (attention_mask.defined() && attention_mask.sizes() != sequences.sizes())) {
    throw std::invalid_argument(fmt::format(
        "response_values: for sequences {} and prompt_length {}, response_mask must be [B, {}] "
        "and attention_mask the sequences' shape or undefined",
        c10::str(sequences.sizes()), prompt_length, length));
  }
  const auto mask =
      attention_mask.defined() ? attention_mask.narrow(1, 0, total - 1) : torch::Tensor();
  // The value of response token j is the state's before it: position prompt_length + j - 1.
  const auto values =
      model(sequences.narrow(1, 0, total - 1), mask).narrow(1, prompt_length - 1, length);
  return values * response_mask.to(values.device(), torch::kFloat);
}

torch::Tensor packed_response_values(models::LlamaForTokenClassification& model,
                                     const torch::Tensor& sequences, int64_t prompt_length,
                                     const torch::Tensor& attention_mask,
                                     const torch::Tensor& response_mask) {
  const auto r = pack_responses("packed_response_values", sequences, prompt_length, attention_mask,
                                response_mask);
  return r.scatter(model(r.packed).index_select(0, r.scored));
}

}  // namespace shardrl::rollout
