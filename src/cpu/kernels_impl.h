// CPU row kernels of cross-entropy and of the per-token log-probabilities over logits, compiled
// once per instruction set (the file that includes this defines FUSEDCE_CPU_ISA, the namespace,
// and its own compiler flags).
//
// What is fused: per row, one read of the logits from memory, in chunks of kChunk elements
// staged as float32 in an L1-resident buffer (plain float32 chunks are read in place); the
// chunk's max, its sum of exps, the target logit, the smoothing sum, argmax and entropy terms
// are taken from that chunk and merged into the
// row's running state (online log-sum-exp, no second pass over memory for the max). The gradient
// sweep re-reads the row (from cache for rows up to a few hundred KB) and writes dlogits once.
// Nothing of size N x V is stored besides dlogits itself.
//
// Summation error: within a chunk, kLanes lanes (8, or 16 for AVX-512) each add kChunk / kLanes
// terms (256 or 128) in float32; the row's chunks fold into a double accumulator
// (detail::LseAccum), so the error stays that of one chunk's float32 sums whatever V is (a
// float32 fold of 2^17 chunks at V = 2^28 compounds to a relative 5e-6 in the loss of an
// ascending row).
#ifndef FUSEDCE_CPU_ISA
#error "define FUSEDCE_CPU_ISA before including kernels_impl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu/kernels.h"

