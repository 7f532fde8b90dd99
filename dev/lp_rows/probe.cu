// Experiment: what keeps the per-token log-probabilities' CUDA row kernels (src/cuda/logprobs/
// logprobs_kernels.cu: lp_stats_kernel, the forward statistics, and lp_backward_kernel) from the
// memory time, and which change brings them to it. On an H200 at GRPO's head (8192 x 896 x 151936
// bf16) the statistics over 6 token chunks of 1408 rows x 151936 took 1.82 ms (~1.4 TB/s of
// reads) and the backward over 3 vocabulary chunks of 8192 x 50688 1.88 ms (~2.65 TB/s, read +
// write), against TRL's Triton kernels' 1.39 and 1.56 ms; the chip reads ~4 TB/s.
//
// Statistics variants (one chunk of bf16 logits; per row the max m, r = the sum of exp(z - m) over
// every entry but one instance of the max, u = the sum of exp(z - m)(z - m), the target's z), one
// block of 256 threads, 16-byte segments, 4 loads in flight a thread unless said:
//   lib        the library's kernel, linked from its source (built with FUSEDCE_PROBE_LIBRARY);
//   lib-copy   the probe's copy of it (the baseline when built without the library; with it,
//              compared with lib on every row); the same SASS shape (a convergence barrier per
//              element around the max-instance test), but 47 registers (5 blocks an SM) where
//              the library's kernel takes 54 (4), and 63 (4) against 79 (3) in the backward;
//   fastexp    lib-copy with __expf (FMUL + MUFU.EX2) for expf, nothing else changed;
//   exp2       the logits scaled by c = inv_t log2(e) in the exponent's one FFMA, d = x c - fl(M c)
//              (M the lane's raw max), 2^d by ex2.approx: each segment's max first (a new max is a
//              rare branch that moves the state and leaves its first instance out), then 8
//              independent exps with no per-element compare; sums in base 2 (u scaled by ln 2 at
//              the end), per segment in float, per lane in double; fl(M c)'s rounding folded out
//              exactly at the end, so the state is relative to M c itself and the output
//              m = M * inv_t has the library's bits (lse = m + log1p(r) keeps today's rounding);
//              the lanes merge by warp shuffles, then the warps in order (double, exp2);
//   exp2/float exp2 with the per-lane sums in float (the merge still double);
//   exp2/u8    exp2 with 8 segments in flight a thread;
//   exp2/occ6, exp2/occ8  exp2 under __launch_bounds__(256, 6 / 8): at most 40 / 32 registers, so
//              6 / 8 blocks an SM (exp2 itself: 64 registers, 4 blocks, as the library's 54); they
//              spill (-Xptxas -v): occ6 only in its rare paths (new max, NaN flag), occ8 also
//              beside its exps (sm_90 SASS, nvcc 13.0);
//   rows/2, rows/4  exp2 with 2 (4) rows a block of 256 threads, 128 (64) threads a row: fewer,
//              longer-lived blocks against the waves of 1408 rows over 132 SMs;
//   read       the same loads and grid as exp2 with a max and a plain sum: that grid's memory time;
//   read/flat  the whole chunk read by a grid-stride loop (8 blocks an SM): the chip's read rate.
// Backward variants (dlogits of g_lp * logprob + g_H * entropy, into a second buffer: the same
// bytes as in place, no restore copy between calls), one block of 256 threads a row:
//   lib, lib-copy (as above), fastexp (__expf for the non-target entries; the target's entry as the
//   library forms it, with expm1f), exp2 (one FFMA, ex2, FMNMX, FFMA, FMUL an entry; the target's
//   test once a segment), exp2/occ6, exp2/occ8 (exp2 at 6 / 8 blocks an SM, both spilling in the
//   main loop; the library's kernel takes 79 registers: 3 blocks), copy (read + write: the memory
//   time).
//
// Inputs: z = 3 randn (bf16); rows i % 8 == 3 have one entry at 28 (~15 above the rest), and at
// i % 16 == 3 it is the target (logprob ~ -1e-5, the collapse case); rows i % 16 == 5 have a
// quarter of their entries -inf (masked vocabulary); row 7 has target ignore_index; the other
// targets are random. Temperature 1 and 0.7, entropy on (the statistics are the same; the
// backward gets g_H != 0).
// Checks before timing: each variant's statistics against float64 on the host at 8 rows (r, u
// relative; lse, logprob, entropy absolute, and over the library's test tolerance: logprob and
// entropy atol 2e-5 + rtol 2e-6, log_sum_sq_probs atol 2e-6 + rtol 1e-6, from a second run of
// each variant with the sum of squares q (the library's distribution statistics) on), and against
// the baseline on every row; the backward's against float64 at 4 rows (max |diff| over the row's
// max |grad|, and the share of entries that are not float64 rounded once to bf16) and against the
// baseline on every row (GPU compare). Timing: CUDA events, 3 warm-up rounds, median of 20, the
// variants interleaved in rounds; GB/s = bytes read (statistics) or read + written (backward).
// Without a GPU the lane and merge arithmetic of every variant runs on the host (same functions,
// the device's segment order and merge trees; host exp2/exp for ex2.approx/__expf, so fastexp is
// lib-copy there) on 16 rows against float64, and the program exits 0. Each timing row also
// prints the kernel's registers, resident blocks an SM and waves (blocks / (that x SMs)).
//
// Build (here, no GPU):
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -Xptxas -v dev/lp_rows/probe.cu -o build-probe/lp_rows
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -Xptxas -v --expt-relaxed-constexpr -DFUSEDCE_PROBE_LIBRARY
//     -DFUSEDCE_WITH_CUDA -Iinclude -Isrc dev/lp_rows/probe.cu src/cuda/logprobs/logprobs_kernels.cu
//     -o build-probe/lp_rows_lib
// Run (GPU): build-probe/lp_rows_lib [rows V] [backward rows, backward V]
//   (default 1408 151936 8192 50688: one of GRPO's 6 token chunks, one of its 3 vocabulary chunks)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef FUSEDCE_PROBE_LIBRARY
#include "common/logprob_math.h"
#include "cuda/logprobs/logprobs_kernels.h"
#include "fusedce/logprobs.h"
#endif

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

#define PHD __host__ __device__ __forceinline__

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr double kLn2 = 0.6931471805599453;
constexpr int kBlock = 256;
constexpr int64_t kIgnore = -100;
constexpr int kW = 8;  // floats a statistics row here: m, r, u, z_t, holds, q, 0, 0
constexpr float kPeak = 28.0f;
constexpr uint16_t kNegInfBits = 0xff80u, kZeroBits = 0u;

// ---- inputs: logits from a hash (the same function on host and device) ------------------------

PHD uint32_t mix32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
PHD float unit01(uint64_t key) { return (static_cast<float>(mix32(key) >> 8) + 0.5f) * (1.0f / 16777216.0f); }
PHD float gauss(uint64_t key) {
  return sqrtf(-2.0f * logf(unit01(2 * key))) * cosf(6.28318530717958f * unit01(2 * key + 1));
}
PHD uint64_t cell(uint32_t seed, uint64_t row, uint64_t col, uint64_t V) { return (uint64_t(seed) << 40) + row * V + col; }
PHD uint64_t peak_col(uint32_t seed, uint64_t row, uint64_t V) {
  return mix32((uint64_t(seed) << 40) ^ (row * 0x9E3779B97F4A7C15ULL) ^ 0x5bd1e995u) % V;
}
PHD bool masked(uint32_t seed, uint64_t row, uint64_t col, uint64_t V) {
  return row % 16 == 5 && mix32(cell(seed, row, col, V) * 3 + 1) % 4 == 0;
}
/// 3 randn; one entry at kPeak in rows i % 8 == 3; a quarter -inf in rows i % 16 == 5.
PHD float logit(uint32_t seed, uint64_t row, uint64_t col, uint64_t V) {
  if (masked(seed, row, col, V)) return -INFINITY;
  if (row % 8 == 3 && col == peak_col(seed, row, V)) return kPeak;
  return 3.0f * gauss(cell(seed, row, col, V));
}

__global__ void fill(__nv_bfloat16* x, int64_t rows, int64_t V, uint32_t seed) {
  const int64_t n = rows * V;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    x[e] = __float2bfloat16(logit(seed, e / V, e % V, V));
  }
}

