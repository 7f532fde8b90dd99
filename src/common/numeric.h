// Scalar building blocks shared by host and device code: 16-bit float conversions, the online
// log-sum-exp state and its merge, and the per-row loss / gradient formulas of docs/contract.md.
// Everything here is __host__ __device__ so the CPU backend, the CUDA kernels and the
// vocabulary-parallel merge all use one definition.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDCE_HD __host__ __device__ __forceinline__
#else
#define FUSEDCE_HD inline
#endif

namespace fusedce {
namespace detail {

FUSEDCE_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
FUSEDCE_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Storage-only 16-bit types of the host backend (the GPU code uses the cuda_bf16 / cuda_fp16
// types, or HIP's, with the same bit layout: see cuda/port.h).
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

FUSEDCE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN of the same sign.
FUSEDCE_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Branch-free (so loops over it vectorise): the half's exponent and mantissa shifted into a
// float's place land 112 below the right exponent; one exact multiply by 2^112 fixes normals
// and subnormals alike, and inf / NaN get the all-ones exponent back.
FUSEDCE_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  float mag = bits_float(em << 13) * bits_float(0x77800000u);  // * 2^112
  uint32_t bits = float_bits(mag);
  bits = em >= 0x7c00u ? (bits | 0x7f800000u) : bits;
  return bits_float(bits | sign);
}

// Round to nearest even, with overflow to inf, subnormals and NaN handled.
FUSEDCE_HD uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // >= 65520: inf
  if (a < 0x38800000u) {                                              // below 2^-14: subnormal
    // Adding 0.5 makes the FPU round the mantissa to the subnormal half grid (RNE).
    const float r = bits_float(a) + 0.5f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(float_bits(r) - 0x3f000000u));
  }
  uint32_t m = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(m >> 13));
}

/// Running (max, sum of exp(z - max)) of a set of logits, with the entropy helper
/// `ez = sum exp(z - max) * z` riding along. `m == -inf` means no finite logit so far; `s` is
/// then 0, or NaN if a NaN was seen. The max never holds NaN: NaN reaches the sums instead.
struct LseState {
  float m;
  float s;
  float ez;
};

FUSEDCE_HD LseState lse_empty() { return LseState{-INFINITY, 0.0f, 0.0f}; }

/// Merge two partial states. Associative up to rounding; the same function merges lanes,
/// vocabulary chunks, blocks of a split row, and ranks of a vocabulary-parallel group.
FUSEDCE_HD LseState lse_merge(const LseState& a, const LseState& b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) return LseState{m, a.s + b.s, a.ez + b.ez};
  // exp(-inf - m) == 0 keeps a NaN sum NaN (NaN * 0) and an empty one empty (0 * 0).
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  const float fa = __expf(a.m - m);  // the SFU: merges sit on the kernels' critical path
  const float fb = __expf(b.m - m);
#else
  const float fa = expf(a.m - m);
  const float fb = expf(b.m - m);
#endif
  return LseState{m, a.s * fa + b.s * fb, a.ez * fa + b.ez * fb};
}

/// A running LseState for folding many partials one after another (a row's chunks in order):
/// the sums are held in double and the rescale factor is taken in double, so a fold of K
/// partials adds no float32 rounding per step. In float32 each step rounds the running sum, and
/// a max that grows partial after partial rescales it by a float factor each time: the errors
/// compound with K (relative 1e-6 at a few thousand steps, growing with V). Here the result
/// carries its partials' own rounding (float32 level) whatever K is. Cost: a few double
/// operations per partial (the max rarely changes: the exp runs only when it does).
struct LseAccum {
  float m;
  double s;
  double ez;
};

FUSEDCE_HD LseAccum lse_accum_empty() { return LseAccum{-INFINITY, 0.0, 0.0}; }

/// Fold partial b into a; the same semantics as lse_merge (NaN stays NaN, empty stays empty).
FUSEDCE_HD void lse_accum_add(LseAccum& a, const LseState& b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) {
    a.s += b.s;
    a.ez += b.ez;
    return;
  }
  // exp(-inf) == 0: an empty side is scaled by 0 (a NaN sum stays NaN).
  const double fa = a.m == m ? 1.0 : exp(static_cast<double>(a.m) - static_cast<double>(m));
  const double fb = b.m == m ? 1.0 : exp(static_cast<double>(b.m) - static_cast<double>(m));
  a.m = m;
  a.s = a.s * fa + static_cast<double>(b.s) * fb;
  a.ez = a.ez * fa + static_cast<double>(b.ez) * fb;
}

