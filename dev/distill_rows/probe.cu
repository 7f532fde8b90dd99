// Experiment: what bounds the fused distillation's forward row kernel (src/cuda/distill/
// distill_kernels.cu, full_forward_kernel), and which form reaches the memory time. Per row of a
// token chunk of both heads' bf16 logits (z_s, z_t, temperature 1): the two log-sum-exps, then
// the student's entropy, the generalized JSD at beta 0.5 and its auxiliary KL(p_s || m).
// Reading each head twice takes about a third of the best form's time here (the read variant).
//
// Variants, each one block per row unless said:
//   lib     the library's form: pass 1 an online max-and-sum per column (a branch and an exp per
//           column per head, a dependent chain through the running max), pass 2 e^s, e^t and the
//           mixture's log per column with expf / logf, float sums per group of 8 added in double;
//   gmax    pass 1 per group of 8: the group's max first (a tree), one rescale of the running sum
//           when it grows, then 8 independent exps summed as a tree;
//   exp2    gmax with the logits scaled by log2(e) once: exp2f / log2f (one MUFU instruction and
//           little else each), sums in log2 units scaled by ln 2 at the end;
//   exp2/128, exp2/512: exp2 with 128 or 512 threads a row;
//   read    the same two passes with a max and a plain sum in place of the exponentials: the
//           memory time of the reads and reductions alone (its values are not the loss's).
// Then the backward row pass (the student's chunk becomes d loss / d z in place, from the
// forward's lse and aux, for an upstream gradient of 1): lib (expf, logf) and exp2, 256 threads,
// beside a pass that reads one head and writes it back (its memory time). The backward's values
// are checked against float64 at 6 rows, relative to each row's largest |gradient|.
// Each forward variant is checked against float64 on the host at 6 rows (lse, entropy, JSD, aux)
// and against the lib variant on every row before it is timed (CUDA events, median of 20 after 3 warm-up calls,
// chunk larger than L2). Printed: ms a chunk, the two passes' bytes over that time (GB/s), and the
// largest differences.
//
// With FUSEDCE_PROBE_LIBRARY the library's own forward kernel runs too (linked from its source).
// The exp2 form with one of the library's features added, to find what costs the library's
// kernel its time: exp2/cap the head transform with its soft-cap branch inline (never taken);
// exp2/kinds the divergence chosen per column by a runtime kind, with the library's exit where
// the mixture underflows; exp2/hard the hard term's third running state behind a runtime flag
// (false here); exp2/nan the NaN-keeping group max and its exit for a group of -inf; exp2/all4
// all four.
//
// Build (here, no GPU):
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo dev/distill_rows/probe.cu -o build-probe/distill_rows
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo --expt-relaxed-constexpr -DFUSEDCE_PROBE_LIBRARY
//     -DFUSEDCE_WITH_CUDA -Iinclude -Isrc dev/distill_rows/probe.cu src/cuda/distill/distill_kernels.cu
//     -o build-probe/distill_rows_lib
// Run (GPU): build-probe/distill_rows [rows] [V]   (default 2731 128256: one of three chunks of 8192)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifdef FUSEDCE_PROBE_LIBRARY
#include "common/distill_math.h"
#include "cuda/distill/distill_kernels.h"
#endif

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

namespace {

constexpr float kBeta = 0.5f;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

/// Out per row: lse_s, lse_t, entropy, divergence, aux.
struct RowOut {
  double lse_s, lse_t, entropy, jsd, aux;
};

// ---- inputs: peaked logits from a hash (reproducible on host and device) ---------------------

__host__ __device__ uint32_t mix32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

/// A logit: the sum of three uniforms (about normal, sd 1.5), plus 9 at the row's peak column
/// (the student's and teacher's peaks differ on a third of the rows).
__host__ __device__ float logit(uint64_t row, uint64_t col, int head, uint64_t V) {
  float u = 0.0f;
  for (int k = 0; k < 3; ++k) u += mix32((row * V + col) * 8 + head * 4 + k) * (1.0f / 4294967296.0f);
  float z = (u - 1.5f) * 3.0f;
  const uint64_t peak = mix32(row * 2 + (head == 1 && row % 3 == 0 ? 1 : 0)) % V;
  if (col == peak) z += 9.0f;
  return z;
}

__global__ void fill(__nv_bfloat16* x, int64_t rows, int64_t V, int head) {
  const int64_t n = rows * V;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    x[e] = __float2bfloat16(logit(e / V, e % V, head, V));
  }
}