namespace fusedce {
namespace cpu {
namespace FUSEDCE_CPU_ISA {
namespace {

using detail::bf16_t;
using detail::fp16_t;
using detail::LossConstants;
using detail::LseState;
using detail::RowGrad;

typedef float v8f __attribute__((vector_size(32)));

// The row kernels' vector: FUSEDCE_CPU_LANES floats (8 unless the including file says 16).
#ifndef FUSEDCE_CPU_LANES
#define FUSEDCE_CPU_LANES 8
#endif
constexpr int kLanes = FUSEDCE_CPU_LANES;
typedef float vf __attribute__((vector_size(4 * FUSEDCE_CPU_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * FUSEDCE_CPU_LANES)));

constexpr int64_t kChunk = 2048;  // floats staged per chunk: 8 KB, stays in L1
constexpr float kInf = std::numeric_limits<float>::infinity();

inline v8f load8(const float* p) {
  v8f v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof(v)); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

inline float hsum(v8f v) {
  // A fixed pairwise order, so results do not depend on how rows are spread over threads.
  const float a = (v[0] + v[4]) + (v[2] + v[6]);
  const float b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

inline vf loadv(const float* p) {
  vf v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { memcpy(p, &v, sizeof(v)); }
// x in every lane, bit for bit (-0 and NaN payloads kept): an integer vector op with a scalar,
// which compiles to one broadcast (a loop over lanes compiled to one masked insert per lane).
inline vf splatv(float x) {
  int32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  const vi b = vi{} + bits;
  vf v;
  memcpy(&v, &b, sizeof(v));
  return v;
}

// hsum of the row kernels' vector: 16 lanes fold to 8 first, then the 8-lane tree.
inline float hsumv(vf v) {
  v8f h;
  for (int k = 0; k < 8; ++k) h[k] = kLanes == 16 ? v[k] + v[(k + 8) % kLanes] : v[k];
  return hsum(h);
}
inline float hmaxv(vf v) {
  float m = v[0];
  for (int k = 1; k < kLanes; ++k) m = v[k] > m ? v[k] : m;
  return m;
}

// exp(x) lane by lane: x = k ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 minimax polynomial
// (relative error 1.9e-9 on that interval, below float32's rounding), 2^k built in the exponent
// bits. Below -87.3 (float's smallest normal) the result is 0, -inf gives 0, NaN stays NaN (it
// runs through r, the polynomial and the final product, and NaN times any scale is NaN). Written
// with vector extensions so it compiles to whatever width the instruction set has, and gives the
// same bits on all of them.
// kSubnormal keeps the subnormal results (down to -103.97, where exp rounds to 0) as std::exp
// does: 2^k is applied in two halves, each a normal float, so the result is rounded once. It
// costs a multiply per lane; the log-probabilities need it (a collapsed row's r and entropy are
// sums of such values), the cross-entropy does not (they vanish against the max's 1).
// kNonPositive: the caller guarantees x <= 0 or NaN (z - max of a chunk), so the clamp at the
// top of the range is left out.
template <bool kSubnormal = false, bool kNonPositive = false>
inline vf vexp(vf x) {
  const vf lo = splatv(kSubnormal ? -103.972077f : -87.33654f);
  vf xc = x < lo ? lo : x;
  if (!kNonPositive) {
    const vf hi = splatv(88.37626f);
    xc = xc > hi ? hi : xc;
  }
  // 1.5 * 2^23: adding it rounds to an integer, which then sits in the sum's low mantissa bits.
  constexpr int32_t kShifterBits = 0x4B400000;
  const vf shifter = splatv(12582912.0f);
  const vf shifted = xc * splatv(1.44269504f) + shifter;
  const vf kf = shifted - shifter;
  vf r = xc - kf * splatv(0.693145752f);
  r = r - kf * splatv(1.42860677e-6f);
  vf p = splatv(1.38368446e-3f);
  p = p * r + splatv(8.37481581e-3f);
  p = p * r + splatv(4.16682251e-2f);
  p = p * r + splatv(1.66664198e-1f);
  p = p * r + splatv(4.99999911e-1f);
  p = p * r + splatv(1.0f);
  p = p * r + splatv(1.0f);
  vi ki;
  memcpy(&ki, &shifted, sizeof(ki));
  ki -= kShifterBits;  // k exactly, |k| <= 150
  vf res;
  if (kSubnormal) {
    const vi k1 = ki >> 1, k2 = ki - k1;  // k in [-150, 128]: both halves in [-75, 64]
    const vi b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
    vf s1, s2;
    memcpy(&s1, &b1, sizeof(s1));
    memcpy(&s2, &b2, sizeof(s2));
    res = (p * s1) * s2;
  } else {
    const vi bits = (ki + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof(scale));
    res = p * scale;
  }
  return x < lo ? splatv(0.0f) : res;
}

// tanh(y) = 1 - 2 / (exp(2y) + 1): saturates cleanly at +-1 and keeps NaN; absolute error about
// 1e-7, i.e. at the rounding level of the capped logit it produces.
inline vf vtanh(vf y) { return splatv(1.0f) - splatv(2.0f) / (vexp(y + y) + splatv(1.0f)); }

// ---- staging a chunk of one row as float32 --------------------------------------------------

inline void load_chunk(const float* x, int64_t n, float* buf) { memcpy(buf, x, n * sizeof(float)); }

inline void load_chunk(const bf16_t* x, int64_t n, float* buf) {
  for (int64_t k = 0; k < n; ++k) buf[k] = detail::bits_float(static_cast<uint32_t>(x[k].bits) << 16);
}

inline void load_chunk(const fp16_t* x, int64_t n, float* buf) {
  int64_t k = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; k + 8 <= n; k += 8) {
    _mm256_storeu_ps(buf + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k))));
  }
#endif
  for (; k < n; ++k) buf[k] = detail::fp16_to_float(x[k].bits);
}

inline void store_chunk(const float* buf, int64_t n, float* y) { memcpy(y, buf, n * sizeof(float)); }

inline void store_chunk(const float* buf, int64_t n, bf16_t* y) {
  for (int64_t k = 0; k < n; ++k) y[k].bits = detail::float_to_bf16(buf[k]);
}

inline void store_chunk(const float* buf, int64_t n, fp16_t* y) {
  int64_t k = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; k + 8 <= n; k += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + k),
                     _mm256_cvtps_ph(_mm256_loadu_ps(buf + k), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; k < n; ++k) y[k].bits = detail::float_to_fp16(buf[k]);
}

inline int64_t round_up_lanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// buf[0:n8) *= s (n8 a multiple of kLanes; the buffer has room).
inline void scale_chunk(float* buf, int64_t n8, float s) {
  if (s == 1.0f) return;
  for (int64_t k = 0; k < n8; k += kLanes) storev(buf + k, loadv(buf + k) * splatv(s));
}

// x -> z in place over the first n8 entries (n8 a multiple of kLanes; the buffer has room).
template <bool kSoftcap>
inline void transform_chunk(float* buf, int64_t n8, const LossConstants& c) {
  if (kSoftcap) {
    for (int64_t k = 0; k < n8; k += kLanes) {
      storev(buf + k, splatv(c.softcap) * vtanh(loadv(buf + k) * splatv(c.inv_softcap)));
    }
  } else {
    scale_chunk(buf, n8, c.logit_scale);
  }
}

// Sum (or weighted sum with w) of the first n entries; the tail is padded into a vector so the
// order of additions is fixed.
inline float chunk_sum(const float* buf, const float* w, int64_t n) {
  vf acc = splatv(0.0f);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) acc += w ? loadv(buf + k) * loadv(w + k) : loadv(buf + k);
  if (k < n) {
    float z[kLanes] = {}, ww[kLanes];
    for (float& x : ww) x = 1.0f;
    memcpy(z, buf + k, (n - k) * sizeof(float));
    if (w) memcpy(ww, w + k, (n - k) * sizeof(float));
    acc += loadv(z) * loadv(ww);
  }
  return hsumv(acc);
}

