// Progress of long stages (shardrl/progress.h): a line every few seconds, a bar on a terminal,
// silence for short stages and on other ranks; durations and sizes as the lines show them.
#include <gtest/gtest.h>

#include <cstdlib>

#include "shardrl/progress.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

TEST(Progress, DurationsAndSizesReadAsPeopleWriteThem) {
  EXPECT_EQ(format_duration(0.042), "42ms");
  EXPECT_EQ(format_duration(0.84), "0.8s");
  EXPECT_EQ(format_duration(42.4), "42s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(3720), "1h02m");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(340.2e6), "340.2 MB");
  EXPECT_EQ(format_bytes(1.25e9), "1.25 GB");
}

// A fake clock, in seconds, and the text written.
struct ProgressRun {
  std::vector<std::string> writes;
  double now = 0;
  Progress::Options options(bool terminal) {
    Progress::Options o;
    o.unit = "steps";
    o.line_seconds = 10;
    o.terminal = terminal;
    o.clock = [this] { return now; };
    o.write = [this](const std::string& text) { writes.push_back(text); };
    return o;
  }
};

TEST(Progress, ALineEveryFewSecondsNotEveryIteration) {
  ProgressRun r;
  {
    Progress progress("pretraining", 1000, r.options(/*terminal=*/false));
    for (int step = 1; step <= 1000; ++step) {
      r.now = step / 10.0;  // 0.1 s a step, 100 s in all
      progress.update(step, "loss 0.5");
    }
    progress.finish();
  }
  // One line per 10 s of the 100 s, then the closing line (the destructor adds nothing).
  ASSERT_EQ(r.writes.size(), 11u);
  EXPECT_EQ(r.writes[0], "pretraining: 100/1000 steps (10%), 10.0 steps/s, ETA 1m30s, loss 0.5\n");
  EXPECT_EQ(r.writes[9], "pretraining: 1000/1000 steps (100%), 10.0 steps/s, loss 0.5\n");
  EXPECT_EQ(r.writes[10], "pretraining: 1000/1000 steps in 1m40s (10.0 steps/s)\n");
}

TEST(Progress, ABarRedrawnInPlaceOnATerminal) {
  ProgressRun r;
  Progress progress("loading", 1000, r.options(/*terminal=*/true));
  for (int step = 1; step <= 1000; ++step) {
    r.now = step / 10.0;
    progress.update(step);
  }
  progress.finish();
  // Redrawn at most 4 times a second (here: every 0.3 s), each a carriage return and no newline.
  ASSERT_GT(r.writes.size(), 300u);
  EXPECT_LT(r.writes.size(), 400u);
  for (size_t i = 0; i + 1 < r.writes.size(); ++i) {
    EXPECT_EQ(r.writes[i].rfind("\rloading [", 0), 0u) << r.writes[i];
    EXPECT_EQ(r.writes[i].find('\n'), std::string::npos) << r.writes[i];
  }
  // The last bar drawn, at step 999: 23 of its 24 cells filled.
  EXPECT_NE(r.writes[r.writes.size() - 2].find("[" + std::string(23, '#') + " ] 999/1000"),
            std::string::npos)
      << r.writes[r.writes.size() - 2];
  EXPECT_EQ(r.writes.back(), "\rloading: 1000/1000 steps in 1m40s (10.0 steps/s)\033[K\n");
}

TEST(Progress, QuietWhenShortDisabledOrOnOtherRanks) {
  ProgressRun r;
  {
    Progress quick("quick", 10, r.options(false));
    for (int step = 1; step <= 10; ++step) {
      r.now = step / 10.0;
      quick.update(step);
    }
  }
  auto off = r.options(false);
  off.enabled = false;
  {
    Progress other_rank("slow", 10, off);
    for (int step = 1; step <= 10; ++step) {
      r.now += 100;
      other_rank.update(step);
    }
  }
  EXPECT_TRUE(r.writes.empty()) << r.writes.front();
}

TEST(Progress, SizesAndSlowSteps) {
  ProgressRun r;
  auto bytes = r.options(false);
  bytes.unit = "B";
  Progress load("checkpoint load", int64_t{4} << 30, bytes);
  r.now = 20;
  load.update(int64_t{1} << 30);
  EXPECT_EQ(r.writes.at(0), "checkpoint load: 1.07 GB/4.29 GB (25%), 53.7 MB/s, ETA 1m00s\n");
  Progress slow("RL", 10, r.options(false));
  r.now = 60;
  slow.update(2);
  EXPECT_EQ(r.writes.at(1), "RL: 2/10 steps (20%), 20.0 s/step, ETA 2m40s\n");
}

TEST(Progress, BadIntervalInTheEnvironmentNamesTheVariable) {
  setenv("SHARDRL_PROGRESS_SECONDS", "soon", 1);
  expect_invalid_argument_naming([] { progress_line_seconds(); }, "SHARDRL_PROGRESS_SECONDS",
                                 "soon");
  setenv("SHARDRL_PROGRESS_SECONDS", "2.5", 1);
  EXPECT_DOUBLE_EQ(progress_line_seconds(), 2.5);
  unsetenv("SHARDRL_PROGRESS_SECONDS");
  EXPECT_DOUBLE_EQ(progress_line_seconds(), 10.0);
}

}  // namespace
}  // namespace shardrl::testing