// ---- block reductions -------------------------------------------------------------------------

template <int kThreads, int K>
__device__ void block_sum(double (&v)[K]) {
  __shared__ double smem[K][kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int q = 0; q < K; ++q) {
    for (int off = 16; off > 0; off >>= 1) v[q] += __shfl_down_sync(0xffffffffu, v[q], off);
    if (lane == 0) smem[q][warp] = v[q];
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < K; ++q) {
    double t = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) t += smem[q][w];
    v[q] = t;
  }
  __syncthreads();
}

template <int kThreads, int K>
__device__ void block_max(float (&m)[K]) {
  __shared__ float smem[K][kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int q = 0; q < K; ++q) {
    for (int off = 16; off > 0; off >>= 1) m[q] = fmaxf(m[q], __shfl_down_sync(0xffffffffu, m[q], off));
    if (lane == 0) smem[q][warp] = m[q];
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < K; ++q) {
    float t = -INFINITY;
    for (int w = 0; w < kThreads / 32; ++w) t = fmaxf(t, smem[q][w]);
    m[q] = t;
  }
  __syncthreads();
}

/// A thread's running max m and sum s of exp(z - m) (exp2 units: 2^(z - m)).
struct Online {
  float m;
  double s;
};

/// The block's log-sum-exps of K running states: m + log(s) (log2 units where kExp2).
template <int kThreads, int K, bool kExp2>
__device__ void block_lse(Online (&a)[K], float (&m)[K], float (&l)[K]) {
#pragma unroll
  for (int q = 0; q < K; ++q) m[q] = a[q].m;
  block_max<kThreads, K>(m);
  double s[K];
#pragma unroll
  for (int q = 0; q < K; ++q) {
    s[q] = a[q].m == m[q] ? a[q].s : a[q].s * (kExp2 ? exp2(double(a[q].m) - m[q]) : exp(double(a[q].m) - m[q]));
  }
  block_sum<kThreads, K>(s);
#pragma unroll
  for (int q = 0; q < K; ++q) l[q] = static_cast<float>(kExp2 ? log2(s[q]) : log(s[q]));
}

/// Eight bf16 logits in a 16-byte word, as float.
__device__ __forceinline__ void unpack8(uint4 w, float (&v)[8]) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(u[k] << 16);
    v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
  }
}

/// Eight bf16 logits of a row at a 16-byte aligned address, as float.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), v);
}

/// f(group of 8 of each head) over this thread's groups (V a multiple of 8, rows 16-byte aligned),
/// four groups of each head loaded before any is used.
template <int kThreads, typename F>
__device__ __forceinline__ void visit(const __nv_bfloat16* xs, const __nv_bfloat16* xt, int64_t V, F&& f) {
  const int64_t groups = V / 8;
  int64_t g = threadIdx.x;
  for (; g + 3 * kThreads < groups; g += 4 * kThreads) {
    uint4 ws[4], wt[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      ws[u] = *reinterpret_cast<const uint4*>(xs + (g + u * kThreads) * 8);
      wt[u] = *reinterpret_cast<const uint4*>(xt + (g + u * kThreads) * 8);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      float a[8], b[8];
      unpack8(ws[u], a);
      unpack8(wt[u], b);
      f(a, b);
    }
  }
  for (; g < groups; g += kThreads) {
    float a[8], b[8];
    load8(xs + g * 8, a);
    load8(xt + g * 8, b);
    f(a, b);
  }
}

// ---- pass 1 forms -----------------------------------------------------------------------------

/// lib: per column, a branch and an exp, chained through the running max; a group's float state
/// folded into the thread's double one.
__device__ __forceinline__ void online_column(float& m, float& s, float z) {
  if (z > m) {
    s = s * expf(m - z) + 1.0f;
    m = z;
  } else {
    s += z == m ? 1.0f : expf(z - m);
  }
}