// Max of buf[0:n8) (n8 a multiple of kLanes), NaN entries passed over. Four running maxima, so
// the loop is bound by loads rather than by the latency of one chain of max instructions.
inline float chunk_max(const float* buf, int64_t n8) {
  vf m0 = splatv(-kInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t k = 0;
  for (; k + 4 * kLanes <= n8; k += 4 * kLanes) {
    const vf v0 = loadv(buf + k), v1 = loadv(buf + k + kLanes);
    const vf v2 = loadv(buf + k + 2 * kLanes), v3 = loadv(buf + k + 3 * kLanes);
    m0 = v0 > m0 ? v0 : m0;
    m1 = v1 > m1 ? v1 : m1;
    m2 = v2 > m2 ? v2 : m2;
    m3 = v3 > m3 ? v3 : m3;
  }
  for (; k < n8; k += kLanes) {
    const vf v = loadv(buf + k);
    m0 = v > m0 ? v : m0;
  }
  m0 = m1 > m0 ? m1 : m0;
  m2 = m3 > m2 ? m3 : m2;
  return hmaxv(m2 > m0 ? m2 : m0);
}

// The chunk's partial state against reference ref: s = sum exp(z - ref), ez = sum exp(z - ref) z.
template <bool kEntropy>
inline LseState chunk_state(const float* buf, int64_t n8, float max) {
  const float ref = detail::lse_ref(max);
  vf s = splatv(0.0f), ez = splatv(0.0f);
  for (int64_t k = 0; k < n8; k += kLanes) {
    const vf z = loadv(buf + k);
    const vf e = vexp<false, true>(z - splatv(ref));  // z <= max (or NaN): z - ref <= 0
    s += e;
    // e == 0 at z == -inf: the term is 0, not 0 * -inf.
    if (kEntropy) ez += e > splatv(0.0f) ? e * z : splatv(0.0f);
  }
  return LseState{max, hsumv(s), kEntropy ? hsumv(ez) : 0.0f};
}

struct RowStats {
  detail::LseAccum st;
  float z_target;
  float smooth_sum;  // sum_j z_j, or sum_j w_j z_j with class weights
  int64_t argmax;
  float best;        // z at argmax (NaN when the row holds a NaN)
};

// z of one chunk for the forward sweep, n8 entries with the padding past n at -inf (neutral for
// the max and the exp sums). float32 logits that need no transform and fill whole vectors are
// read where they lie (the staging copy would be a third pass over the chunk); everything else
// is converted, transformed and padded in buf.
template <typename T, bool kSoftcap>
inline const float* forward_chunk(const T* x, int64_t n, int64_t n8, const LossConstants& c, float* buf) {
  if constexpr (std::is_same<T, float>::value && !kSoftcap) {
    if (n == n8 && c.logit_scale == 1.0f) return x;
  }
  load_chunk(x, n, buf);
  transform_chunk<kSoftcap>(buf, n8, c);
  for (int64_t k = n; k < n8; ++k) buf[k] = -kInf;
  return buf;
}

// Forward sweep over one row: reads each logit once.
template <typename T, bool kSoftcap>
RowStats row_forward(const RowArgs& a, const T* x, int64_t t, float* buf) {
  const int64_t V = a.vocab;
  detail::LseAccum st = detail::lse_accum_empty();
  double smooth = 0.0;
  float z_target = 0.0f, best = -kInf;
  int64_t argmax = 0;
  for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
    const int64_t n = std::min(kChunk, V - j0), n8 = round_up_lanes(n);
    const float* z = forward_chunk<T, kSoftcap>(x + j0, n, n8, a.c, buf);
    if (t >= j0 && t < j0 + n) z_target = z[t - j0];
    if (a.smoothing) smooth += chunk_sum(z, a.class_weight ? a.class_weight + j0 : nullptr, n);
    const float cmax = chunk_max(z, n8);
    if (a.metrics) {
      if (cmax > best) {  // strict: ties keep the lowest index
        best = cmax;
        argmax = j0 + (std::find(z, z + n, cmax) - z);
      }
      detail::lse_accum_add(st, chunk_state<true>(z, n8, cmax));
    } else {
      detail::lse_accum_add(st, chunk_state<false>(z, n8, cmax));
    }
  }
  if (a.metrics && st.s != st.s) {
    // torch.argmax counts NaN as the largest value: find the first one (rare path).
    for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
      const int64_t n = std::min(kChunk, V - j0);
      load_chunk(x + j0, n, buf);
      transform_chunk<kSoftcap>(buf, round_up_lanes(n), a.c);
      const float* nan = std::find_if(buf, buf + n, [](float v) { return v != v; });
      if (nan != buf + n) {
        argmax = j0 + (nan - buf);
        best = NAN;
        break;
      }
    }
  }
  return RowStats{st, z_target, static_cast<float>(smooth), argmax, best};
}

