// A verifiable-reward task for language-model GRPO: "12+34=" -> "46". Problems come from a seeded
// generator; the reward is 1 when the integer a response starts with equals the answer, else 0
// (verl's rule-based rewards, as for GSM8K, work the same way: parse, then compare exactly).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardrl::algos {

struct ArithmeticTaskConfig {
  int digits = 2;               // operands are drawn from [0, 10^digits)
  std::string operators = "+";  // any of "+-*", one drawn per problem
  // Operands zero-padded to `digits`, so every prompt has one length ("07+35="): the decoder
  // samples a batch of prompts without a padding mask.
  bool fixed_width = true;
  void validate() const;  // errors name the field
};

struct ArithmeticProblem {
  std::string prompt;  // "07+35="
  std::string answer;  // "42"
};

// `count` problems from a generator seeded with `seed`: the same seed gives the same problems.
std::vector<ArithmeticProblem> make_arithmetic_problems(const ArithmeticTaskConfig& config,
                                                        int64_t count, uint64_t seed);

// The integer a response starts with: optional spaces, an optional '-', then digits, ending at
// the first other character. None when there is no such integer or it overflows int64.
std::optional<int64_t> parse_arithmetic_answer(const std::string& response);

// The last integer in a response ("47 + 38 = 85." -> 85; a '-' right before its digits, not
// after a digit, makes it negative). None when there is no digit or it overflows int64.
std::optional<int64_t> parse_last_integer(const std::string& response);

// Where a response holds its answer: at its start (a model trained on "12+34=46"), or as its last
// integer (a chat model's "12 + 34 = 46.", as GSM8K's rule reads the last number).
enum class AnswerAt { kStart, kLastInteger };

// 1 when the response's answer (parse_arithmetic_answer or parse_last_integer) equals the
// integer `answer`, else 0.
double arithmetic_reward(const std::string& response, const std::string& answer,
                         AnswerAt at = AnswerAt::kStart);

// The rewards of a batch as fp32 [B]; the two lists must have the same length.
torch::Tensor arithmetic_rewards(const std::vector<std::string>& responses,
                                 const std::vector<std::string>& answers,
                                 AnswerAt at = AnswerAt::kStart);

}  // namespace shardrl::algos