/// Row 7 ignored; rows i % 16 == 3 target their peak (collapse); the others a random unmasked column.
std::vector<int64_t> make_targets(uint32_t seed, int64_t rows, int64_t V) {
  std::vector<int64_t> t(rows);
  for (int64_t i = 0; i < rows; ++i) {
    if (i == 7) {
      t[i] = kIgnore;
    } else if (i % 16 == 3) {
      t[i] = static_cast<int64_t>(peak_col(seed, i, V));
    } else {
      uint64_t k = 0;
      do {
        t[i] = static_cast<int64_t>(mix32(uint64_t(seed) * 1000003ULL + uint64_t(i) * 7919ULL + (k++ << 32)) % V);
      } while (masked(seed, i, t[i], V));
    }
  }
  return t;
}

/// Per-row upstream gradients: g_lp an advantage in [-1, 1], g_H an entropy weight in [-0.05, 0.05].
float g_lp_of(int64_t i) { return (static_cast<float>(mix32(0xabcdULL + i) % 2001) - 1000.0f) / 1000.0f; }
float g_h_of(int64_t i) { return (static_cast<float>(mix32(0x1234ULL + i) % 2001) - 1000.0f) / 20000.0f; }

// ---- segments (cuda/vec.cuh's layout: segment s holds elements [8s - off, 8s - off + 8)) --------

PHD float as_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// 2^x: one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 are 0) on the device, exp2f on the host.
PHD float ex2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}
PHD float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}

PHD void unpack8(const uint4& w, float (&v)[8]) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = as_float(u[k] << 16);
    v[2 * k + 1] = as_float(u[k] & 0xffff0000u);
  }
}

/// The largest of 8 bf16 (NaN ignored, as fmaxf), as float; packed maxima on the device (vec.cuh).
PHD float seg_max(const uint4& w) {
#ifdef __CUDA_ARCH__
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162 m = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));
  return fmaxf(__low2float(m), __high2float(m));
#else
  float v[8];
  unpack8(w, v);
  float m = v[0];
  for (int k = 1; k < 8; ++k) m = fmaxf(m, v[k]);
  return m;
#endif
}

template <typename T>
PHD int row_off(const T* row) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(row) / sizeof(T)) % (16 / sizeof(T)));
}

union Seg {
  uint4 w;
  uint16_t h[8];
};

/// Segment s of a row (elements outside [0, V) are `fill`): one streaming 16-byte load when whole.
PHD uint4 load_seg(const __nv_bfloat16* row, int64_t s, int off, int64_t V, uint16_t fill) {
  const int64_t j0 = s * 8 - off;
  if (j0 >= 0 && j0 + 8 <= V) {
#ifdef __CUDA_ARCH__
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(row + j0));
    return v;
#else
    uint4 v;
    std::memcpy(&v, row + j0, 16);
    return v;
#endif
  }
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(row);
  Seg g;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int64_t j = j0 + e;
    g.h[e] = (j >= 0 && j < V) ? raw[j] : fill;
  }
  return g.w;
}

PHD void store_seg(__nv_bfloat16* row, int64_t s, int off, int64_t V, uint4 w) {
  const int64_t j0 = s * 8 - off;
  if (j0 >= 0 && j0 + 8 <= V) {
#ifdef __CUDA_ARCH__
    __stcs(reinterpret_cast<uint4*>(row + j0), w);
#else
    std::memcpy(row + j0, &w, 16);
#endif
    return;
  }
  uint16_t* raw = reinterpret_cast<uint16_t*>(row);
  Seg g;
  g.w = w;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int64_t j = j0 + e;
    if (j >= 0 && j < V) raw[j] = g.h[e];
  }
}

PHD uint32_t pack2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t u;
  std::memcpy(&u, &h, 4);
  return u;
}

// ---- row states and their merge (common/logprob_math.h's LpState<double>, lp_merge) -------------

/// m: the max (lib forms: z = x inv_t; exp2 forms: the raw logit x); r, u, q as logprob_math.h
/// (exp2 forms: 2^(positions), positions and u in base 2, relative to m * c exactly).
struct St {
  float m;
  double r, u, q;
};
PHD St st_empty() { return St{-INFINITY, 0.0, 0.0, 0.0}; }

/// lp_merge (kBase2 false: the library's, to the bit) or its base-2 form, where positions are
/// (m_b - m_a) * c.
template <bool kBase2>
PHD St st_merge(const St& a, const St& b, double c) {
  if (b.m == -INFINITY) return St{a.m, a.r + b.r, a.u + b.u, a.q + b.q};
  if (a.m == -INFINITY) return St{b.m, b.r + a.r, b.u + a.u, b.q + a.q};
  if (a.m >= b.m) {
    const double d = kBase2 ? (double(b.m) - double(a.m)) * c : double(b.m) - double(a.m);
    const double f = kBase2 ? exp2(d) : exp(d);
    return St{a.m, a.r + (1.0 + b.r) * f, a.u + (b.u + (1.0 + b.r) * d) * f, a.q + (1.0 + b.q) * f * f};
  }
  const double d = kBase2 ? (double(a.m) - double(b.m)) * c : double(a.m) - double(b.m);
  const double f = kBase2 ? exp2(d) : exp(d);
  return St{b.m, b.r + (1.0 + a.r) * f, b.u + (a.u + (1.0 + a.r) * d) * f, b.q + (1.0 + a.q) * f * f};
}

struct MergeNat {
  PHD St operator()(const St& a, const St& b) const { return st_merge<false>(a, b, 1.0); }
};
struct MergeB2 {
  double c;
  PHD St operator()(const St& a, const St& b) const { return st_merge<true>(a, b, c); }
};
struct MergeRead {  // read: m the max, r a plain sum
  PHD St operator()(const St& a, const St& b) const { return St{fmaxf(a.m, b.m), a.r + b.r, 0.0, 0.0}; }
};

// ---- lane forms ---------------------------------------------------------------------------------

/// lib-copy / fastexp: the library's LaneState (kDist off; kQ adds its q alone).
template <bool kFast, bool kQ>
struct LibLane {
  float m = -INFINITY;
  double r = 0.0, u = 0.0, q = 0.0;
  bool nan = false;

  PHD void push(const uint4& seg, float inv_t) {
    const float top = seg_max(seg) * inv_t;
    bool skip = false;
    if (top > m) {
      if (m != -INFINITY) {
        const double d = double(m) - double(top);
        const double f = exp(d);
        u = (u + (1.0 + r) * d) * f;
        r = (r + 1.0) * f;
        if (kQ) q = (q + 1.0) * f * f;
      }
      m = top;
      skip = true;
    }
    float v[8];
    unpack8(seg, v);
    if (m == -INFINITY) {
#pragma unroll
      for (int k = 0; k < 8; ++k) nan |= v[k] != v[k];
      return;
    }
    float rs = 0.0f, us = 0.0f, qs = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float z = v[k] * inv_t;
      nan |= z != z;
      if (skip && z == m) {
        skip = false;
        continue;
      }
      const float d = z - m;
      const float x = kFast ? fast_exp(d) : expf(d);
      rs += x;
      if (x > 0.0f) us += x * d;
      if (kQ) qs += x * x;
    }
    r += rs;
    u += us;
    if (kQ) q += qs;
  }
  PHD St state() const {
    St s = m == -INFINITY ? st_empty() : St{m, r, u, q};
    if (nan) s.r = s.u = s.q = NAN;
    return s;
  }
};

/// exp2 forms. M the raw max; positions d = fl(x c - ym) with ym = fl(M c) (one FFMA), and the
/// implicit max instance at delta = M c - ym (exact: fmaf's residual). A segment with a new max
/// moves the state by D = ym_old - ym_new (exact in double); the old max instance joins as an
/// entry at delta_old + D. state() shifts everything by -delta: relative to M c exactly.
/// -inf entries: 2^-inf = 0 times a clamped position; a NaN entry makes r, u, q NaN through its
/// exp (the flag only where the lane has no finite max yet, as the library).
template <typename A, bool kQ>
struct E2Lane {
  float M = -INFINITY, nym = INFINITY, delta = 0.0f;
  A r = A(0), u = A(0), q = A(0);
  bool nan = false;