template <bool kExp2>
__device__ __forceinline__ void fold(Online& a, float gm, float gs) {
  if (gm > a.m) {
    a.s = a.s * (kExp2 ? exp2f(a.m - gm) : expf(a.m - gm)) + gs;
    a.m = gm;
  } else {
    a.s += static_cast<double>(gs * (kExp2 ? exp2f(gm - a.m) : expf(gm - a.m)));
  }
}

/// The larger of m and z, NaN sticking (the library's max_nan).
__device__ __forceinline__ float max_nan(float m, float z) { return isnan(z) || z > m ? z : m; }

/// gmax: the group's max first, then its exps, independent of each other (kNan: the library's
/// NaN-keeping max and its early exit for a group of -inf).
template <bool kExp2, bool kNan = false>
__device__ __forceinline__ void group_max_sum(Online& a, const float (&z)[8]) {
  float gm;
  if (kNan) {
    gm = z[0];
#pragma unroll
    for (int k = 1; k < 8; ++k) gm = max_nan(gm, z[k]);
    if (gm == -INFINITY) return;
  } else {
    gm = fmaxf(fmaxf(fmaxf(z[0], z[1]), fmaxf(z[2], z[3])), fmaxf(fmaxf(z[4], z[5]), fmaxf(z[6], z[7])));
  }
  float e[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) e[k] = kExp2 ? exp2f(z[k] - gm) : expf(z[k] - gm);
  const float gs = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
  fold<kExp2>(a, gm, gs);
}

// ---- the kernel -------------------------------------------------------------------------------

enum class Form { kLib, kGmax, kExp2, kExp2Cap, kExp2Kinds, kExp2Hard, kExp2Nan, kLibLike, kRead };

/// The library's head transform, its soft-cap branch inline in the loop (taken only for cap > 0):
/// exp2/cap asks whether code that never runs but sits in the unrolled loop costs time.
__device__ __forceinline__ float head_transform(float x, float scale, float cap) {
  const float y = scale * x;
  return cap > 0.0f ? cap * tanhf(y / cap) : y;
}

template <int kThreads, Form kForm>
__global__ void __launch_bounds__(kThreads) forward_rows(const __nv_bfloat16* zs, const __nv_bfloat16* zt,
                                                         int64_t V, RowOut* out, float scale, float cap, int kind,
                                                         bool hard) {
  // the library's features one at a time (kLibLike: all four)
  constexpr bool kLike = kForm == Form::kLibLike;
  constexpr bool kCap = kForm == Form::kExp2Cap || kLike;
  constexpr bool kKinds = kForm == Form::kExp2Kinds || kLike;
  constexpr bool kHard = kForm == Form::kExp2Hard || kLike;
  constexpr bool kNan = kForm == Form::kExp2Nan || kLike;
  constexpr bool kE2 = kForm == Form::kExp2 || kCap || kKinds || kHard || kNan;
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* xs = zs + row * V;
  const __nv_bfloat16* xt = zt + row * V;
  const float c = kE2 ? kLog2e : 1.0f;  // logits to the units of the exponentials used
  Online a[kHard ? 3 : 2] = {};
#pragma unroll
  for (int q = 0; q < (kHard ? 3 : 2); ++q) a[q] = Online{-INFINITY, 0.0};
  visit<kThreads>(xs, xt, V, [&](float (&vs)[8], float (&vt)[8]) {
    if (kForm == Form::kRead) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        a[0].m = fmaxf(a[0].m, vs[k]);
        a[1].m = fmaxf(a[1].m, vt[k]);
      }
    } else if (kForm == Form::kLib) {
      float ms = -INFINITY, ss = 0.0f, mt = -INFINITY, st = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        online_column(ms, ss, vs[k]);
        online_column(mt, st, vt[k]);
      }
      fold<false>(a[0], ms, ss);
      fold<false>(a[1], mt, st);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        vs[k] = (kCap ? head_transform(vs[k], scale, cap) : vs[k]) * c;
        vt[k] = (kCap ? head_transform(vt[k], scale, cap) : vt[k]) * c;
      }
      group_max_sum<kE2, kNan>(a[0], vs);
      group_max_sum<kE2, kNan>(a[1], vt);
      if constexpr (kHard) {
        if (hard) group_max_sum<kE2, kNan>(a[2], vs);  // the hard term's state (never, here)
      }
    }
  });
  float m[kHard ? 3 : 2], l[kHard ? 3 : 2];
  block_lse<kThreads, kHard ? 3 : 2, kE2>(a, m, l);
  // pass 2, against (m + l): s, t log-probabilities (log2 units for exp2)
  const float one_mb = 1.0f - kBeta;
  double acc[3] = {0.0, 0.0, 0.0};
  visit<kThreads>(xs, xt, V, [&](float (&vs)[8], float (&vt)[8]) {
    float pe = 0.0f, pd = 0.0f, pa = 0.0f;
    if (kForm == Form::kRead) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        pe += vs[k];
        pd += vt[k];
      }
    }