// Gradient sweep over one row: dx_j = g (a p_j - [j == t] b_t - c w_j) dz_j/dx_j.
template <typename T, bool kSoftcap>
void row_gradient(const RowArgs& a, const T* x, T* dx, int64_t t, float lse, const RowGrad& rg,
                  float* buf) {
  const int64_t V = a.vocab;
  const LossConstants& c = a.c;
  const vf g_a = splatv(rg.g_a), g_c = splatv(rg.g_c), lse_v = splatv(lse), one = splatv(1.0f);
  const vf scale = splatv(c.logit_scale), inv_cap = splatv(1.0f / c.softcap);
  for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
    const int64_t n = std::min(kChunk, V - j0), n8 = round_up_lanes(n);
    load_chunk(x + j0, n, buf);
    for (int64_t k = n; k < n8; ++k) buf[k] = 0.0f;
    transform_chunk<kSoftcap>(buf, n8, c);
    const bool has_target = t >= j0 && t < j0 + n;
    const float z_t = has_target ? buf[t - j0] : 0.0f;
    for (int64_t k = 0; k < n8; k += kLanes) {
      const vf z = loadv(buf + k);
      vf w = one;
      if (a.class_weight) {
        if (k + kLanes <= n) {
          w = loadv(a.class_weight + j0 + k);
        } else {
          float tail[kLanes] = {};
          memcpy(tail, a.class_weight + j0 + k, (n - k) * sizeof(float));
          w = loadv(tail);
        }
      }
      vf d = g_a * vexp(z - lse_v) - g_c * w;
      if (kSoftcap) {
        const vf u = z * inv_cap;
        d *= scale * (one - u * u);
      } else {
        d *= scale;
      }
      storev(buf + k, d);
    }
    if (has_target) {
      const float w_t = a.class_weight ? a.class_weight[t] : 1.0f;
      const float p_t = vexp(splatv(z_t - lse))[0];
      buf[t - j0] = (rg.g_a * p_t - rg.g_bt - rg.g_c * w_t) * detail::dz_dx(z_t, c, kSoftcap);
    }
    store_chunk(buf, n, dx + j0);
  }
}

template <typename T>
void zero_row(T* dx, int64_t V) {
  memset(static_cast<void*>(dx), 0, V * sizeof(T));
}