  PHD void push(const uint4& seg, float c) {
    float v[8];
    unpack8(seg, v);
    const float gm = seg_max(seg);
    if (gm > M) {
      new_max(v, gm, c);
      return;
    }
    if (M == -INFINITY) {
#pragma unroll
      for (int k = 0; k < 8; ++k) nan |= v[k] != v[k];
      return;
    }
    float e[8], d[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      d[k] = fmaf(v[k], c, nym);
      e[k] = ex2(d[k]);
    }
    const float rs = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
    float us = 0.0f, qs = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      us = fmaf(e[k], fmaxf(d[k], -256.0f), us);
      if (kQ) qs = fmaf(e[k], e[k], qs);
    }
    r += A(rs);
    u += A(us);
    if (kQ) q += A(qs);
  }

  PHD void new_max(const float (&v)[8], float gm, float c) {
    const float ym = gm * c;
    const float nd = fmaf(gm, c, -ym);
    if (M != -INFINITY) {
      const double D = double(-nym) - double(ym);
      const double g = exp2(D);
      const double pos = double(delta) + D;
      const double e0 = exp2(pos);
      u = A((double(u) + D * double(r)) * g + e0 * pos);
      r = A(double(r) * g + e0);
      if (kQ) q = A(double(q) * g * g + e0 * e0);
    }
    M = gm;
    nym = -ym;
    delta = nd;
    bool skip = true;
    float rs = 0.0f, us = 0.0f, qs = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (skip && v[k] == gm) {
        skip = false;
        continue;
      }
      const float d = fmaf(v[k], c, nym);
      const float e = ex2(d);
      rs += e;
      us = fmaf(e, fmaxf(d, -256.0f), us);
      if (kQ) qs = fmaf(e, e, qs);
    }
    r += A(rs);
    u += A(us);
    if (kQ) q += A(qs);
  }

  PHD St state() const {
    if (M == -INFINITY) {
      St s = st_empty();
      if (nan) s.r = s.u = s.q = NAN;
      return s;
    }
    const double dl = delta, g = exp2(-dl);
    St s{M, double(r) * g, (double(u) - dl * double(r)) * g, double(q) * g * g};
    if (nan) s.r = s.u = s.q = NAN;
    return s;
  }
};

/// read: the max and a plain sum (the loads' cost with the least arithmetic on them).
struct ReadLane {
  float m = -INFINITY;
  double s = 0.0;
  PHD void push(const uint4& seg, float) {
    float v[8];
    unpack8(seg, v);
    m = fmaxf(m, seg_max(seg));
    s += double(((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])));
  }
  PHD St state() const { return St{m, s, 0.0, 0.0}; }
};

/// A lane's segments of a row (lane, lane + kTpr, ...), kU loads issued before any is used
/// (the library's loop).
template <int kTpr, int kU, typename Lane>
PHD void visit_row(Lane& lane, const __nv_bfloat16* x, int64_t V, int l, float arg) {
  const int off = row_off(x);
  const int64_t segs = (V + off + 7) / 8;
  int64_t s = l;
  for (; s + (kU - 1) * kTpr < segs; s += kU * kTpr) {
    uint4 w[kU];
#pragma unroll
    for (int k = 0; k < kU; ++k) w[k] = load_seg(x, s + k * kTpr, off, V, kNegInfBits);
#pragma unroll
    for (int k = 0; k < kU; ++k) lane.push(w[k], arg);
  }
  for (; s < segs; s += kTpr) lane.push(load_seg(x, s, off, V, kNegInfBits), arg);
}

/// A statistics row as the library writes it (exp2 forms: m back to z's units, u to natural).
PHD void put_stats(float* o, const St& s, bool base2, float inv_t, float zt, bool holds) {
  o[0] = base2 ? s.m * inv_t : s.m;
  o[1] = static_cast<float>(s.r);
  o[2] = static_cast<float>(base2 ? s.u * kLn2 : s.u);
  o[3] = holds ? zt : 0.0f;
  o[4] = holds ? 1.0f : 0.0f;
  o[5] = static_cast<float>(s.q);
  o[6] = o[7] = 0.0f;
}

// ---- statistics kernels -------------------------------------------------------------------------

enum class Form { kExp2, kExp2F, kRead };

struct Params {
  const __nv_bfloat16* x;
  const int64_t* target;
  int64_t rows, V;
  float inv_t;
  float* out;  // rows x kW
};

/// lib-copy / fastexp: lp_stats_kernel's structure (the shared-memory tree of the lanes' states).
template <bool kFast, bool kQ>
__global__ void __launch_bounds__(kBlock) lib_stats(const Params p) {
  __shared__ St part[kBlock];
  const int64_t i = blockIdx.x;
  const int tid = threadIdx.x;
  float* out = p.out + i * kW;
  const int64_t t = p.target[i];
  if (t == kIgnore) {
    if (tid < kW) out[tid] = 0.0f;
    return;
  }
  const __nv_bfloat16* x = p.x + i * p.V;
  LibLane<kFast, kQ> lane;
  visit_row<kBlock, 4>(lane, x, p.V, tid, p.inv_t);
  part[tid] = lane.state();
  __syncthreads();
  for (int k = kBlock / 2; k > 0; k >>= 1) {
    if (tid < k) part[tid] = st_merge<false>(part[tid], part[tid + k], 1.0);
    __syncthreads();
  }
  if (tid == 0) {
    const bool holds = t >= 0 && t < p.V;
    put_stats(out, part[0], false, p.inv_t, holds ? __bfloat162float(x[t]) * p.inv_t : 0.0f, holds);
  }
}

/// The states of a row group's lanes merged: shuffles down each warp, then its warps in order;
/// the result in the group's first thread.
template <int kTpr, typename M>
__device__ __forceinline__ St group_reduce(St s, const M& merge) {
  __shared__ St wpart[kBlock / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    St o;
    o.m = __shfl_down_sync(0xffffffffu, s.m, off);
    o.r = __shfl_down_sync(0xffffffffu, s.r, off);
    o.u = __shfl_down_sync(0xffffffffu, s.u, off);
    o.q = __shfl_down_sync(0xffffffffu, s.q, off);
    s = merge(s, o);
  }
  constexpr int kWarps = kTpr / 32;
  if constexpr (kWarps > 1) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) wpart[warp] = s;
    __syncthreads();
    if (threadIdx.x % kTpr == 0) {
      for (int w = 1; w < kWarps; ++w) s = merge(s, wpart[warp + w]);
    }
  }
  return s;
}

/// exp2, exp2/float, read: kTpr threads a row, kBlock / kTpr rows a block, kU loads in flight,
/// at least kMinB blocks an SM (0: none, the plain __launch_bounds__(256) the library's kernels
/// have; an explicit 1 lets ptxas take more registers than without).
template <Form kForm, int kTpr, bool kQ, int kU, int kMinB = 0>
__global__ void __launch_bounds__(kBlock, kMinB) e2_stats(const Params p) {
  constexpr int kRows = kBlock / kTpr;
  const int l = threadIdx.x % kTpr;
  const int64_t i = int64_t(blockIdx.x) * kRows + threadIdx.x / kTpr;
  const int64_t t = i < p.rows ? p.target[i] : kIgnore;
  const bool live = t != kIgnore;  // no early exit: the block's rows share its barrier
  const __nv_bfloat16* x = p.x + i * p.V;
  const float c = p.inv_t * kLog2e;
  St s;
  if constexpr (kForm == Form::kRead) {
    ReadLane lane;
    if (live) visit_row<kTpr, kU>(lane, x, p.V, l, c);
    s = group_reduce<kTpr>(lane.state(), MergeRead{});
  } else {
    using A = std::conditional_t<kForm == Form::kExp2F, float, double>;
    E2Lane<A, kQ> lane;
    if (live) visit_row<kTpr, kU>(lane, x, p.V, l, c);
    s = group_reduce<kTpr>(lane.state(), MergeB2{double(c)});
  }
  if (l == 0 && i < p.rows) {
    float* out = p.out + i * kW;
    if (!live) {
      for (int k = 0; k < kW; ++k) out[k] = 0.0f;
    } else {
      const bool holds = t >= 0 && t < p.V;
      put_stats(out, s, kForm != Form::kRead, p.inv_t, holds ? __bfloat162float(x[t]) * p.inv_t : 0.0f, holds);
    }
  }
}