#pragma unroll
    for (int k = 0; k < (kForm == Form::kRead ? 0 : 8); ++k) {
      const float ys = kCap ? head_transform(vs[k], scale, cap) : vs[k];
      const float yt = kCap ? head_transform(vt[k], scale, cap) : vt[k];
      const float s = (ys * c - m[0]) - l[0], t = (yt * c - m[1]) - l[1];
      const float ps = kE2 ? exp2f(s) : expf(s), pt = kE2 ? exp2f(t) : expf(t);
      if constexpr (kKinds) {
        // the library's entry_terms2: the divergence by a runtime kind, nothing more where the
        // mixture underflows
        pe += ps == 0.0f ? 0.0f : ps * s;
        if (kind == 0) {
          pd += pt == 0.0f ? 0.0f : pt * (t - s);
        } else if (kind == 1) {
          pd += ps == 0.0f ? 0.0f : ps * (s - t);
        } else {
          const float mix = one_mb * ps + kBeta * pt;
          if (mix != 0.0f) {
            const float lm = log2f(mix);
            const float fs = ps == 0.0f ? 0.0f : ps * (s - lm);
            pd += (pt == 0.0f ? 0.0f : kBeta * pt * (t - lm)) + one_mb * fs;
            pa += fs;
          }
        }
        continue;
      }
      const float mix = one_mb * ps + kBeta * pt;
      const float lm = kE2 ? log2f(mix) : logf(mix);
      const float fs = ps == 0.0f ? 0.0f : ps * (s - lm);
      pe += ps == 0.0f ? 0.0f : ps * s;
      pd += (pt == 0.0f ? 0.0f : kBeta * pt * (t - lm)) + one_mb * fs;
      pa += fs;
    }
    acc[0] += pe;
    acc[1] += pd;
    acc[2] += pa;
  });
  block_sum<kThreads, 3>(acc);
  if (threadIdx.x == 0) {
    const double u = kE2 ? kLn2 : 1.0;  // back to natural units
    out[row] = RowOut{(double(m[0]) + l[0]) * u, (double(m[1]) + l[1]) * u, -acc[0] * u, acc[1] * u, acc[2] * u};
  }
}

// ---- the backward row pass --------------------------------------------------------------------

enum class Back { kLib, kExp2, kCopy };

/// xs (the student's chunk) becomes d JSD / d z_s per column, from the row's forward results;
/// xt is read (the teacher's chunk). kCopy only reads xs and writes it back.
template <int kThreads, Back kForm>
__global__ void __launch_bounds__(kThreads) backward_rows(__nv_bfloat16* zs, const __nv_bfloat16* zt, int64_t V,
                                                          const RowOut* fwd) {
  constexpr bool kE2 = kForm == Back::kExp2;
  const int64_t row = blockIdx.x;
  __nv_bfloat16* xs = zs + row * V;
  const __nv_bfloat16* xt = zt + row * V;
  const float c = kE2 ? kLog2e : 1.0f;
  const float ls = static_cast<float>(fwd[row].lse_s * c), lt = static_cast<float>(fwd[row].lse_t * c);
  const float aux = static_cast<float>(fwd[row].aux * c);  // in the units of s, t
  const float one_mb = 1.0f - kBeta, scale = kE2 ? kLn2 : 1.0f;
  for (int64_t g = threadIdx.x; g < V / 8; g += kThreads) {
    float a[8], b[8];
    load8(xs + g * 8, a);
    if (kForm != Back::kCopy) load8(xt + g * 8, b);
    __align__(16) __nv_bfloat162 o[4];
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      float d[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (kForm == Back::kCopy) {
          d[e] = a[k + e];
          continue;
        }
        const float s = a[k + e] * c - ls, t = b[k + e] * c - lt;
        const float ps = kE2 ? exp2f(s) : expf(s), pt = kE2 ? exp2f(t) : expf(t);
        const float mix = one_mb * ps + kBeta * pt;
        d[e] = mix == 0.0f ? 0.0f : one_mb * ps * (s - (kE2 ? log2f(mix) : logf(mix)) - aux) * scale;
      }
      o[k / 2] = __floats2bfloat162_rn(d[0], d[1]);
    }
    *reinterpret_cast<uint4*>(xs + g * 8) = *reinterpret_cast<const uint4*>(o);
  }
}