template <typename T, bool kSoftcap>
void process_rows_t(const RowArgs& a, int64_t row_begin, int64_t row_end) {
  alignas(64) float buf[kChunk + kLanes];
  const T* logits = reinterpret_cast<const T*>(a.logits);
  T* dlogits = reinterpret_cast<T*>(a.dlogits);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const int64_t t = load_target(a.target, a.target_dtype, a.target_stride, i);
    const T* x = logits + i * a.logits_stride;
    T* dx = a.gradient ? dlogits + i * a.dlogits_stride : nullptr;
    if (t == a.ignore_index) {
      if (a.partial_out) {
        float* o = a.partial_out + i * kShardStatsWidth;
        for (int k = 0; k < kShardStatsWidth; ++k) o[k] = 0.0f;
        continue;
      }
      if (a.forward) {
        a.row_loss[i] = 0.0f;
        if (a.row_lse) a.row_lse[i] = 0.0f;
        if (a.metrics) {
          a.row_entropy[i] = 0.0f;
          a.row_correct[i] = 0;
        }
      }
      if (a.gradient) zero_row(dx, a.vocab);
      continue;
    }
    // Index in this row's columns (a shard's target may lie in another shard: no target term).
    const int64_t tl = t - a.target_offset;
    const bool holds_t = tl >= 0 && tl < a.vocab;
    const float w_t = a.w_t_in ? a.w_t_in[i] : (a.class_weight && holds_t ? a.class_weight[tl] : 1.0f);
    float lse;
    if (a.partial_out) {
      // Shard statistics: the row's partial state, merged across shards by the caller.
      const RowStats rs = row_forward<T, kSoftcap>(a, x, tl, buf);
      float* o = a.partial_out + i * kShardStatsWidth;
      const LseState st = detail::lse_accum_state(rs.st);
      o[0] = st.m;
      o[1] = st.s;
      o[2] = st.ez;
      o[3] = holds_t ? rs.z_target : 0.0f;
      o[4] = holds_t ? 1.0f : 0.0f;
      o[5] = rs.smooth_sum;
      o[6] = rs.best;
      const int32_t gi = static_cast<int32_t>(rs.argmax + a.target_offset);
      memcpy(&o[7], &gi, sizeof(gi));
      o[8] = holds_t ? w_t : 0.0f;
      continue;
    }
    if (a.forward) {
      const RowStats rs = row_forward<T, kSoftcap>(a, x, t, buf);
      lse = detail::lse_accum_value(rs.st);
      a.row_loss[i] = detail::row_loss(a.c, lse, rs.z_target, w_t, rs.smooth_sum, a.class_weight != nullptr);
      if (a.row_lse) a.row_lse[i] = lse;
      if (a.metrics) {
        a.row_entropy[i] = detail::lse_accum_entropy(rs.st);
        a.row_correct[i] = rs.argmax == t ? 1 : 0;
      }
    } else {
      lse = a.lse_in[i * a.lse_in_stride];
    }
    if (a.gradient) {
      const float g = a.g_chain * (a.grad_loss ? a.grad_loss[a.grad_scalar ? 0 : i * a.grad_stride] : 1.0f);
      row_gradient<T, kSoftcap>(a, x, dx, tl, lse, detail::row_grad(a.c, lse, w_t, g), buf);
    }
  }
}

template <typename T>
void process_rows_dtype(const RowArgs& a, int64_t row_begin, int64_t row_end) {
  if (a.softcap) {
    process_rows_t<T, true>(a, row_begin, row_end);
  } else {
    process_rows_t<T, false>(a, row_begin, row_end);
  }
}

template <typename T>
void rescale_rows_t(const RescaleArgs& a, int64_t row_begin, int64_t row_end) {
  alignas(64) float buf[kChunk + kLanes];
  T* base = reinterpret_cast<T*>(a.dlogits);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const float f = a.grad_loss[a.grad_scalar ? 0 : i * a.grad_stride];
    if (f == 1.0f) continue;
    T* row = base + i * a.stride;
    for (int64_t j0 = 0; j0 < a.vocab; j0 += kChunk) {
      const int64_t n = std::min(kChunk, a.vocab - j0);
      load_chunk(row + j0, n, buf);
      for (int64_t k = 0; k < n; ++k) buf[k] *= f;
      store_chunk(buf, n, row + j0);
    }
  }
}

// ---- per-token log-probabilities (fusedce/logprobs.h) -------------------------------------------
//
// The same staging, exp and fixed-order lane sums as the cross-entropy rows, over the state of
// common/logprob_math.h: a row's chunks give float32 states (m, r, u), folded into a double one in
// column order. r leaves out one instance of the max instead of subtracting 1 afterwards, so it
// keeps float32's relative precision when the row has collapsed onto its max (r far below
// float32's epsilon): entries equal to the chunk's max are counted (exp(0) is exactly 1) and the
// count less one is added, all other entries go through vexp. That vexp keeps subnormal results:
// past 87.3 nats of collapse, r, logprob_t and the entropy are themselves subnormal, and are
// still the sum of the entries' values.