/// read/flat: the chunk as one array of 16-byte words, grid-stride, 4 loads in flight.
__global__ void __launch_bounds__(kBlock) read_flat(const uint4* x, int64_t n, float* out) {
  __shared__ float sm[kBlock / 32], ss[kBlock / 32];
  const int64_t stride = int64_t(gridDim.x) * kBlock;
  int64_t i = int64_t(blockIdx.x) * kBlock + threadIdx.x;
  float m = -INFINITY, s = 0.0f;
  auto fold = [&](const uint4& w) {
    float v[8];
    unpack8(w, v);
    m = fmaxf(m, seg_max(w));
    s += ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  };
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = load_seg(reinterpret_cast<const __nv_bfloat16*>(x + i + k * stride), 0, 0, 8, 0);
#pragma unroll
    for (int k = 0; k < 4; ++k) fold(w[k]);
  }
  for (; i < n; i += stride) fold(load_seg(reinterpret_cast<const __nv_bfloat16*>(x + i), 0, 0, 8, 0));
  for (int off = 16; off > 0; off >>= 1) {
    m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
    s += __shfl_down_sync(0xffffffffu, s, off);
  }
  if (threadIdx.x % 32 == 0) {
    sm[threadIdx.x / 32] = m;
    ss[threadIdx.x / 32] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kBlock / 32; ++w) {
      m = fmaxf(m, sm[w]);
      s += ss[w];
    }
    out[blockIdx.x] = m + s;
  }
}

// ---- backward -----------------------------------------------------------------------------------

enum class Back { kLibCopy, kFast, kExp2, kCopy };

/// Per-row constants: the library's LpRowGrad, inv_t, and the exp2 form's
/// dx = 2^d2 (A + B max(d2, -256)), d2 = x c + nl2, and the target's entry gt.
struct GradRow {
  float lse, logprob, entropy, g_lp, g_h, inv_t;
  float c, nl2, A, B, gt;
};

/// common/logprob_math.h's lp_grad (kFast: __expf for the non-target entries).
template <bool kFast>
PHD float lib_grad(const GradRow& g, float z, bool is_target) {
  if (is_target) {
    const float lp = g.logprob;
    return -g.g_lp * expm1f(lp) - g.g_h * expf(lp) * (lp + g.entropy);
  }
  const float d = z - g.lse;
  const float p = kFast ? fast_exp(d) : expf(d);
  if (p == 0.0f) return 0.0f;
  return -p * (g.g_lp + g.g_h * (d + g.entropy));
}

PHD GradRow grad_row(float lse, float lp, float h, float g_lp, float g_h, float inv_t) {
  GradRow g{lse, lp, h, g_lp, g_h, inv_t, 0, 0, 0, 0, 0};
  g.c = inv_t * kLog2e;
  g.nl2 = -(lse * kLog2e);
  g.A = -(g_lp + g_h * h) * inv_t;
  g.B = -g_h * inv_t * static_cast<float>(kLn2);
  g.gt = lib_grad<false>(g, 0.0f, true) * inv_t;
  return g;
}

/// One segment's gradient (j0: its first column; tl: the row's target column).
template <Back kForm>
PHD uint4 grad_seg(const uint4& w, int64_t j0, int64_t tl, const GradRow& g) {
  if (kForm == Back::kCopy) return w;
  float v[8];
  unpack8(w, v);
  uint32_t o[4];
  if (kForm == Back::kExp2) {
    float d[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d2 = fmaf(v[k], g.c, g.nl2);
      d[k] = ex2(d2) * fmaf(g.B, fmaxf(d2, -256.0f), g.A);
    }
    const uint64_t at = static_cast<uint64_t>(tl - j0);
    if (at < 8) {
#pragma unroll
      for (int k = 0; k < 8; ++k) d[k] = uint64_t(k) == at ? g.gt : d[k];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = pack2(d[2 * k], d[2 * k + 1]);
  } else {
    constexpr bool kF = kForm == Back::kFast;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t j = j0 + 2 * k;
      o[k] = pack2(lib_grad<kF>(g, v[2 * k] * g.inv_t, j == tl) * g.inv_t,
                   lib_grad<kF>(g, v[2 * k + 1] * g.inv_t, j + 1 == tl) * g.inv_t);
    }
  }
  return uint4{o[0], o[1], o[2], o[3]};
}

struct BackParams {
  const __nv_bfloat16* x;
  __nv_bfloat16* dx;
  const int64_t* target;
  int64_t rows, V;
  float inv_t;
  const float *lse, *logprob, *entropy, *g_lp, *g_h;
};

/// lp_backward_kernel's structure (x and dx at the same offset from a 16-byte boundary); at least
/// kMinB blocks an SM.
template <Back kForm, int kMinB = 0>
__global__ void __launch_bounds__(kBlock, kMinB) back_rows(const BackParams p) {
  const int64_t i = blockIdx.x;
  const __nv_bfloat16* x = p.x + i * p.V;
  __nv_bfloat16* dx = p.dx + i * p.V;
  const int64_t t = p.target[i];
  const int off = row_off(dx);
  const int64_t segs = (p.V + off + 7) / 8;
  if (t == kIgnore) {
    for (int64_t s = threadIdx.x; s < segs; s += kBlock) store_seg(dx, s, off, p.V, uint4{0u, 0u, 0u, 0u});
    return;
  }
  const GradRow g = grad_row(p.lse[i], p.logprob[i], p.entropy[i], p.g_lp[i], p.g_h[i], p.inv_t);
  int64_t s0 = threadIdx.x;
  for (; s0 + 3 * kBlock < segs; s0 += 4 * kBlock) {
    uint4 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = load_seg(x, s0 + k * kBlock, off, p.V, kZeroBits);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t s = s0 + k * kBlock;
      store_seg(dx, s, off, p.V, grad_seg<kForm>(w[k], s * 8 - off, t, g));
    }
  }
  for (; s0 < segs; s0 += kBlock) {
    store_seg(dx, s0, off, p.V, grad_seg<kForm>(load_seg(x, s0, off, p.V, kZeroBits), s0 * 8 - off, t, g));
  }
}

/// Per row: max |a| (the baseline), max |a - b| (inf where exactly one is NaN), and how many
/// entries differ in their bits.
__global__ void __launch_bounds__(kBlock) cmp_rows(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t V,
                                                   float* big, float* diff, unsigned long long* ndiff) {
  __shared__ float sb[kBlock / 32], sd[kBlock / 32];
  __shared__ unsigned sn[kBlock / 32];
  const int64_t i = blockIdx.x;
  const uint16_t* ra = reinterpret_cast<const uint16_t*>(a + i * V);
  const uint16_t* rb = reinterpret_cast<const uint16_t*>(b + i * V);
  float mb = 0.0f, md = 0.0f;
  unsigned n = 0;
  for (int64_t j = threadIdx.x; j < V; j += kBlock) {
    const float fa = __bfloat162float(a[i * V + j]), fb = __bfloat162float(b[i * V + j]);
    mb = fmaxf(mb, fabsf(fa));
    const float d = (fa != fa) != (fb != fb) ? INFINITY : fabsf(fa - fb);
    md = fmaxf(md, d);
    n += ra[j] != rb[j];
  }
  for (int off = 16; off > 0; off >>= 1) {
    mb = fmaxf(mb, __shfl_down_sync(0xffffffffu, mb, off));
    md = fmaxf(md, __shfl_down_sync(0xffffffffu, md, off));
    n += __shfl_down_sync(0xffffffffu, n, off);
  }
  if (threadIdx.x % 32 == 0) {
    sb[threadIdx.x / 32] = mb;
    sd[threadIdx.x / 32] = md;
    sn[threadIdx.x / 32] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kBlock / 32; ++w) {
      mb = fmaxf(mb, sb[w]);
      md = fmaxf(md, sd[w]);
      n += sn[w];
    }
    big[i] = mb;
    diff[i] = md;
    atomicAdd(ndiff, static_cast<unsigned long long>(n));
  }
}

// ---- host: references, finish, accuracy ---------------------------------------------------------

/// float64 statistics of a row (z = x * inv_t, inv_t the float the kernels get).
struct Ref {
  double m, r, u, q, lse, lp, h, lss;
};
Ref reference(const std::vector<float>& x, int64_t t, float inv_t) {
  const double it = inv_t;
  double m = -INFINITY;
  int64_t jm = -1;
  for (size_t j = 0; j < x.size(); ++j) {
    if (x[j] * it > m) {
      m = x[j] * it;
      jm = static_cast<int64_t>(j);
    }
  }
  Ref f{m, 0.0, 0.0, 0.0, 0, 0, 0, 0};
  for (size_t j = 0; j < x.size(); ++j) {
    if (static_cast<int64_t>(j) == jm || x[j] == -INFINITY) continue;
    const double d = x[j] * it - m, e = std::exp(d);
    f.r += e;
    f.u += e * d;
    f.q += e * e;
  }
  const double l1 = std::log1p(f.r);
  f.lse = m + l1;
  f.lp = x[t] * it - m - l1;
  f.h = l1 - f.u / (1.0 + f.r);
  f.lss = std::log1p(f.q) - 2.0 * l1;
  return f;
}

