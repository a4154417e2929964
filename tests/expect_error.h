// Shared by the tests: an error that must name what was wrong.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace shardrl::testing {

// Runs fn, which must throw an E whose message holds every one of `words`.
template <class E = std::exception>
void expect_error_naming(const std::function<void()>& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no error was raised";
  } catch (const std::exception& e) {
    if (dynamic_cast<const E*>(&e) == nullptr) {
      ADD_FAILURE() << "another exception than expected: " << e.what();
      return;
    }
    for (const auto& w : words) {
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos)
          << "'" << w << "' not in " << e.what();
    }
  }
}

}  // namespace shardrl::testing