/// The folded state rounded to float32 (for merging with other states, or storing).
FUSEDCE_HD LseState lse_accum_state(const LseAccum& a) {
  return LseState{a.m, static_cast<float>(a.s), static_cast<float>(a.ez)};
}

/// log-sum-exp of the fold, rounded once.
FUSEDCE_HD float lse_accum_value(const LseAccum& a) {
  return static_cast<float>(static_cast<double>(a.m) + log(a.s));
}

/// Entropy of the fold's distribution, lse - E[z], rounded once.
FUSEDCE_HD float lse_accum_entropy(const LseAccum& a) {
  return static_cast<float>(static_cast<double>(a.m) + log(a.s) - a.ez / a.s);
}

/// The reference a chunk's exps are taken against: its max, or 0 when that is -inf (then
/// exp(z - 0) is 0 for -inf entries and NaN for NaN ones, as wanted).
FUSEDCE_HD float lse_ref(float m) { return m == -INFINITY ? 0.0f : m; }

FUSEDCE_HD float lse_value(const LseState& st) { return st.m + logf(st.s); }

/// Host-precomputed per-call constants of the loss (docs/contract.md, "Per-row loss").
struct LossConstants {
  float one_minus_eps;  // 1 - label_smoothing
  float eps;            // label_smoothing
  float eps_over_v;     // label_smoothing / V
  float inv_v;          // 1 / V
  float z_loss;
  float logit_scale;
  float softcap;        // 0 = off
  float inv_softcap;    // logit_scale / softcap (the tanh argument's factor), 0 when off
  float weight_sum;     // sum of class weights (1 per class when none given: V)
};

/// z from a raw logit x: scale, then the optional tanh soft-cap.
FUSEDCE_HD float transform_logit(float x, const LossConstants& c, bool softcap) {
  return softcap ? c.softcap * tanhf(x * c.inv_softcap) : x * c.logit_scale;
}

/// dz/dx, from z itself (so the tanh is not evaluated twice).
FUSEDCE_HD float dz_dx(float z, const LossConstants& c, bool softcap) {
  if (!softcap) return c.logit_scale;
  const float t = z / c.softcap;
  return c.logit_scale * (1.0f - t * t);
}

/// Per-row loss (docs/contract.md, "Per-row loss"): (1-eps) * w_t * (lse - z_t) + smoothing +
/// z_loss * lse^2.
/// `smooth_sum` is sum_j z_j (unweighted) or sum_j w_j z_j (weighted). Terms whose factor is 0
/// are left out, so an infinite lse does not turn them into NaN.
FUSEDCE_HD float row_loss(const LossConstants& c, float lse, float z_t, float w_t,
                          float smooth_sum, bool weighted) {
  float loss = c.one_minus_eps * w_t * (lse - z_t);
  if (c.eps != 0.0f) {
    loss += weighted ? c.eps_over_v * (c.weight_sum * lse - smooth_sum)
                     : c.eps * (lse - smooth_sum * c.inv_v);
  }
  if (c.z_loss != 0.0f) loss += c.z_loss * lse * lse;
  return loss;
}

/// Gradient coefficients of a row: dL/dz_j = g * (a * p_j - [j == t] * b_t - w_j * eps / V),
/// with p_j = exp(z_j - lse).
struct RowGrad {
  float g_a;  // g * a, a = (1-eps) w_t + (eps/V) W + 2 z_loss lse
  float g_bt; // g * (1-eps) * w_t
  float g_c;  // g * eps / V (times w_j per class when weighted)
};

FUSEDCE_HD RowGrad row_grad(const LossConstants& c, float lse, float w_t, float g) {
  float a = c.one_minus_eps * w_t + c.eps_over_v * c.weight_sum;
  if (c.z_loss != 0.0f) a += 2.0f * c.z_loss * lse;
  return RowGrad{g * a, g * c.one_minus_eps * w_t, g * c.eps_over_v};
}

}  // namespace detail
}  // namespace fusedce