/// The library's merge + lp_finish of one rank's statistics row (float outputs).
struct Fin {
  float lse, lp, h, lss;
};
Fin finish(const float* s) {
  if (s[0] == -INFINITY) return Fin{-INFINITY, NAN, NAN, NAN};
  const double r = s[1], u = s[2], q = s[5];
  const double l1 = std::log1p(r);
  return Fin{static_cast<float>(double(s[0]) + l1), static_cast<float>((double(s[3]) - double(s[0])) - l1),
             static_cast<float>(l1 - u / (1.0 + r)), static_cast<float>(std::log1p(q) - 2.0 * l1)};
}

/// Worst errors over the checked rows; *_t: over the library's test tolerance (> 1 fails it).
struct Acc {
  double r_rel = 0, u_rel = 0, lse = 0, lp = 0, lp_t = 0, h = 0, h_t = 0, lss = 0, lss_t = 0;
};
double nanmax(double a, double b) { return (b != b || a != a) ? INFINITY : std::max(a, b); }
void accumulate(Acc& a, const float* s, const Ref& f) {
  const Fin o = finish(s);
  a.r_rel = nanmax(a.r_rel, std::abs(s[1] - f.r) / std::max(f.r, 1e-300));
  a.u_rel = nanmax(a.u_rel, std::abs(s[2] - f.u) / std::max(std::abs(f.u), 1e-300));
  a.lse = nanmax(a.lse, std::abs(o.lse - f.lse));
  a.lp = nanmax(a.lp, std::abs(o.lp - f.lp));
  a.lp_t = nanmax(a.lp_t, std::abs(o.lp - f.lp) / (2e-5 + 2e-6 * std::abs(f.lp)));
  a.h = nanmax(a.h, std::abs(o.h - f.h));
  a.h_t = nanmax(a.h_t, std::abs(o.h - f.h) / (2e-5 + 2e-6 * std::abs(f.h)));
}
void accumulate_lss(Acc& a, const float* s, const Ref& f) {
  const Fin o = finish(s);
  a.lss = nanmax(a.lss, std::abs(o.lss - f.lss));
  a.lss_t = nanmax(a.lss_t, std::abs(o.lss - f.lss) / (2e-6 + 1e-6 * std::abs(f.lss)));
}
const char* verdict(double t) { return t != t || t > 1.0 ? "FAIL" : t > 0.5 ? "risk" : "ok"; }

/// Against the baseline on every row: max |diff| of logprob and entropy; rows whose m, z_t (or
/// an ignored row's zeros) differ in bits.
struct VsBase {
  double lp = 0, h = 0;
  int64_t bits = 0;
};
VsBase versus(const std::vector<float>& a, const std::vector<float>& b, const std::vector<int64_t>& t) {
  VsBase v;
  for (size_t i = 0; i < t.size(); ++i) {
    const float* x = &a[i * kW];
    const float* y = &b[i * kW];
    if (t[i] == kIgnore) {
      v.bits += x[0] != 0.0f || x[1] != 0.0f || x[2] != 0.0f || x[3] != 0.0f || x[4] != 0.0f;
      continue;
    }
    const Fin p = finish(x), q = finish(y);
    v.lp = nanmax(v.lp, std::abs(double(p.lp) - q.lp));
    v.h = nanmax(v.h, std::abs(double(p.h) - q.h));
    v.bits += std::memcmp(&x[0], &y[0], 4) != 0 || std::memcmp(&x[3], &y[3], 4) != 0;
  }
  return v;
}