// The log-probability state of buf[0:n8) (padding -inf): its max m, r = sum exp(z - m) over
// every entry but one instance of m, u = sum exp(z - m) (z - m), and with kSquares q = sum
// exp(2 (z - m)) over the entries r counts (else 0). A NaN entry makes r, u (and q) NaN.
template <bool kSquares>
inline detail::LpState<float> lp_chunk_state(const float* buf, int64_t n8) {
  const float m = chunk_max(buf, n8);  // NaN entries are passed over
  if (m == -kInf) {
    // No finite or +inf entry: the empty state, unless a NaN was passed over (rare path).
    for (int64_t k = 0; k < n8; ++k) {
      if (buf[k] != buf[k]) return detail::LpState<float>{m, NAN, NAN, NAN};
    }
    return detail::lp_empty<float>();
  }
  const vf mv = splatv(m), zero = splatv(0.0f);
  vf s = zero, u = zero, ties = zero, q = zero;
  for (int64_t k = 0; k < n8; k += kLanes) {
    const vf z = loadv(buf + k);
    const vf d = z - mv;
    const vf e = vexp<true>(d);
    const vi at_max = z == mv;
    s += at_max ? zero : e;  // a NaN lane is not at the max: it makes s NaN
    ties += at_max ? splatv(1.0f) : zero;
    // e == 0 (z = -inf, or below vexp's range) adds 0, not 0 * -inf; a NaN lane adds NaN.
    u += (at_max | (e == zero)) ? zero : e * d;
    if (kSquares) q += at_max ? zero : e * e;
  }
  // Ties of the max: exp(0) = 1 in r and in q alike, for every instance but one.
  const float extra = hsumv(ties) - 1.0f;
  return detail::LpState<float>{m, hsumv(s) + extra, hsumv(u), kSquares ? hsumv(q) + extra : 0.0f};
}

// Statistics of items [begin, end): each row read once, chunk by chunk.
template <typename T>
void lp_stats_rows_t(const LpRowArgs& a, int64_t begin, int64_t end) {
  alignas(64) float buf[kChunk + kLanes];
  const T* base = reinterpret_cast<const T*>(a.x);
  const int64_t V = a.vocab;
  for (int64_t k = begin; k < end; ++k) {
    const T* x = base + (a.rows ? a.rows[k] : k) * a.stride;
    const int64_t t = a.targets[k];
    LpRowStats out{detail::lp_empty<double>(), 0.0f, false, 0.0, -kInf};
    for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
      const int64_t n = std::min(kChunk, V - j0), n8 = round_up_lanes(n);
      load_chunk(x + j0, n, buf);
      scale_chunk(buf, n8, a.scale);
      if (t >= j0 && t < j0 + n) {
        out.z_t = buf[t - j0];
        out.holds = true;
      }
      for (int64_t q = n; q < n8; ++q) buf[q] = -kInf;  // neutral for the max and the sums
      if (!a.distribution_stats) {
        out.st = detail::lp_merge(out.st, lp_chunk_state<false>(buf, n8));
        continue;
      }
      const detail::LpState<float> cs = lp_chunk_state<true>(buf, n8);
      out.st = detail::lp_merge(out.st, cs);
      double zs = 0.0;
      for (int64_t q = 0; q < n; ++q) zs += buf[q];
      out.z_sum += zs;
      // The columns before the target (t is local: below 0, none here; past V, all of them).
      const int64_t before = std::min<int64_t>(std::max<int64_t>(t - j0, 0), n);
      if (before == n) {
        out.max_before = std::fmax(out.max_before, cs.m);  // the chunk's max (NaN passed over)
      } else {
        for (int64_t q = 0; q < before; ++q) out.max_before = std::fmax(out.max_before, buf[q]);
      }
    }
    a.stats[k] = out;
  }
}

// Gradient of items [begin, end): dx_j = scale * d/dz_j (g_lp logprob_t + g_H entropy), each row
// read and written once. Off the target, -p_j (g_lp + g_H (z_j - lse + H)) with p_j by vexp; at
// the target, from the forward's logprob (1 - p_t as -expm1: exact in collapse).
template <typename T>
void lp_grad_rows_t(const LpRowArgs& a, int64_t begin, int64_t end) {
  alignas(64) float buf[kChunk + kLanes];
  const T* xbase = reinterpret_cast<const T*>(a.x);
  T* dxbase = reinterpret_cast<T*>(a.dx);
  const int64_t V = a.vocab;
  const vf zero = splatv(0.0f), scale = splatv(a.scale);
  for (int64_t k = begin; k < end; ++k) {
    const int64_t row = a.rows ? a.rows[k] : k;
    const T* x = xbase + row * a.stride;
    T* dx = dxbase + row * a.dx_stride;
    const int64_t t = a.targets[k];
    const detail::LpRowGrad& g = a.grad[k];
    const vf lse = splatv(g.lse), glp = splatv(g.g_lp), gh = splatv(g.g_h), h = splatv(g.entropy);
    for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
      const int64_t n = std::min(kChunk, V - j0), n8 = round_up_lanes(n);
      load_chunk(x + j0, n, buf);
      for (int64_t q = n; q < n8; ++q) buf[q] = 0.0f;
      scale_chunk(buf, n8, a.scale);
      const bool has_target = t >= j0 && t < j0 + n;
      const float z_t = has_target ? buf[t - j0] : 0.0f;
      for (int64_t q = 0; q < n8; q += kLanes) {
        const vf d = loadv(buf + q) - lse;
        const vf p = vexp<true>(d);
        const vf dz = zero - p * (glp + gh * (d + h));
        storev(buf + q, (p == zero ? zero : dz) * scale);  // p = 0 (z = -inf too): 0, not 0 * -inf
      }
      if (has_target) buf[t - j0] = detail::lp_grad(g, z_t, true) * a.scale;
      store_chunk(buf, n, dx + j0);
    }
  }
}

