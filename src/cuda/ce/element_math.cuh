// Per-element and per-row math shared by the cross-entropy kernels (the row kernel, the stream
// kernel, the one-block passes): the logit transform (scale, soft-cap), exps and gradients of one
// element or segment, the merge of two partial row statistics, and the one writer of a row's
// forward results. One definition for every path, so the paths give the same bits.
#pragma once

#include "cuda/port.h"  // first: the platform's runtime header (HIP defines __host__ there)

#include <cfloat>
#include <cstdint>

#include "common/numeric.h"
#include "cuda/ce/params.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exps are taken as 2^(z log2 e)
constexpr float kLog2eLo = 1.9259629891e-8f;  // log2(e) - kLog2e: the float constant's error

__device__ __forceinline__ bool argmax_better(float av, int64_t ai, float bv, int64_t bi) {
  // torch.argmax: NaN is the largest value; ties go to the lowest index.
  const bool an = av != av, bn = bv != bv;
  if (an || bn) return an && (!bn || ai < bi);
  return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ RowPartial merge_partial(const RowPartial& a, const RowPartial& b, bool metrics) {
  RowPartial r;
  r.st = detail::lse_merge(a.st, b.st);
  r.smooth = a.smooth + b.smooth;
  r.z_target = a.has_target ? a.z_target : b.z_target;
  r.has_target = a.has_target | b.has_target;
  if (metrics && argmax_better(b.amax_v, b.amax_i, a.amax_v, a.amax_i)) {
    r.amax_v = b.amax_v;
    r.amax_i = b.amax_i;
  } else {
    r.amax_v = a.amax_v;
    r.amax_i = a.amax_i;
  }
  return r;
}

/// A row's forward results from its merged statistics `r`: the loss, lse (when asked), entropy
/// and correct flag (metrics). One writer per row; the stream, split-merge and row passes share it.
__device__ __forceinline__ void write_row_results(const RowParams& p, int64_t row, const RowPartial& r, float lse,
                                                  float z_t, const detail::LossConstants& c, float w_t, int64_t t,
                                                  bool weighted, bool metrics) {
  p.row_loss[row * p.row_loss_stride] = detail::row_loss(c, lse, z_t, w_t, r.smooth, weighted);
  if (p.lse_out) p.lse_out[row * p.lse_stride] = lse;
  if (metrics) {
    p.row_entropy[row] = lse - r.st.ez / r.st.s;
    p.row_correct[row] = r.amax_i == t ? 1 : 0;  // t: -1 for a bad target
  }
}

/// Lane + delta's partial. Fields a caller does not use are not shuffled: the argmax only with
/// metrics, the target logit only where a thread (not a global load) found it.
__device__ __forceinline__ RowPartial shfl_down_partial(const RowPartial& p, int delta, bool metrics, bool target) {
  RowPartial r = p;
  r.st.m = shfl_down(p.st.m, delta);
  r.st.s = shfl_down(p.st.s, delta);
  if (metrics) r.st.ez = shfl_down(p.st.ez, delta);
  r.smooth = shfl_down(p.smooth, delta);
  if (metrics) {
    r.amax_v = shfl_down(p.amax_v, delta);
    r.amax_i = shfl_down(p.amax_i, delta);
  }
  if (target) {
    r.z_target = shfl_down(p.z_target, delta);
    r.has_target = shfl_down(p.has_target, delta);
  }
  return r;
}

// The options' per-element arithmetic below is written with explicit roundings (__fmul_rn, fmaf):
// the compiler may not contract it differently in the stream and row kernels, so a backward call
// gives the bits of the forward-with-gradient.

/// tanh through one exp and one reciprocal: saturates at +-1, keeps NaN, absolute error ~1e-7.
__device__ __forceinline__ float softcap_tanh(float y) {
  return fmaf(-2.0f, rcp(ex2((2.0f * kLog2e) * y) + 1.0f), 1.0f);
}

__device__ __forceinline__ float transform(float x, const detail::LossConstants& c, bool softcap) {
  return softcap ? __fmul_rn(c.softcap, softcap_tanh(x * c.inv_softcap)) : __fmul_rn(x, c.logit_scale);
}

/// z = transform(x) and dz/dx with the tanh evaluated once (under the soft-cap dz/dx =
/// scale * (1 - tanh^2); no division, unlike detail::dz_dx, which recovers tanh from z).
struct ZSlope {
  float z, dzdx;
};
__device__ __forceinline__ ZSlope z_and_slope(float x, const detail::LossConstants& c, bool softcap) {
  if (!softcap) return ZSlope{__fmul_rn(x, c.logit_scale), c.logit_scale};
  const float th = softcap_tanh(x * c.inv_softcap);
  return ZSlope{__fmul_rn(c.softcap, th), __fmul_rn(c.logit_scale, fmaf(-th, th, 1.0f))};
}

/// exp(z - ref) for z = transform(x). Without softcap the difference is formed by one FMA from
/// the raw logit (x * scale - ref, rounded once) before the log2(e) factor, so logits of large
/// magnitude keep their precision; every kernel path uses this one formula, which keeps results
/// bit-identical whichever path (plain or with options) a call takes.
__device__ __forceinline__ float exp_rel(float x, float z, float ref, const detail::LossConstants& c, bool softcap) {
  return ex2((softcap ? z - ref : fmaf(x, c.logit_scale, -ref)) * kLog2e);
}

/// The plain path's probabilities in one FMA and one EX2 per element:
/// p = exp(x scale - lse) = 2^(x a - l) * factor, a = scale log2(e) and l = lse log2(e) rounded to
/// float. The FMA forms x a - l exactly before its one rounding, but a and l carry rounding
/// errors of their own: |x| a eps is 1e-3 at |x| ~ 1e4, far too much for fp32 gradients. Both
/// are constant across the row, so they are measured once per row (the error-free residuals of
/// the two products, plus log2(e)'s own error) and applied as one factor, evaluated at the
/// row's significant logits (x scale ~ lse, where p is not negligible): what remains is
/// (x scale - lse) times a's relative error, 1e-7 of an exponent that matters only while it is
/// small. One FMUL per element less than 2^((x scale - lse) log2(e)). Shared by the stream and
/// row kernels: backward and forward-with-gradient give the same bits.
struct PlainGradExp {
  float a, l, factor;
};
__device__ __forceinline__ PlainGradExp plain_grad_exp(float lse, const detail::LossConstants& c) {
  const float scale = c.logit_scale;
  const float a = __fmul_rn(scale, kLog2e);
  const float l = __fmul_rn(lse, kLog2e);
  // a - scale log2(e) and lse log2(e) - l, each to a few ulps of its (tiny) value.
  const float a_err = -fmaf(scale, kLog2eLo, fmaf(scale, kLog2e, -a));
  const float l_err = fmaf(lse, kLog2eLo, fmaf(lse, kLog2e, -l));
  // 2^(x scale log2e - lse log2e) = 2^(x a - l) 2^(-x a_err - l_err), x taken at lse / scale.
  const float kappa = fmaf(-__fdiv_rn(lse, scale), a_err, -l_err);
  return PlainGradExp{a, l, isfinite(kappa) ? ex2(kappa) : 1.0f};
}

/// dL/dx of one element on the options path (soft-cap, or per-class smoothing weights):
/// (g a p - g eps/V w_j - [j == t] g b_t) dz/dx; `bt` is 0 off the target, `wj` its class weight
/// (1 unweighted).
__device__ __forceinline__ float grad_elem(float x, float lse, const detail::RowGrad& rg, float wj, float bt,
                                           const detail::LossConstants& c, bool softcap) {
  const ZSlope zd = z_and_slope(x, c, softcap);
  const float pj = exp_rel(x, zd.z, lse, c, softcap);
  return __fmul_rn(fmaf(rg.g_a, pj, fmaf(-rg.g_c, wj, -bt)), zd.dzdx);
}

/// One segment's dlogits on the options path (the soft-cap's dz/dx, or per-class smoothing
/// weights); row elements j0 .. j0 + kVec - 1. The uniform conditions stay outside the element
/// loops: a per-element condition around the tanh made the compiler branch per element. Shared
/// by the stream and row kernels, so backward and forward-with-gradient give the same bits.
template <typename T>
__device__ __forceinline__ Segment<T> options_grad_segment(const Segment<T>& x, int j0, const RowParams& p,
                                                          float lse, const detail::RowGrad& rg,
                                                          const detail::LossConstants& c, bool softcap,
                                                          bool per_class_weights) {
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  float wj[kVec];
  if (per_class_weights) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int j = j0 + e;
      wj[e] = (j >= 0 && j < p.vocab) ? p.class_weight[int64_t(j) * p.weight_stride] : 0.0f;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) wj[e] = 1.0f;
  }
  Segment<T> out;
  if (softcap) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.e[e] = E::from_float(grad_elem(E::to_float(x.e[e]), lse, rg, wj[e], 0.0f, c, true));
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.e[e] = E::from_float(grad_elem(E::to_float(x.e[e]), lse, rg, wj[e], 0.0f, c, false));
  }
  return out;
}

__device__ __forceinline__ int64_t load_target_dev(const RowParams& p, int64_t row) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[row * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[row * p.target_stride]);
}

}  // namespace cuda
}  // namespace fusedce