void print_acc_header() {
  std::printf("| variant | r rel | u rel | lse abs | logprob abs (/tol) | entropy abs (/tol) | lss abs (/tol) "
              "| vs base: logprob | vs base: entropy | rows m/z_t bits differ |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
}
void print_acc(const char* name, const Acc& a, bool with_lss, const VsBase& v) {
  char lss[64];
  if (with_lss) {
    std::snprintf(lss, sizeof lss, "%.1e (%.2f %s)", a.lss, a.lss_t, verdict(a.lss_t));
  } else {
    std::snprintf(lss, sizeof lss, "-");
  }
  std::printf("| %-10s | %.1e | %.1e | %.1e | %.1e (%.2f %s) | %.1e (%.2f %s) | %s | %.1e | %.1e | %lld |\n", name,
              a.r_rel, a.u_rel, a.lse, a.lp, a.lp_t, verdict(a.lp_t), a.h, a.h_t, verdict(a.h_t), lss, v.lp, v.h,
              static_cast<long long>(v.bits));
}

/// float64 gradient of a row (dlogits: inv_t * dz).
std::vector<double> reference_grad(const std::vector<float>& x, int64_t t, float inv_t, float g_lp, float g_h) {
  const Ref f = reference(x, t, inv_t);
  std::vector<double> g(x.size());
  for (size_t j = 0; j < x.size(); ++j) {
    const double z = x[j] * double(inv_t), p = x[j] == -INFINITY ? 0.0 : std::exp(z - f.lse);
    double d = -g_lp * p - (p == 0.0 ? 0.0 : g_h * p * (z - f.lse + f.h));
    if (static_cast<int64_t>(j) == t) d = -g_lp * std::expm1(f.lp) - g_h * std::exp(f.lp) * (f.lp + f.h);
    g[j] = d * inv_t;
  }
  return g;
}

/// max |got - ref| / max |ref|, and entries that are not ref rounded once to bf16.
struct GradAcc {
  double rel = 0;
  int64_t wrong = 0, n = 0;
};
void accumulate_grad(GradAcc& a, const std::vector<__nv_bfloat16>& got, const std::vector<double>& ref) {
  double big = 0, err = 0;
  for (size_t j = 0; j < ref.size(); ++j) {
    big = std::max(big, std::abs(ref[j]));
    const float gj = __bfloat162float(got[j]);
    err = nanmax(err, std::abs(gj - ref[j]));
    a.wrong += gj != __bfloat162float(__float2bfloat16(static_cast<float>(ref[j])));
  }
  a.n += static_cast<int64_t>(ref.size());
  a.rel = nanmax(a.rel, err / std::max(big, 1e-300));
}

std::vector<float> row_floats(const __nv_bfloat16* x, int64_t row, int64_t V, bool device) {
  std::vector<__nv_bfloat16> h(V);
  if (device) {
    CHECK(cudaMemcpy(h.data(), x + row * V, V * 2, cudaMemcpyDeviceToHost));
  } else {
    std::memcpy(h.data(), x + row * V, V * 2);
  }
  std::vector<float> f(V);
  for (int64_t j = 0; j < V; ++j) f[j] = __bfloat162float(h[j]);
  return f;
}

std::vector<int64_t> sample_rows(int64_t rows, const std::vector<int64_t>& t, size_t n) {
  std::vector<int64_t> at;
  for (int64_t r : {int64_t(3), int64_t(5), int64_t(11), int64_t(0), int64_t(1), rows / 2, rows - 2, rows - 1}) {
    if (r >= 0 && r < rows && t[r] != kIgnore && std::find(at.begin(), at.end(), r) == at.end()) at.push_back(r);
  }
  if (at.size() > n) at.resize(n);
  return at;
}

// ---- host emulation (no GPU) --------------------------------------------------------------------

/// One row's statistics by kTpr emulated lanes in the kernels' segment order, merged in the
/// device's order (the library's shared-memory tree; the shuffle tree, then warps in order).
template <typename Lane, typename M>
St emulate_row(const __nv_bfloat16* x, int64_t V, int tpr, float arg, const M& merge, bool smem_tree) {
  std::vector<St> s(tpr);
  for (int l = 0; l < tpr; ++l) {
    Lane lane;
    switch (tpr) {
      case 256: visit_row<256, 4>(lane, x, V, l, arg); break;
      case 128: visit_row<128, 4>(lane, x, V, l, arg); break;
      default: visit_row<64, 4>(lane, x, V, l, arg); break;
    }
    s[l] = lane.state();
  }
  if (smem_tree) {
    for (int k = tpr / 2; k > 0; k >>= 1) {
      for (int l = 0; l < k; ++l) s[l] = merge(s[l], s[l + k]);
    }
    return s[0];
  }
  for (int w = 0; w < tpr / 32; ++w) {
    St* a = &s[w * 32];
    for (int off = 16; off > 0; off >>= 1) {
      std::vector<St> before(a, a + 32);
      for (int l = 0; l < 32; ++l) a[l] = merge(before[l], before[l + off < 32 ? l + off : l]);
    }
  }
  St r = s[0];
  for (int w = 1; w < tpr / 32; ++w) r = merge(r, s[w * 32]);
  return r;
}

int host_emulation(int64_t V, int64_t bV) {
  const int64_t rows = 16;
  std::printf("no GPU: the variants' lane and merge arithmetic emulated on the host (exp2/exp for "
              "ex2.approx/__expf: fastexp is lib-copy here), %lld rows of V %lld against float64\n",
              static_cast<long long>(rows), static_cast<long long>(V));
  std::vector<__nv_bfloat16> x(rows * V);
  for (int64_t e = 0; e < rows * V; ++e) x[e] = __float2bfloat16(logit(1, e / V, e % V, V));
  const std::vector<int64_t> t = make_targets(1, rows, V);
  for (float temp : {1.0f, 0.7f}) {
    const float inv_t = 1.0f / temp, c = inv_t * kLog2e;
    std::printf("\ntemperature %.1f: statistics\n", temp);
    print_acc_header();
    std::vector<Ref> refs(rows);
    for (int64_t i = 0; i < rows; ++i) {
      if (t[i] != kIgnore) refs[i] = reference(row_floats(x.data(), i, V, false), t[i], inv_t);
    }
    std::vector<float> base;
    auto run = [&](const char* name, auto lane_tag, int tpr, bool base2, bool smem) {
      using Lane = decltype(lane_tag);
      std::vector<float> out(rows * kW, 0.0f);
      for (int64_t i = 0; i < rows; ++i) {
        if (t[i] == kIgnore) continue;
        const __nv_bfloat16* r = x.data() + i * V;
        const St s = base2 ? emulate_row<Lane>(r, V, tpr, c, MergeB2{double(c)}, false)
                           : emulate_row<Lane>(r, V, tpr, inv_t, MergeNat{}, smem);
        put_stats(&out[i * kW], s, base2, inv_t, __bfloat162float(r[t[i]]) * inv_t, true);
      }
      if (base.empty()) base = out;
      Acc a;
      for (int64_t i = 0; i < rows; ++i) {
        if (t[i] == kIgnore) continue;
        accumulate(a, &out[i * kW], refs[i]);
        accumulate_lss(a, &out[i * kW], refs[i]);
      }
      print_acc(name, a, true, versus(out, base, t));
    };
    run("lib-copy", LibLane<false, true>{}, 256, false, true);
    run("fastexp", LibLane<true, true>{}, 256, false, true);
    run("exp2", E2Lane<double, true>{}, 256, true, false);
    run("exp2/float", E2Lane<float, true>{}, 256, true, false);
    run("rows/2", E2Lane<double, true>{}, 128, true, false);
    run("rows/4", E2Lane<double, true>{}, 64, true, false);

    // the backward at 4 rows of width bV
    std::printf("\ntemperature %.1f: backward, 4 rows of V %lld\n", temp, static_cast<long long>(bV));
    std::printf("| variant | max abs err / row's max |grad| | not float64 rounded once to bf16 | entries differing "
                "from lib-copy |\n|---|---|---|---|\n");
    const int64_t brows = 12;
    std::vector<__nv_bfloat16> bx(brows * bV);
    for (int64_t e = 0; e < brows * bV; ++e) bx[e] = __float2bfloat16(logit(2, e / bV, e % bV, bV));
    const std::vector<int64_t> bt = make_targets(2, brows, bV);
    const int64_t at[4] = {0, 3, 5, 11};
    std::vector<GradRow> g(4);
    std::vector<std::vector<double>> refs_g(4);
    for (int q = 0; q < 4; ++q) {
      const int64_t i = at[q];
      const __nv_bfloat16* r = bx.data() + i * bV;
      float st[kW];
      put_stats(st, emulate_row<LibLane<false, false>>(r, bV, 256, inv_t, MergeNat{}, true), false, inv_t,
                __bfloat162float(r[bt[i]]) * inv_t, true);
      const Fin f = finish(st);
      g[q] = grad_row(f.lse, f.lp, f.h, g_lp_of(i), g_h_of(i), inv_t);
      refs_g[q] = reference_grad(row_floats(bx.data(), i, bV, false), bt[i], inv_t, g_lp_of(i), g_h_of(i));
    }
    std::vector<std::vector<__nv_bfloat16>> lib_out(4);
    auto back = [&](const char* name, auto form_tag) {
      constexpr Back kForm = decltype(form_tag)::value;
      GradAcc a;
      int64_t differ = 0;
      for (int q = 0; q < 4; ++q) {
        const __nv_bfloat16* r = bx.data() + at[q] * bV;
        std::vector<__nv_bfloat16> out(bV);
        const int off = row_off(r);
        for (int64_t s = 0; s < (bV + off + 7) / 8; ++s) {
          store_seg(out.data(), s, off, bV, grad_seg<kForm>(load_seg(r, s, off, bV, kZeroBits), s * 8 - off, bt[at[q]], g[q]));
        }
        accumulate_grad(a, out, refs_g[q]);
        if (lib_out[q].empty()) lib_out[q] = out;
        for (int64_t j = 0; j < bV; ++j) {
          differ += std::memcmp(&out[j], &lib_out[q][j], 2) != 0;
        }
      }
      std::printf("| %-9s | %.2e | %.2e | %lld |\n", name, a.rel, double(a.wrong) / a.n, static_cast<long long>(differ));
    };
    back("lib-copy", std::integral_constant<Back, Back::kLibCopy>{});
    back("fastexp", std::integral_constant<Back, Back::kFast>{});
    back("exp2", std::integral_constant<Back, Back::kExp2>{});
  }
  std::printf("\nno GPU\n");
  return 0;
}

// ---- timing -------------------------------------------------------------------------------------

struct Timed {
  std::string name;
  std::function<void()> launch;
  double bytes;
  std::string info;  // registers, blocks an SM, waves
};

/// Every variant once a round, 3 warm-up rounds and 20 timed; the median of each.
std::vector<double> time_rounds(const std::vector<Timed>& v) {
  constexpr int kWarm = 3, kRuns = 20, kRounds = kWarm + kRuns;
  std::vector<cudaEvent_t> ev(v.size() * kRounds * 2);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  for (int k = 0; k < kRounds; ++k) {
    for (size_t q = 0; q < v.size(); ++q) {
      CHECK(cudaEventRecord(ev[(q * kRounds + k) * 2]));
      v[q].launch();
      CHECK(cudaEventRecord(ev[(q * kRounds + k) * 2 + 1]));
    }
    CHECK(cudaGetLastError());
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<double> med(v.size());
  for (size_t q = 0; q < v.size(); ++q) {
    std::vector<float> ms;
    for (int k = kWarm; k < kRounds; ++k) {
      float t = 0.0f;
      CHECK(cudaEventElapsedTime(&t, ev[(q * kRounds + k) * 2], ev[(q * kRounds + k) * 2 + 1]));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    med[q] = ms[ms.size() / 2];
  }
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  return med;
}

void print_times(const std::vector<Timed>& v, const std::vector<double>& ms, const char* what) {
  std::printf("| variant | ms | GB/s (%s) | x baseline | regs, blocks/SM, waves |\n|---|---|---|---|---|\n", what);
  for (size_t q = 0; q < v.size(); ++q) {
    std::printf("| %-10s | %7.4f | %6.0f | %5.2f | %s |\n", v[q].name.c_str(), ms[q], v[q].bytes / ms[q] / 1e6,
                ms[0] / ms[q], v[q].info.c_str());
  }
}

int g_sms = 0;

/// Registers, resident blocks an SM at 256 threads, and blocks / (resident blocks x SMs).
std::string kernel_info(const void* fn, int64_t blocks) {
  cudaFuncAttributes a{};
  CHECK(cudaFuncGetAttributes(&a, fn));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kBlock, 0));
  char s[96];
  std::snprintf(s, sizeof s, "%d%s, %d, %.2f", a.numRegs, a.localSizeBytes ? " (local mem!)" : "", per_sm,
                double(blocks) / std::max(1, per_sm * g_sms));
  return s;
}

// ---- the statistics pass ------------------------------------------------------------------------

struct StatsVariant {
  std::string name;
  std::function<void(const Params&)> run, run_q;  // run_q: with q (empty: no lss check)
  const void* fn;                                 // for its attributes (null: the library's)
  int64_t blocks;
  bool values;
};

template <Form kForm, int kTpr, bool kQ, int kU, int kMinB = 0>
void launch_e2(const Params& p) {
  constexpr int kRows = kBlock / kTpr;
  e2_stats<kForm, kTpr, kQ, kU, kMinB><<<static_cast<unsigned>((p.rows + kRows - 1) / kRows), kBlock>>>(p);
}
template <bool kFast, bool kQ>
void launch_lib_copy(const Params& p) {
  lib_stats<kFast, kQ><<<static_cast<unsigned>(p.rows), kBlock>>>(p);
}

void stats_pass(const __nv_bfloat16* x, const int64_t* d_t, const std::vector<int64_t>& t, int64_t rows, int64_t V,
                float temp, float* d_out, float* d_lib, float* d_scratch) {
  const float inv_t = 1.0f / temp;
  const Params p{x, d_t, rows, V, inv_t, d_out};
  std::vector<StatsVariant> vs;
#ifdef FUSEDCE_PROBE_LIBRARY
  auto lib_rows = [&](bool dist) {
    fusedce::cuda::LpRows r{d_t, 1, true, kIgnore, rows, 0, V, inv_t, dist};
    fusedce::cuda::launch_lp_stats(r, fusedce::matrix(const_cast<__nv_bfloat16*>(x), fusedce::DType::kBFloat16, rows, V),
                                   d_lib, nullptr);
  };
  vs.push_back({"lib", [&](const Params&) { lib_rows(false); }, [&](const Params&) { lib_rows(true); }, nullptr, rows, true});
#endif
  auto e2 = [&](const char* name, auto run, auto run_q, const void* fn, int tpr) {
    vs.push_back({name, run, run_q, fn, (rows + kBlock / tpr - 1) / (kBlock / tpr), true});
  };
  vs.push_back({"lib-copy", launch_lib_copy<false, false>, launch_lib_copy<false, true>,
                reinterpret_cast<const void*>(lib_stats<false, false>), rows, true});
  vs.push_back({"fastexp", launch_lib_copy<true, false>, launch_lib_copy<true, true>,
                reinterpret_cast<const void*>(lib_stats<true, false>), rows, true});
  e2("exp2", launch_e2<Form::kExp2, 256, false, 4>, launch_e2<Form::kExp2, 256, true, 4>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2, 256, false, 4>), 256);
  e2("exp2/float", launch_e2<Form::kExp2F, 256, false, 4>, launch_e2<Form::kExp2F, 256, true, 4>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2F, 256, false, 4>), 256);
  e2("exp2/u8", launch_e2<Form::kExp2, 256, false, 8>, launch_e2<Form::kExp2, 256, true, 8>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2, 256, false, 8>), 256);
  e2("exp2/occ6", launch_e2<Form::kExp2, 256, false, 4, 6>, launch_e2<Form::kExp2, 256, true, 4, 6>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2, 256, false, 4, 6>), 256);
  e2("exp2/occ8", launch_e2<Form::kExp2, 256, false, 4, 8>, launch_e2<Form::kExp2, 256, true, 4, 8>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2, 256, false, 4, 8>), 256);
  e2("rows/2", launch_e2<Form::kExp2, 128, false, 4>, launch_e2<Form::kExp2, 128, true, 4>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2, 128, false, 4>), 128);
  e2("rows/4", launch_e2<Form::kExp2, 64, false, 4>, launch_e2<Form::kExp2, 64, true, 4>,
     reinterpret_cast<const void*>(e2_stats<Form::kExp2, 64, false, 4>), 64);
  vs.push_back({"read", launch_e2<Form::kRead, 256, false, 4>, nullptr,
                reinterpret_cast<const void*>(e2_stats<Form::kRead, 256, false, 4>), rows, false});
  const int64_t flat_blocks = int64_t(g_sms) * 8;
  const int64_t n16 = rows * V / 8;  // whole 16-byte words (the chunk's tail, if any, unread)
  vs.push_back({"read/flat",
                [=](const Params&) {
                  read_flat<<<static_cast<unsigned>(flat_blocks), kBlock>>>(reinterpret_cast<const uint4*>(x), n16,
                                                                             d_scratch);
                },
                nullptr, reinterpret_cast<const void*>(read_flat), flat_blocks, false});

  auto fetch = [&](const StatsVariant& v) {
    std::vector<float> out(rows * kW, 0.0f);
#ifdef FUSEDCE_PROBE_LIBRARY
    if (v.fn == nullptr) {
      constexpr int kLw = fusedce::kLogprobStatsWidth;
      std::vector<float> lib((rows + 1) * kLw);
      CHECK(cudaMemcpy(lib.data(), d_lib, lib.size() * 4, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < rows; ++i) {
        for (int k = 0; k < 6; ++k) out[i * kW + k] = lib[i * kLw + k];
      }
      return out;
    }
#endif
    (void)v;
    CHECK(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost));
    return out;
  };

  const std::vector<int64_t> at = sample_rows(rows, t, 8);
  std::vector<Ref> refs;
  for (int64_t r : at) refs.push_back(reference(row_floats(x, r, V, true), t[r], inv_t));
  std::printf("\n## statistics, %lld rows x V %lld bf16, temperature %.1f (inv_t %.9g)\n", static_cast<long long>(rows),
              static_cast<long long>(V), temp, inv_t);
  std::printf("accuracy: float64 at rows");
  for (int64_t r : at) std::printf(" %lld", static_cast<long long>(r));
  std::printf("; base = %s on every row\n", vs[0].name.c_str());
  print_acc_header();
  std::vector<float> base;
  for (const StatsVariant& v : vs) {
    if (!v.values) continue;
    CHECK(cudaMemset(d_out, 0xff, rows * kW * 4));  // stale values must not pass
    v.run(p);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = fetch(v);
    if (base.empty()) base = out;
    Acc a;
    for (size_t q = 0; q < at.size(); ++q) accumulate(a, &out[at[q] * kW], refs[q]);
    if (v.run_q) {
      v.run_q(p);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      const std::vector<float> outq = fetch(v);
      for (size_t q = 0; q < at.size(); ++q) accumulate_lss(a, &outq[at[q] * kW], refs[q]);
    }
    print_acc(v.name.c_str(), a, static_cast<bool>(v.run_q), versus(out, base, t));
#ifdef FUSEDCE_PROBE_LIBRARY
    if (v.fn == nullptr) {  // this probe's finish against the library's own, on the library's rows
      double w = 0.0;
      for (int64_t i = 0; i < rows; ++i) {
        if (t[i] == kIgnore) continue;
        const float* s = &out[i * kW];
        auto st = fusedce::detail::lp_merge(fusedce::detail::lp_empty<double>(),
                                            fusedce::detail::LpState<float>{s[0], s[1], s[2], 0.0f});
        const fusedce::detail::LpResult lr = fusedce::detail::lp_finish(st, s[3]);
        const Fin f = finish(s);
        w = nanmax(w, std::max({std::abs(double(lr.lse) - f.lse), std::abs(double(lr.logprob) - f.lp),
                                std::abs(double(lr.entropy) - f.h)}));
      }
      std::printf("|   (this probe's finish vs detail::lp_finish on lib's rows: max |diff| %.1e) |||||||||\n", w);
    }
#endif
  }

  std::vector<Timed> timed;
  for (const StatsVariant& v : vs) {
    timed.push_back({v.name, [&v, p]() { v.run(p); }, double(rows) * V * 2.0,
                     v.fn ? kernel_info(v.fn, v.blocks) : std::string("library (see -Xptxas -v)")});
  }
  std::printf("\ntiming (one chunk; bytes read = rows x V x 2)\n");
  print_times(timed, time_rounds(timed), "reads");
}

