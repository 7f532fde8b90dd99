// The window form's per-row arithmetic (window_kernels.cu's merge, window_forward.cu's argmax
// order), as host-and-device functions so that the CPU tests check the same formulas against
// float64 (tests/cpp/test_window_math.cpp). Plain C++.
#pragma once

#include <cmath>

#include "common/numeric.h"
#include "cuda/linear/window_plan.h"

namespace fusedce {
namespace cuda {
namespace window_math {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

/// torch.argmax's order: a NaN before any number, then the larger value, then the lower column.
FUSEDCE_HD bool ahead(float v, int i, float w, int j) {
  const bool nv = v != v, nw = w != w;
  if (nv != nw) return nv;
  if (!nv && v != w) return v > w;
  return i < j;
}

/// A tile's factor into the row's frame K (the largest offset any tile took): 2^(k_t - K), an
/// integer power of two, exact.
FUSEDCE_HD float factor(float m, float K) { return exp2f(window_offset(m) - K); }

/// The row's lse from K and S = sum_t factor_t S_t (natural log).
FUSEDCE_HD float lse(float K, float S) { return kLn2 * (K + log2f(S)); }

/// The row's entropy from the centred partials: U = sum_t f_t Uc_t, C = sum_t f_t S_t (Mx - m_t),
/// Mx the largest own offset: ln(S 2^(K - Mx)) + (ln 2 C - U) / S, every term of both sums >= 0
/// up to rounding (Uc_t <= 0 per tile: z log2 e <= m_t), so nothing cancels.
FUSEDCE_HD float entropy(float S, float K, float Mx, float C, float U) {
  return logf(ldexpf(S, static_cast<int>(K - Mx))) + (kLn2 * C - U) / S;
}

/// The target's entry of E in the frame of K, so that r times it is g (p_t - 1): 2^(z_t log2 e -
/// K) - S, from the exact logit z_t (|value| <= S <= V: a finite bf16).
FUSEDCE_HD float target_entry(float zt, float K, float S) { return exp2f(fmaf(zt, kLog2e, -K)) - S; }

}  // namespace window_math
}  // namespace cuda
}  // namespace fusedce