// ---- dense tiles of the linear cross-entropy path ----------------------------------------------

inline float dot(const float* a, const float* b, int64_t n) {
  v8f acc = splat(0.0f);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) acc += load8(a + k) * load8(b + k);
  float tail = 0.0f;
  for (; k < n; ++k) tail += a[k] * b[k];
  return hsum(acc) + tail;
}

// y[0:n) += s * x[0:n)
inline void axpy(float s, const float* x, float* y, int64_t n) {
  int64_t k = 0;
  const v8f sv = splat(s);
  for (; k + 8 <= n; k += 8) store8(y + k, load8(y + k) + sv * load8(x + k));
  for (; k < n; ++k) y[k] += s * x[k];
}

// The three tile products of the linear path, register-blocked so that each load feeds several
// FMAs (a plain dot product or axpy per element pair is bound by loads at a quarter of the FMA
// rate). Every sum still runs in a fixed order, independent of threads.

// C (rc x vt) = A (rc x H) . B (vt x H)^T: blocks of 2 rows x 4 columns, 8 accumulators.
void tile_logits(const float* A, const float* B, int64_t rc, int64_t vt, int64_t H, float* C) {
  const int64_t H8 = H / 8 * 8;
  int64_t r = 0;
  for (; r + 2 <= rc; r += 2) {
    const float* a0 = A + r * H;
    const float* a1 = a0 + H;
    int64_t v = 0;
    for (; v + 4 <= vt; v += 4) {
      const float* b0 = B + v * H;
      const float* b1 = b0 + H;
      const float* b2 = b1 + H;
      const float* b3 = b2 + H;
      v8f c00 = splat(0.0f), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
      for (int64_t k = 0; k < H8; k += 8) {
        const v8f x0 = load8(a0 + k), x1 = load8(a1 + k);
        const v8f y0 = load8(b0 + k), y1 = load8(b1 + k), y2 = load8(b2 + k), y3 = load8(b3 + k);
        c00 += x0 * y0;
        c01 += x0 * y1;
        c02 += x0 * y2;
        c03 += x0 * y3;
        c10 += x1 * y0;
        c11 += x1 * y1;
        c12 += x1 * y2;
        c13 += x1 * y3;
      }
      float t00 = hsum(c00), t01 = hsum(c01), t02 = hsum(c02), t03 = hsum(c03);
      float t10 = hsum(c10), t11 = hsum(c11), t12 = hsum(c12), t13 = hsum(c13);
      for (int64_t k = H8; k < H; ++k) {
        t00 += a0[k] * b0[k];
        t01 += a0[k] * b1[k];
        t02 += a0[k] * b2[k];
        t03 += a0[k] * b3[k];
        t10 += a1[k] * b0[k];
        t11 += a1[k] * b1[k];
        t12 += a1[k] * b2[k];
        t13 += a1[k] * b3[k];
      }
      float* c0 = C + r * vt + v;
      float* c1 = c0 + vt;
      c0[0] = t00, c0[1] = t01, c0[2] = t02, c0[3] = t03;
      c1[0] = t10, c1[1] = t11, c1[2] = t12, c1[3] = t13;
    }
    for (; v < vt; ++v) {
      C[r * vt + v] = dot(a0, B + v * H, H);
      C[(r + 1) * vt + v] = dot(a1, B + v * H, H);
    }
  }
  for (; r < rc; ++r) {
    for (int64_t v = 0; v < vt; ++v) C[r * vt + v] = dot(A + r * H, B + v * H, H);
  }
}