// ---- the backward pass --------------------------------------------------------------------------

void backward_pass(const __nv_bfloat16* x, const int64_t* d_t, const std::vector<int64_t>& t, int64_t rows, int64_t V,
                   float temp, __nv_bfloat16* d_base, __nv_bfloat16* d_var, float* d_stats) {
  const float inv_t = 1.0f / temp;
  // the forward's outputs for these rows: lib-copy's statistics, the library's finish
  launch_lib_copy<false, false>(Params{x, d_t, rows, V, inv_t, d_stats});
  CHECK(cudaGetLastError());
  std::vector<float> st(rows * kW);
  CHECK(cudaMemcpy(st.data(), d_stats, st.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<float> hv(rows * 5);
  for (int64_t i = 0; i < rows; ++i) {
    const Fin f = t[i] == kIgnore ? Fin{0, 0, 0, 0} : finish(&st[i * kW]);
    hv[i] = f.lse;
    hv[rows + i] = f.lp;
    hv[2 * rows + i] = f.h;
    hv[3 * rows + i] = g_lp_of(i);
    hv[4 * rows + i] = g_h_of(i);
  }
  float* d_row;
  CHECK(cudaMalloc(&d_row, hv.size() * 4));
  CHECK(cudaMemcpy(d_row, hv.data(), hv.size() * 4, cudaMemcpyHostToDevice));
  const float *lse = d_row, *lp = d_row + rows, *h = d_row + 2 * rows, *g_lp = d_row + 3 * rows,
              *g_h = d_row + 4 * rows;

  struct BackVariant {
    std::string name;
    std::function<void(__nv_bfloat16*)> run;
    const void* fn;
    bool values;
  };
  std::vector<BackVariant> vs;
#ifdef FUSEDCE_PROBE_LIBRARY
  vs.push_back({"lib",
                [=](__nv_bfloat16* out) {
                  using namespace fusedce;
                  cuda::LpRows r{d_t, 1, true, kIgnore, rows, 0, V, inv_t, false};
                  auto vec = [&](const float* q) { return vector(const_cast<float*>(q), DType::kFloat32, rows); };
                  cuda::launch_lp_backward(r, matrix(const_cast<__nv_bfloat16*>(x), DType::kBFloat16, rows, V),
                                           matrix(out, DType::kBFloat16, rows, V), vec(lse), vec(lp), vec(h), vec(g_lp),
                                           vec(g_h), nullptr);
                },
                nullptr, true});
#endif
  auto mine = [&](const char* name, auto form_tag, bool values, auto min_blocks) {
    constexpr Back kForm = decltype(form_tag)::value;
    constexpr int kMinB = decltype(min_blocks)::value;
    vs.push_back({name,
                  [=](__nv_bfloat16* out) {
                    back_rows<kForm, kMinB><<<static_cast<unsigned>(rows), kBlock>>>(
                        BackParams{x, out, d_t, rows, V, inv_t, lse, lp, h, g_lp, g_h});
                  },
                  reinterpret_cast<const void*>(back_rows<kForm, kMinB>), values});
  };
  using One = std::integral_constant<int, 0>;  // no minimum: __launch_bounds__(256), as the library
  mine("lib-copy", std::integral_constant<Back, Back::kLibCopy>{}, true, One{});
  mine("fastexp", std::integral_constant<Back, Back::kFast>{}, true, One{});
  mine("exp2", std::integral_constant<Back, Back::kExp2>{}, true, One{});
  mine("exp2/occ6", std::integral_constant<Back, Back::kExp2>{}, true, std::integral_constant<int, 6>{});
  mine("exp2/occ8", std::integral_constant<Back, Back::kExp2>{}, true, std::integral_constant<int, 8>{});
  mine("copy", std::integral_constant<Back, Back::kCopy>{}, false, One{});

  const std::vector<int64_t> at = sample_rows(rows, t, 4);
  std::vector<std::vector<double>> refs;
  for (int64_t r : at) refs.push_back(reference_grad(row_floats(x, r, V, true), t[r], inv_t, g_lp_of(r), g_h_of(r)));
  float *d_big, *d_diff;
  unsigned long long* d_n;
  CHECK(cudaMalloc(&d_big, rows * 4));
  CHECK(cudaMalloc(&d_diff, rows * 4));
  CHECK(cudaMalloc(&d_n, 8));
  std::printf("\n## backward, %lld rows x V %lld bf16, temperature %.1f, g_lp in [-1, 1], g_H in [-0.05, 0.05]\n",
              static_cast<long long>(rows), static_cast<long long>(V), temp);
  std::printf("accuracy: float64 at rows");
  for (int64_t r : at) std::printf(" %lld", static_cast<long long>(r));
  std::printf("; base = %s on every row\n", vs[0].name.c_str());
  std::printf("| variant | max abs err / row's max |grad| | not float64 rounded once to bf16 | vs base: max |diff| / "
              "row's max | vs base: entries differing |\n|---|---|---|---|---|\n");
  for (size_t q = 0; q < vs.size(); ++q) {
    if (!vs[q].values) continue;
    __nv_bfloat16* out = q == 0 ? d_base : d_var;
    CHECK(cudaMemset(out, 0xff, rows * V * 2));
    vs[q].run(out);
    CHECK(cudaGetLastError());
    GradAcc a;
    std::vector<__nv_bfloat16> got(V);
    for (size_t k = 0; k < at.size(); ++k) {
      CHECK(cudaMemcpy(got.data(), out + at[k] * V, V * 2, cudaMemcpyDeviceToHost));
      accumulate_grad(a, got, refs[k]);
    }
    CHECK(cudaMemset(d_n, 0, 8));
    cmp_rows<<<static_cast<unsigned>(rows), kBlock>>>(d_base, out, V, d_big, d_diff, d_n);
    CHECK(cudaGetLastError());
    std::vector<float> big(rows), diff(rows);
    unsigned long long n = 0;
    CHECK(cudaMemcpy(big.data(), d_big, rows * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(diff.data(), d_diff, rows * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&n, d_n, 8, cudaMemcpyDeviceToHost));
    double w = 0.0;
    for (int64_t i = 0; i < rows; ++i) w = nanmax(w, big[i] > 0 ? diff[i] / big[i] : diff[i]);
    std::printf("| %-9s | %.2e | %.2e | %.2e | %llu of %lld |\n", vs[q].name.c_str(), a.rel, double(a.wrong) / a.n, w, n,
                static_cast<long long>(rows * V));
  }
  std::vector<Timed> timed;
  for (const BackVariant& v : vs) {
    timed.push_back({v.name, [&v, d_var]() { v.run(d_var); }, double(rows) * V * 4.0,
                     v.fn ? kernel_info(v.fn, rows) : std::string("library (see -Xptxas -v)")});
  }
  std::printf("\ntiming (bytes = rows x V x 2 read + the same written)\n");
  print_times(timed, time_rounds(timed), "read + write");
  CHECK(cudaFree(d_row));
  CHECK(cudaFree(d_big));
  CHECK(cudaFree(d_diff));
  CHECK(cudaFree(d_n));
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 1408, V = argc > 2 ? std::atoll(argv[2]) : 151936;
  const int64_t brows = argc > 3 ? std::atoll(argv[3]) : 8192, bV = argc > 4 ? std::atoll(argv[4]) : 50688;
  if (rows < 16 || brows < 16 || V < 8 || bV < 8) {
    std::fprintf(stderr, "rows >= 16 and V >= 8 here\n");
    return 1;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    (void)cudaGetLastError();
    return host_emulation(V, bV);
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  std::printf("%s: %d SMs, L2 %d MiB; statistics %lld x %lld, backward %lld x %lld (bf16)\n", prop.name, g_sms,
              prop.l2CacheSize >> 20, static_cast<long long>(rows), static_cast<long long>(V),
              static_cast<long long>(brows), static_cast<long long>(bV));

  __nv_bfloat16 *x, *bx, *base, *var;
  int64_t *d_t, *d_bt;
  float *d_out, *d_lib, *d_scratch, *d_bstats;
  CHECK(cudaMalloc(&x, rows * V * 2));
  CHECK(cudaMalloc(&bx, brows * bV * 2));
  CHECK(cudaMalloc(&base, brows * bV * 2));
  CHECK(cudaMalloc(&var, brows * bV * 2));
  CHECK(cudaMalloc(&d_t, rows * 8));
  CHECK(cudaMalloc(&d_bt, brows * 8));
  CHECK(cudaMalloc(&d_out, rows * kW * 4));
  CHECK(cudaMalloc(&d_lib, (rows + 1) * 16 * 4));
  CHECK(cudaMalloc(&d_scratch, int64_t(g_sms) * 8 * 4));
  CHECK(cudaMalloc(&d_bstats, brows * kW * 4));
  fill<<<4096, 256>>>(x, rows, V, 1);
  fill<<<4096, 256>>>(bx, brows, bV, 2);
  CHECK(cudaGetLastError());
  const std::vector<int64_t> t = make_targets(1, rows, V), bt = make_targets(2, brows, bV);
  CHECK(cudaMemcpy(d_t, t.data(), rows * 8, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_bt, bt.data(), brows * 8, cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());

  for (float temp : {1.0f, 0.7f}) stats_pass(x, d_t, t, rows, V, temp, d_out, d_lib, d_scratch);
  for (float temp : {1.0f, 0.7f}) backward_pass(bx, d_bt, bt, brows, bV, temp, base, var, d_bstats);
  return 0;
}