/// A row's float64 gradient d JSD / d z_s (the forward's definitions).
std::vector<double> reference_grad(int64_t row, int64_t V, const RowOut& r) {
  std::vector<double> g(V);
  for (int64_t j = 0; j < V; ++j) {
    const double zs = __bfloat162float(__float2bfloat16(logit(row, j, 0, V)));
    const double zt = __bfloat162float(__float2bfloat16(logit(row, j, 1, V)));
    const double s = zs - r.lse_s, t = zt - r.lse_t, ps = std::exp(s), pt = std::exp(t);
    g[j] = (1.0 - kBeta) * ps * (s - std::log((1.0 - kBeta) * ps + kBeta * pt) - r.aux);
  }
  return g;
}

template <int kThreads, Back kForm>
void run_back(const char* name, const __nv_bfloat16* zs, const __nv_bfloat16* zt, __nv_bfloat16* work, int64_t rows,
              int64_t V, const RowOut* fwd, const std::vector<std::vector<double>>& refs,
              const std::vector<int64_t>& at) {
  CHECK(cudaMemcpy(work, zs, rows * V * 2, cudaMemcpyDeviceToDevice));
  backward_rows<kThreads, kForm><<<rows, kThreads>>>(work, zt, V, fwd);
  CHECK(cudaGetLastError());
  double worst_rel = 0.0;
  if (kForm != Back::kCopy) {
    std::vector<__nv_bfloat16> got(V);
    for (size_t q = 0; q < at.size(); ++q) {
      CHECK(cudaMemcpy(got.data(), work + at[q] * V, V * 2, cudaMemcpyDeviceToHost));
      double big = 0.0, err = 0.0;
      for (int64_t j = 0; j < V; ++j) {
        big = std::max(big, std::abs(refs[q][j]));
        err = std::max(err, std::abs(double(__bfloat162float(got[j])) - refs[q][j]));
      }
      worst_rel = std::max(worst_rel, err / big);
    }
  } else {
    worst_rel = NAN;
  }
  std::vector<float> ms;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int k = 0; k < 23; ++k) {
    CHECK(cudaMemcpy(work, zs, rows * V * 2, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(a));
    backward_rows<kThreads, kForm><<<rows, kThreads>>>(work, zt, V, fwd);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.0f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (k >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2], bytes = (kForm == Back::kCopy ? 2.0 : 3.0) * rows * V * 2.0;
  std::printf("| %-9s | %7.3f | %6.0f | %.2e |\n", name, med, bytes / med / 1e6, worst_rel);
}

RowOut reference(int64_t row, int64_t V) {
  std::vector<double> zs(V), zt(V);
  double ms = -INFINITY, mt = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    zs[j] = __bfloat162float(__float2bfloat16(logit(row, j, 0, V)));
    zt[j] = __bfloat162float(__float2bfloat16(logit(row, j, 1, V)));
    ms = std::max(ms, zs[j]);
    mt = std::max(mt, zt[j]);
  }
  double ss = 0.0, st = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    ss += std::exp(zs[j] - ms);
    st += std::exp(zt[j] - mt);
  }
  RowOut r{ms + std::log(ss), mt + std::log(st), 0.0, 0.0, 0.0};
  for (int64_t j = 0; j < V; ++j) {
    const double s = zs[j] - r.lse_s, t = zt[j] - r.lse_t, ps = std::exp(s), pt = std::exp(t);
    const double lm = std::log((1.0 - kBeta) * ps + kBeta * pt);
    r.entropy -= ps * s;
    r.jsd += kBeta * pt * (t - lm) + (1.0 - kBeta) * ps * (s - lm);
    r.aux += ps * (s - lm);
  }
  return r;
}

