// skip_ignored's size ladder (src/cuda/linear/size_ladder.h) on the CPU: the rungs a chunk of
// each capacity gets, and the branch a count of valid rows takes. Pure functions: every build.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/linear/size_ladder.h"

namespace fusedce_test {
namespace {

using fusedce::cuda::LadderBranch;
using fusedce::cuda::SizeLadder;
using fusedce::cuda::size_ladder;

std::vector<int64_t> rungs_of(int64_t capacity) {
  const SizeLadder l = size_ladder(capacity);
  return std::vector<int64_t>(l.size, l.size + l.rungs);
}

int branch(int64_t capacity, int64_t rest) {
  const SizeLadder l = size_ladder(capacity);
  return LadderBranch::of(l.size, l.rungs, capacity, rest);
}

TEST(SizeLadder, EighthsInWholeTiles) {
  EXPECT_EQ(rungs_of(8192), (std::vector<int64_t>{1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192}));
  // 8197 rows in one chunk (a budget that holds every row): eighths rounded up to tiles, the last
  // the capacity itself.
  EXPECT_EQ(rungs_of(8197), (std::vector<int64_t>{1152, 2176, 3200, 4224, 5248, 6272, 7296, 8197}));
  EXPECT_EQ(rungs_of(300), (std::vector<int64_t>{128, 256, 300}));
  EXPECT_EQ(rungs_of(128), (std::vector<int64_t>{128}));
  EXPECT_EQ(rungs_of(5), (std::vector<int64_t>{5}));
  EXPECT_EQ(rungs_of(1), (std::vector<int64_t>{1}));
  EXPECT_TRUE(rungs_of(0).empty());
}

TEST(SizeLadder, InvariantsOverCapacities) {
  for (int64_t cap = 1; cap <= 5000; ++cap) {
    const SizeLadder l = size_ladder(cap);
    ASSERT_GE(l.rungs, 1) << cap;
    ASSERT_LE(l.rungs, fusedce::cuda::kLadderRungs) << cap;
    EXPECT_EQ(l.size[l.rungs - 1], cap) << cap;
    for (int b = 0; b + 1 < l.rungs; ++b) {
      EXPECT_LT(l.size[b], l.size[b + 1]) << cap;
      EXPECT_EQ(l.size[b] % 128, 0) << cap;
    }
    // Every count of rows lands on the smallest rung that holds it, wasting at most an eighth
    // of the capacity plus one tile.
    for (int64_t rest = 1; rest <= cap; rest += (cap > 600 ? 37 : 1)) {
      const int b = LadderBranch::of(l.size, l.rungs, cap, rest);
      ASSERT_GE(b, 0);
      ASSERT_LT(b, l.rungs);
      EXPECT_GE(l.size[b], rest) << cap << " " << rest;
      if (b > 0) {
        EXPECT_LT(l.size[b - 1], rest) << cap << " " << rest;
      }
      EXPECT_LE(l.size[b] - rest, (cap + 7) / 8 + 127) << cap << " " << rest;
    }
  }
}

TEST(SizeLadder, Branches) {
  // Half of 8192 rows valid in one chunk: the 4096 rung, exactly half the work.
  EXPECT_EQ(branch(8192, 4096), 3);
  EXPECT_EQ(branch(8192, 4097), 4);  // one past a rung: the next one
  EXPECT_EQ(branch(8192, 1), 0);
  EXPECT_EQ(branch(8192, 8192), 7);  // the chunk holds the last valid row, full
  EXPECT_EQ(branch(8192, 8193), LadderBranch::full(8));  // full, more chunks follow
  EXPECT_EQ(branch(8192, 0), LadderBranch::none(8));
  EXPECT_EQ(branch(8192, -5), LadderBranch::none(8));
  EXPECT_EQ(branch(300, 129), 1);
  EXPECT_EQ(branch(300, 257), 2);
}

}  // namespace
}  // namespace fusedce_test
