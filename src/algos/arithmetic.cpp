#include "shardrl/algos/arithmetic.h"

#include <fmt/format.h>

#include <limits>
#include <random>
#include <stdexcept>

namespace shardrl::algos {

void ArithmeticTaskConfig::validate() const {
  if (digits < 1 || digits > 9) {
    throw std::invalid_argument(
        fmt::format("arithmetic.digits: must be in [1, 9], got {}", digits));
  }
  if (operators.empty() || operators.find_first_not_of("+-*") != std::string::npos) {
    throw std::invalid_argument(
        fmt::format("arithmetic.operators: must be a non-empty string of '+', '-', '*', got \"{}\"",
                    operators));
  }
}

std::vector<ArithmeticProblem> make_arithmetic_problems(const ArithmeticTaskConfig& config,
                                                        int64_t count, uint64_t seed) {
  config.validate();
  if (count < 0) {
    throw std::invalid_argument(fmt::format("arithmetic: count must be >= 0, got {}", count));
  }
  int64_t limit = 1;
  for (int d = 0; d < config.digits; ++d) limit *= 10;
  // Draws by hand from the raw 64-bit stream: std::uniform_int_distribution differs between
  // standard libraries, and the problems must not.
  std::mt19937_64 gen(seed);
  const auto draw = [&](int64_t n) {
    return static_cast<int64_t>(gen() % static_cast<uint64_t>(n));
  };
  std::vector<ArithmeticProblem> problems;
  problems.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t a = draw(limit), b = draw(limit);
    const char op = config.operators[draw(static_cast<int64_t>(config.operators.size()))];
    const int64_t result = op == '+' ? a + b : op == '-' ? a - b : a * b;
    const int width = config.fixed_width ? config.digits : 0;
    problems.push_back(
        {fmt::format("{:0{}}{}{:0{}}=", a, width, op, b, width), std::to_string(result)});
  }
  return problems;
}

std::optional<int64_t> parse_arithmetic_answer(const std::string& response) {
  size_t i = response.find_first_not_of(' ');
  if (i == std::string::npos) return std::nullopt;
  const bool negative = response[i] == '-';
  if (negative) ++i;
  if (i >= response.size() || response[i] < '0' || response[i] > '9') return std::nullopt;
  int64_t value = 0;
  for (; i < response.size() && response[i] >= '0' && response[i] <= '9'; ++i) {
    const int digit = response[i] - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return negative ? -value : value;
}

std::optional<int64_t> parse_last_integer(const std::string& response) {
  const auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  size_t end = response.size();
  while (end > 0 && !is_digit(response[end - 1])) --end;
  if (end == 0) return std::nullopt;
  size_t start = end;
  while (start > 0 && is_digit(response[start - 1])) --start;
  const bool negative =
      start > 0 && response[start - 1] == '-' && (start < 2 || !is_digit(response[start - 2]));
  return parse_arithmetic_answer(
      response.substr(negative ? start - 1 : start, end - start + negative));
}

double arithmetic_reward(const std::string& response, const std::string& answer, AnswerAt at) {
  const auto expected = parse_arithmetic_answer(answer);
  if (!expected) {
    throw std::invalid_argument(
        fmt::format("arithmetic_reward: answer \"{}\" is not an integer", answer));
  }
  const auto got =
      at == AnswerAt::kStart ? parse_arithmetic_answer(response) : parse_last_integer(response);
  return got && *got == *expected ? 1.0 : 0.0;
}

torch::Tensor arithmetic_rewards(const std::vector<std::string>& responses,
                                 const std::vector<std::string>& answers, AnswerAt at) {
  if (responses.size() != answers.size()) {
    throw std::invalid_argument(fmt::format("arithmetic_rewards: {} responses for {} answers",
                                            responses.size(), answers.size()));
  }
  auto rewards = torch::empty({static_cast<int64_t>(responses.size())}, torch::kFloat);
  auto out = rewards.accessor<float, 1>();
  for (size_t k = 0; k < responses.size(); ++k) {
    out[static_cast<int64_t>(k)] =
        static_cast<float>(arithmetic_reward(responses[k], answers[k], at));
  }
  return rewards;
}

}  // namespace shardrl::algos