double worst(const std::vector<RowOut>& a, const std::vector<RowOut>& b) {
  double w = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d[5] = {a[i].lse_s - b[i].lse_s, a[i].lse_t - b[i].lse_t, a[i].entropy - b[i].entropy,
                         a[i].jsd - b[i].jsd, a[i].aux - b[i].aux};
    for (double x : d) w = std::max(w, std::abs(x));
  }
  return w;
}

template <int kThreads, Form kForm>
void run(const char* name, const __nv_bfloat16* zs, const __nv_bfloat16* zt, int64_t rows, int64_t V,
         RowOut* out, const std::vector<RowOut>* lib, std::vector<RowOut>* keep) {
  forward_rows<kThreads, kForm><<<rows, kThreads>>>(zs, zt, V, out, 1.0f, 0.0f, 2, false);
  CHECK(cudaGetLastError());
  std::vector<RowOut> got(rows);
  CHECK(cudaMemcpy(got.data(), out, rows * sizeof(RowOut), cudaMemcpyDeviceToHost));
  double vs_ref = 0.0;
  for (int64_t row : {int64_t(0), int64_t(1), int64_t(2), rows / 2, rows - 2, rows - 1}) {
    const RowOut r = reference(row, V);
    vs_ref = std::max(vs_ref, worst({got[row]}, {r}));
  }
  const bool values = kForm != Form::kRead;
  if (!values) vs_ref = NAN;
  const double vs_lib = lib != nullptr && values ? worst(got, *lib) : NAN;
  if (keep != nullptr) *keep = got;
  for (int k = 0; k < 3; ++k) forward_rows<kThreads, kForm><<<rows, kThreads>>>(zs, zt, V, out, 1.0f, 0.0f, 2, false);
  std::vector<float> ms;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int k = 0; k < 20; ++k) {
    CHECK(cudaEventRecord(a));
    forward_rows<kThreads, kForm><<<rows, kThreads>>>(zs, zt, V, out, 1.0f, 0.0f, 2, false);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.0f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2], bytes = 2.0 * 2.0 * rows * V * 2.0;
  std::printf("| %-9s | %7.3f | %6.0f | %.2e | %.2e |\n", name, med, bytes / med / 1e6, vs_ref, vs_lib);
}

}  // namespace

