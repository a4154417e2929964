// The arithmetic verifiable-reward task: seeded problems whose answers are right, and the reward's
// parsing rule.
#include <gtest/gtest.h>

#include <regex>
#include <set>

#include "shardrl/algos/arithmetic.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

using algos::ArithmeticTaskConfig;

TEST(Arithmetic, ProblemsAreSeededAndTheirAnswersRight) {
  ArithmeticTaskConfig config;
  config.digits = 2;
  config.operators = "+-*";
  const auto problems = algos::make_arithmetic_problems(config, 200, 5);
  ASSERT_EQ(problems.size(), 200u);
  const std::regex form(R"((\d{2})([-+*])(\d{2})=)");
  std::set<char> ops;
  std::set<std::string> prompts;
  for (const auto& p : problems) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(p.prompt, m, form)) << p.prompt;
    const int64_t a = std::stoll(m[1]), b = std::stoll(m[3]);
    const char op = m[2].str()[0];
    ops.insert(op);
    prompts.insert(p.prompt);
    const int64_t expected = op == '+' ? a + b : op == '-' ? a - b : a * b;
    EXPECT_EQ(p.answer, std::to_string(expected)) << p.prompt;
    EXPECT_EQ(algos::arithmetic_reward(p.answer, p.answer), 1.0);
  }
  EXPECT_EQ(ops, (std::set<char>{'+', '-', '*'}));
  EXPECT_GT(prompts.size(), 150u);  // drawn, not repeated

  const auto again = algos::make_arithmetic_problems(config, 200, 5);
  const auto other = algos::make_arithmetic_problems(config, 200, 6);
  int same = 0, differ = 0;
  for (size_t k = 0; k < problems.size(); ++k) {
    same += again[k].prompt == problems[k].prompt;
    differ += other[k].prompt != problems[k].prompt;
  }
  EXPECT_EQ(same, 200);
  EXPECT_GT(differ, 150);

  config.fixed_width = false;
  config.operators = "+";
  for (const auto& p : algos::make_arithmetic_problems(config, 50, 1)) {
    EXPECT_TRUE(std::regex_match(p.prompt, std::regex(R"((0|[1-9]\d?)\+(0|[1-9]\d?)=)")))
        << p.prompt;
  }
}

TEST(Arithmetic, RewardIsExactMatchOfTheParsedAnswer) {
  EXPECT_EQ(algos::arithmetic_reward("46", "46"), 1.0);
  EXPECT_EQ(algos::arithmetic_reward(" 46", "46"), 1.0);
  EXPECT_EQ(algos::arithmetic_reward("46<|endoftext|>", "46"), 1.0);
  EXPECT_EQ(algos::arithmetic_reward("46\n12+1=13", "46"), 1.0);  // only the first integer counts
  EXPECT_EQ(algos::arithmetic_reward("-28", "-28"), 1.0);
  EXPECT_EQ(algos::arithmetic_reward("28", "-28"), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("47", "46"), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("4 6", "46"), 0.0);
  using algos::AnswerAt;
  EXPECT_EQ(algos::arithmetic_reward("47 + 38 = 85.", "85", AnswerAt::kLastInteger), 1.0);
  EXPECT_EQ(algos::arithmetic_reward("47 + 38 = 85.", "85"), 0.0);  // starts with 47
  EXPECT_EQ(algos::arithmetic_reward("so 5 - 9 = -4", "-4", AnswerAt::kLastInteger), 1.0);
  EXPECT_EQ(algos::arithmetic_reward("so 15-9", "9", AnswerAt::kLastInteger), 1.0);  // a minus
  EXPECT_EQ(algos::arithmetic_reward("no number", "1", AnswerAt::kLastInteger), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("85 or 86", "85", AnswerAt::kLastInteger), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("466", "46"), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("x46", "46"), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("", "46"), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("-", "46"), 0.0);
  EXPECT_EQ(algos::arithmetic_reward("99999999999999999999999", "46"), 0.0);  // overflow: none

  EXPECT_EQ(algos::parse_arithmetic_answer("  -7abc"), -7);
  EXPECT_EQ(algos::parse_arithmetic_answer("abc"), std::nullopt);

  auto rewards = algos::arithmetic_rewards({"46", "12", "x"}, {"46", "13", "1"});
  EXPECT_TRUE(torch::equal(rewards, torch::tensor({1.0f, 0.0f, 0.0f})));
}

TEST(Arithmetic, BadInputNamesTheField) {
  ArithmeticTaskConfig config;
  config.digits = 0;
  expect_invalid_argument_naming([&] { algos::make_arithmetic_problems(config, 1, 0); },
                                 "arithmetic.digits", "0");
  config.digits = 2;
  config.operators = "+/";
  expect_invalid_argument_naming([&] { algos::make_arithmetic_problems(config, 1, 0); },
                                 "arithmetic.operators", "+/");
  expect_invalid_argument_naming([] { algos::arithmetic_rewards({"1"}, {}); }, "arithmetic_rewards",
                                 "1 responses for 0 answers");
  expect_invalid_argument_naming([] { algos::arithmetic_reward("1", "one"); }, "arithmetic_reward",
                                 "one");
}

}  // namespace
}  // namespace shardrl::testing
