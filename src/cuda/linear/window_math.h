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

/// A row's gradient in the window form. The loss's gradient over z is ga p - gb onehot_t (ga = g a,
/// a = w_t + 2 z_loss lse: the z-loss's share rides the softmax; gb = g w_t; row_grad in
/// common/numeric.h) and p = E / S in the frame of K, so the row's dlogits are r (c E - d onehot_t)
/// with the target's entry rewritten to c E_t - d:
///  - r = ga / S, c = 1, d = S gb / ga while |ga| >= |gb| kLeastShare (|d| <= 2^8 S: a finite
///    bf16; with no z-loss ga = gb and d = S, the entry E_t - S);
///  - else (the z-loss's pull cancels the likelihood's: a near 0) r = gb / S and the row scaled by
///    c = ga / gb (the rebase applies it), d = S: every entry stays finite however small a is;
///  - gb = 0 (a class weight of 0, or g = 0): r = ga / S, no target term.
struct RowFactor {
  float r, rescale, shift;
};
constexpr float kLeastShare = 1.0f / 256.0f;
FUSEDCE_HD RowFactor row_factor(float ga, float gb, float S) {
  if (gb == 0.0f) return {ga / S, 1.0f, 0.0f};
  if (fabsf(ga) >= fabsf(gb) * kLeastShare) return {ga / S, 1.0f, S * (gb / ga)};
  return {gb / S, ga / gb, S};
}

/// The soft-cap's per-entry factor of dz/dx (the scale rides r): 1 - (z / c)^2 for the capped
/// logit z, 1 without the cap (c = 0). The stored entries carry it; so does the target's.
FUSEDCE_HD float cap_factor(float z, float c) {
  if (c == 0.0f) return 1.0f;
  const float u = z / c;
  return fmaf(-u, u, 1.0f);
}

/// The target's entry of the stored matrix in the frame of K, (c 2^(z_t log2 e - K) - d) times the
/// soft-cap's factor (row_factor's c and d; cap: the soft-cap, 0 off), from the exact logit z_t.
FUSEDCE_HD float target_entry(float zt, float K, const RowFactor& f, float cap) {
  return (f.rescale * exp2f(fmaf(zt, kLog2e, -K)) - f.shift) * cap_factor(zt, cap);
}

/// A float as two bf16 values, hi = bf16(x) and lo = bf16(x - hi): their sum is within 2^-17 |x|
/// of x (x - hi is exact in float32, lo rounds it to 8 bits).
struct Split {
  float hi, lo;
};
FUSEDCE_HD Split split_bf16(float x) {
  const float hi = detail::bf16_to_float(detail::float_to_bf16(x));
  return {hi, detail::bf16_to_float(detail::float_to_bf16(x - hi))};
}

/// Label smoothing's uniform term in the window form. The row's dlogits over raw logits are
/// r (c E - d onehot_t) + q_i v_j: v_j the class weight (1 without), q_i = -scale g eps / V
/// (row_grad's g_c; 0 for an ignored row). Its share of grad_weight is v u^T with u = sum_i q_i h_i,
/// of grad_bias v sum_i q_i, of grad_hidden q_i sum_j v_j w_j. The products carry the first two
/// as kSmoothRows extra rows of their K: row k of E's extra rows holds part(v, k, true), the same
/// row of the other operand part(u, k, false), so that the K sum adds v_hi u_hi + v_hi u_lo +
/// v_lo u_hi = v u within about 2^-16 |v u| (the dropped v_lo u_lo is 2^-18 of it).
FUSEDCE_HD float smooth_part(const Split& s, int k, bool e_side) {
  return e_side ? (k < 2 ? s.hi : s.lo) : (k == 1 ? s.lo : s.hi);
}

/// The row's sum of the scaled logits over the vocabulary, weighted by v: scale (h . sum_j v_j
/// w_j + sum_j v_j b_j) (no soft-cap: z is linear in h), from the precomputed vector.
FUSEDCE_HD float smooth_sum(float scale, float h_dot_vw, float vb) { return scale * (h_dot_vw + vb); }

}  // namespace window_math
}  // namespace cuda
}  // namespace fusedce