#ifdef FUSEDCE_PROBE_LIBRARY
/// The library's own forward row kernel (src/cuda/distill/distill_kernels.cu, linked in) on the
/// same logits: JSD at beta 0.5, temperature 1, no labels; its lse's checked against lib's.
void run_library(const __nv_bfloat16* zs, const __nv_bfloat16* zt, int64_t rows, int64_t V,
                 const std::vector<RowOut>& lib) {
  using namespace fusedce::cuda;
  float *stats, *row_loss, *div, *ent;
  CHECK(cudaMalloc(&stats, rows * 4 * sizeof(float)));
  CHECK(cudaMalloc(&row_loss, rows * sizeof(float)));
  CHECK(cudaMalloc(&div, rows * sizeof(float)));
  CHECK(cudaMalloc(&ent, rows * sizeof(float)));
  DistillForwardParams p{};
  p.r.rows = rows;
  p.r.V = V;
  p.r.v_total = V;
  p.r.kind = static_cast<int>(fusedce::detail::DivergenceKind::kJsd);
  p.r.beta = kBeta;
  p.r.one_mb = 1.0f - kBeta;
  p.r.log_1mb = std::log(1.0f - kBeta);
  p.r.log_b = std::log(kBeta);
  p.r.inv_t = 1.0f;
  p.r.s_scale = p.r.t_scale = 1.0f;
  p.logits = zs;
  p.ld = V;
  p.dtype = fusedce::DType::kBFloat16;
  p.t.logits = zt;
  p.t.ld = V;
  p.t.dtype = fusedce::DType::kBFloat16;
  p.stats = stats;
  p.stats_width = 4;
  p.row_loss = row_loss;
  p.row_loss_stride = 1;
  p.divergence = div;
  p.divergence_stride = 1;
  p.entropy = ent;
  p.entropy_stride = 1;
  launch_distill_forward(p, nullptr);
  CHECK(cudaGetLastError());
  std::vector<float> st(rows * 4), d(rows);
  CHECK(cudaMemcpy(st.data(), stats, st.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(d.data(), div, d.size() * 4, cudaMemcpyDeviceToHost));
  double w = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    w = std::max({w, std::abs(st[i * 4] - lib[i].lse_s), std::abs(st[i * 4 + 1] - lib[i].lse_t),
                  std::abs(d[i] - lib[i].jsd)});
  }
  std::vector<float> ms;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int k = 0; k < 23; ++k) {
    CHECK(cudaEventRecord(a));
    launch_distill_forward(p, nullptr);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.0f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (k >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2], bytes = 2.0 * 2.0 * rows * V * 2.0;
  std::printf("| %-9s | %7.3f | %6.0f | %s | %.2e |\n", "library", med, bytes / med / 1e6, "(lse, jsd vs lib)", w);
}
#endif

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 2731, V = argc > 2 ? std::atoll(argv[2]) : 128256;
  if (V % 8 != 0) {
    std::fprintf(stderr, "V must be a multiple of 8 here\n");
    return 1;
  }
  __nv_bfloat16 *zs, *zt;
  RowOut* out;
  CHECK(cudaMalloc(&zs, rows * V * 2));
  CHECK(cudaMalloc(&zt, rows * V * 2));
  CHECK(cudaMalloc(&out, rows * sizeof(RowOut)));
  fill<<<4096, 256>>>(zs, rows, V, 0);
  fill<<<4096, 256>>>(zt, rows, V, 1);
  CHECK(cudaDeviceSynchronize());
  std::printf("rows %lld, V %lld, bf16, JSD beta 0.5: one call of the forward row pass\n", (long long)rows,
              (long long)V);
  std::printf("| variant | ms | GB/s (2 passes x 2 heads) | max diff vs float64 (6 rows) | max diff vs lib |\n");
  std::printf("|---|---|---|---|---|\n");
  std::vector<RowOut> lib;
  run<256, Form::kLib>("lib", zs, zt, rows, V, out, nullptr, &lib);
  run<256, Form::kGmax>("gmax", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kExp2>("exp2", zs, zt, rows, V, out, &lib, nullptr);
  run<128, Form::kExp2>("exp2/128", zs, zt, rows, V, out, &lib, nullptr);
  run<512, Form::kExp2>("exp2/512", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kExp2Cap>("exp2/cap", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kExp2Kinds>("exp2/kinds", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kExp2Hard>("exp2/hard", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kExp2Nan>("exp2/nan", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kLibLike>("exp2/all4", zs, zt, rows, V, out, &lib, nullptr);
  run<256, Form::kRead>("read", zs, zt, rows, V, out, &lib, nullptr);
#ifdef FUSEDCE_PROBE_LIBRARY
  run_library(zs, zt, rows, V, lib);
#endif

  // the backward, from the lib forward's results (its rows' float64 reference from the host's)
  RowOut* fwd;
  __nv_bfloat16* work;
  CHECK(cudaMalloc(&fwd, rows * sizeof(RowOut)));
  CHECK(cudaMalloc(&work, rows * V * 2));
  CHECK(cudaMemcpy(fwd, lib.data(), rows * sizeof(RowOut), cudaMemcpyHostToDevice));
  const std::vector<int64_t> at{0, 1, rows / 2, rows - 1};
  std::vector<std::vector<double>> refs;
  for (int64_t row : at) refs.push_back(reference_grad(row, V, lib[row]));
  std::printf("\nthe backward row pass (d JSD / d z_s in place, from the lib forward's lse and aux)\n");
  std::printf("| variant | ms | GB/s (reads + write) | max |diff| vs float64 / row's max |grad| (4 rows) |\n");
  std::printf("|---|---|---|---|\n");
  run_back<256, Back::kLib>("lib", zs, zt, work, rows, V, fwd, refs, at);
  run_back<256, Back::kExp2>("exp2", zs, zt, work, rows, V, fwd, refs, at);
  run_back<256, Back::kCopy>("copy", zs, zt, work, rows, V, fwd, refs, at);
  return 0;
}
