// The streaming kernel's argmax (metrics), per thread, with torch.argmax's rules: the first NaN,
// else the first maximum (ties go to the lowest index). A thread visits its elements in
// increasing index, a segment (kVec elements) at a time. Tracking per element costs a divergent
// branch whenever some lane's max grows (early in a row, nearly every segment); per segment it is
// a few selects, and the element is found once per item by re-reading at most the few segments
// named here. Host and device code: the CPU tests check it against a direct argmax.
#pragma once

#include <cmath>

#include "common/numeric.h"

namespace fusedce {
namespace detail {

struct SegmentArgmax {
  int seg = -1;      // the segment holding the first largest max (-1: none yet)
  int nan_seg = -1;  // the first segment whose sum of exps was NaN (-1: none)
  float max = -INFINITY;

  /// Segment `sg`, the thread's next in increasing order. `in_row`: it holds row elements (the
  /// first one that does is the answer while every max is -inf). `segmax`: its max over the row's
  /// elements (fmaxf: NaN ignored; -inf past the row). `segsum`: its sum of exps, NaN when it
  /// holds a NaN (or a +inf, whose exp against a +inf reference is NaN too).
  FUSEDCE_HD void add(int sg, bool in_row, float segmax, float segsum) {
    const bool better = segmax > max || (seg < 0 && in_row);
    max = better ? segmax : max;
    seg = better ? sg : seg;
    nan_seg = (nan_seg < 0 && segsum != segsum) ? sg : nan_seg;
  }
};

/// In one segment of kVec values (element e at row index j0 + e, those outside [0, V) ignored):
/// the first NaN. Returns its index, or -1.
template <int kVec, typename ValueAt>
FUSEDCE_HD int first_nan_in_segment(int j0, int V, ValueAt value_at) {
  int found = -1;
  for (int e = kVec - 1; e >= 0; --e) {  // backwards without a break: the first one wins
    const int j = j0 + e;
    const float z = value_at(e);
    if (j >= 0 && j < V && z != z) found = j;
  }
  return found;
}

/// In one segment: the first element equal to `max`, or -1.
template <int kVec, typename ValueAt>
FUSEDCE_HD int first_equal_in_segment(int j0, int V, float max, ValueAt value_at) {
  int found = -1;
  for (int e = kVec - 1; e >= 0; --e) {
    const int j = j0 + e;
    if (j >= 0 && j < V && value_at(e) == max) found = j;
  }
  return found;
}

}  // namespace detail
}  // namespace fusedce