// Y (n x H) += W (m x n, row stride ldw, element (i, j) at W[i * ldw + j]) ^T . X (m x H), the
// shape both gradient tiles have: 8 output rows held in registers over an 8-wide slice of H
// while the m inputs stream past, each input load feeding 8 FMAs.
void accumulate_transposed(const float* W, int64_t ldw, const float* X, int64_t m, int64_t n, int64_t H,
                           float* Y) {
  const int64_t H8 = H / 8 * 8;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    float* y = Y + j * H;
    for (int64_t k = 0; k < H8; k += 8) {
      v8f acc[8];
      for (int q = 0; q < 8; ++q) acc[q] = load8(y + q * H + k);
      for (int64_t i = 0; i < m; ++i) {
        const v8f x = load8(X + i * H + k);
        const float* w = W + i * ldw + j;
        for (int q = 0; q < 8; ++q) acc[q] += splat(w[q]) * x;
      }
      for (int q = 0; q < 8; ++q) store8(y + q * H + k, acc[q]);
    }
    for (int64_t k = H8; k < H; ++k) {
      for (int q = 0; q < 8; ++q) {
        float t = y[q * H + k];
        for (int64_t i = 0; i < m; ++i) t += W[i * ldw + j + q] * X[i * H + k];
        y[q * H + k] = t;
      }
    }
  }
  for (; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) axpy(W[i * ldw + j], X + i * H, Y + j * H, H);
  }
}

// D (vt x H) += G (rc x vt)^T . A (rc x H)
void tile_dw(const float* G, const float* A, int64_t rc, int64_t vt, int64_t H, float* D) {
  accumulate_transposed(G, vt, A, rc, vt, H, D);
}

// E (rc x H) += G (rc x vt) . B (vt x H): G read transposed (element (v, r) at G[r * vt + v]),
// which is the same product with W = G^T, i.e. stride 1 between outputs and vt between inputs.
void tile_dh(const float* G, const float* B, int64_t rc, int64_t vt, int64_t H, float* E) {
  const int64_t H8 = H / 8 * 8;
  int64_t r = 0;
  for (; r + 8 <= rc; r += 8) {
    float* e = E + r * H;
    for (int64_t k = 0; k < H8; k += 8) {
      v8f acc[8];
      for (int q = 0; q < 8; ++q) acc[q] = load8(e + q * H + k);
      for (int64_t v = 0; v < vt; ++v) {
        const v8f x = load8(B + v * H + k);
        for (int q = 0; q < 8; ++q) acc[q] += splat(G[(r + q) * vt + v]) * x;
      }
      for (int q = 0; q < 8; ++q) store8(e + q * H + k, acc[q]);
    }
    for (int64_t k = H8; k < H; ++k) {
      for (int q = 0; q < 8; ++q) {
        float t = e[q * H + k];
        for (int64_t v = 0; v < vt; ++v) t += G[(r + q) * vt + v] * B[v * H + k];
        e[q * H + k] = t;
      }
    }
  }
  for (; r < rc; ++r) {
    for (int64_t v = 0; v < vt; ++v) axpy(G[r * vt + v], B + v * H, E + r * H, H);
  }
}

// The row kernel of the arguments' dtype (float32, bfloat16 or float16; others are rejected by
// validation before any kernel runs).
template <typename Args, RowFn<Args> kF32, RowFn<Args> kBF16, RowFn<Args> kF16>
void by_dtype(const Args& args, int64_t begin, int64_t end) {
  switch (args.dtype) {
    case DType::kFloat32: return kF32(args, begin, end);
    case DType::kBFloat16: return kBF16(args, begin, end);
    case DType::kFloat16: return kF16(args, begin, end);
    default: return;
  }
}

}  // namespace

TileKernels tile_kernels() { return TileKernels{tile_logits, tile_dw, tile_dh}; }

RowKernels row_kernels() {
  return RowKernels{
      by_dtype<RowArgs, process_rows_dtype<float>, process_rows_dtype<bf16_t>, process_rows_dtype<fp16_t>>,
      by_dtype<RescaleArgs, rescale_rows_t<float>, rescale_rows_t<bf16_t>, rescale_rows_t<fp16_t>>,
      by_dtype<LpRowArgs, lp_stats_rows_t<float>, lp_stats_rows_t<bf16_t>, lp_stats_rows_t<fp16_t>>,
      by_dtype<LpRowArgs, lp_grad_rows_t<float>, lp_grad_rows_t<bf16_t>, lp_grad_rows_t<fp16_t>>,
  };
}

}  // namespace FUSEDCE_CPU_ISA
}  // namespace cpu
}  // namespace fusedce
