// The streaming kernel's per-segment argmax (src/common/argmax_track.h), run on the CPU against a
// direct torch.argmax (the first NaN, else the first maximum) over random rows full of ties,
// infinities and NaNs, with ragged row ends. The inputs to SegmentArgmax::add are formed as the
// kernel forms them: the segment's max over row elements by fmaxf (NaN ignored, -inf past the
// row), and a sum of exps that is NaN exactly when the segment holds a NaN or a +inf (against a
// running reference that is then +inf, +inf - +inf is NaN; every other exp is finite or 0).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/argmax_track.h"

namespace {

constexpr int kVec = 8;

// torch.argmax over row[0, V): the first NaN, else the first maximum; -1 for an empty row.
int64_t reference_argmax(const std::vector<float>& row) {
  int64_t best = -1;
  for (int64_t j = 0; j < static_cast<int64_t>(row.size()); ++j) {
    const float z = row[j];
    if (best < 0) {
      best = j;
      if (z != z) return j;
      continue;
    }
    if (z != z) return j;
    if (z > row[best]) best = j;
  }
  return best;
}

// One thread's view as in the kernel: segments of kVec elements, the row starting `off` elements
// into segment 0; the thread visits segments first, first + step, ... The result merges the
// threads' answers with the kernel's rule (argmax_better in row_kernel.cuh).
int64_t tracked_argmax(const std::vector<float>& row, int off, int threads) {
  const int V = static_cast<int>(row.size());
  const int nseg = (V + off + kVec - 1) / kVec;
  auto value = [&](int sg, int e) {
    const int j = sg * kVec - off + e;
    return (j >= 0 && j < V) ? row[j] : -INFINITY;  // the fill value past the row
  };
  float best_v = -INFINITY;
  int64_t best_i = INT64_MAX;
  for (int tid = 0; tid < threads; ++tid) {
    fusedce::detail::SegmentArgmax a;
    for (int sg = tid; sg < nseg + 2; sg += threads) {  // a thread may also see segments past the row
      float segmax = -INFINITY;
      bool nan_or_inf = false;
      for (int e = 0; e < kVec; ++e) {
        const float z = value(sg, e);
        segmax = std::fmax(segmax, z);
        nan_or_inf |= (z != z) || z == INFINITY;
      }
      a.add(sg, sg < nseg, segmax, nan_or_inf ? NAN : 1.0f);
    }
    int i = -1;
    float v = -INFINITY;
    if (a.nan_seg >= 0) {
      for (int sg = a.nan_seg; sg < nseg && i < 0; sg += threads) {
        i = fusedce::detail::first_nan_in_segment<kVec>(sg * kVec - off, V, [&](int e) { return value(sg, e); });
      }
      v = NAN;
    }
    if (i < 0 && a.seg >= 0) {
      i = fusedce::detail::first_equal_in_segment<kVec>(a.seg * kVec - off, V, a.max,
                                                        [&](int e) { return value(a.seg, e); });
      v = a.max;
    }
    if (i < 0) continue;
    // argmax_better: NaN is the largest value; ties go to the lowest index.
    const bool vn = v != v, bn = best_v != best_v;
    const bool better = (vn || bn) ? (vn && (!bn || i < best_i)) : (v > best_v || (v == best_v && i < best_i));
    if (best_i == INT64_MAX || better) {
      best_v = v;
      best_i = i;
    }
  }
  return best_i == INT64_MAX ? -1 : best_i;
}

TEST(ArgmaxTrack, MatchesTorchArgmaxOnRowsWithTiesInfinitiesAndNaNs) {
  std::mt19937_64 rng(20261129);
  const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 3.0f, 3.0f, -1.0f};
  for (int trial = 0; trial < 20000; ++trial) {
    const int V = 1 + static_cast<int>(rng() % 200);
    const int off = static_cast<int>(rng() % kVec);
    const int threads = 1 + static_cast<int>(rng() % 5);
    std::vector<float> row(V);
    const int mode = static_cast<int>(rng() % 4);  // 0: few distinct values (ties); 1: specials; 2: all -inf; 3: normal
    for (int j = 0; j < V; ++j) {
      switch (mode) {
        case 0: row[j] = static_cast<float>(rng() % 4); break;
        case 1: row[j] = rng() % 6 == 0 ? specials[rng() % 8] : static_cast<float>(rng() % 7) - 3.0f; break;
        case 2: row[j] = -INFINITY; break;
        default: row[j] = std::ldexp(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000), -7); break;
      }
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + " V=" + std::to_string(V) + " off=" + std::to_string(off) +
                 " threads=" + std::to_string(threads) + " mode=" + std::to_string(mode));
    ASSERT_EQ(tracked_argmax(row, off, threads), reference_argmax(row));
  }
}

}  // namespace
