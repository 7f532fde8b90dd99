// The CUDA row kernels of the fused linear distillation (fusedce/distill.h), between the matrix
// products of distill_cuda.cpp: per row of a token chunk,
//   forward: the student's (and, full form, the teacher's) logits chunk in; the row's
//     log-normalisers, entropy, divergence and hard term out, and the statistics the backward
//     reads. Two passes over each row: the log-sum-exps (an online max-and-sum per thread,
//     merged in a fixed order), then the sums against them.
//   backward: the student's logits chunk becomes, in place, the gradient of the row's loss with
//     respect to those logits (one pass; the top-k form adds its entries' terms afterwards, once
//     per distinct id, after sorting (id, k) keys so that repeated ids add in k order).
// The definitions are the CPU backend's (src/cpu/distill_cpu.cpp, common/distill_math.h); every
// reduction runs in a fixed order, so results are the same bits run to run. Nothing of size
// (N, V) is stored beyond the caller's chunk; a row reads 2 (forward) or 1 (backward) passes
// of V logits per head and the backward writes V: memory-bound, beside the chunk's products.
// No host synchronisation: a label outside [0, V) that is not ignore_index, or a top-k id
// outside [0, V), makes its row's outputs NaN instead of an error.
#include "cuda/port.h"  // first: the platform's runtime header

#include <cstdint>
#include <type_traits>

#include "common/distill_math.h"
#include "cuda/distill/distill_kernels.h"
#include "cuda/vec.cuh"
#include "fusedce/distill.h"

namespace fusedce {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kW = kDistillStatsWidth;
// Columns a thread takes at once (16 bytes of a 16-bit type, 32 of float32; see row_chunks).
constexpr int kGroup = 8;
// TRL's tail bucket (as the CPU backend): the K entries' log-sum is clamped to at most this.
constexpr double kTailMaxLogSum = -1e-7;

using detail::DivergenceKind;
using detail::Transform;

// ---- block reductions (fixed order: lanes by shuffle tree, then warps in index order) ---------

/// Sums v[0 .. K) over the block; every thread gets the same values. `smem` holds K x kWarps.
template <int K>
__device__ void block_sum(double (&v)[K], double* smem) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int q = 0; q < K; ++q) {
    for (int off = kWarpSize / 2; off > 0; off >>= 1) v[q] += shfl_down(v[q], off);
    if (lane == 0) smem[q * kWarps + warp] = v[q];
  }
  __syncthreads();  // every warp's partial written before any thread adds them
#pragma unroll
  for (int q = 0; q < K; ++q) {
    double t = 0.0;
    for (int w = 0; w < kWarps; ++w) t += smem[q * kWarps + w];
    v[q] = t;
  }
  __syncthreads();  // read by all before the next reduction writes smem again
}

/// Largest of m[0 .. K) over the block (NaN ignored, as fmaxf).
template <int K>
__device__ void block_max(float (&m)[K], float* smem) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int q = 0; q < K; ++q) {
    for (int off = kWarpSize / 2; off > 0; off >>= 1) m[q] = fmaxf(m[q], shfl_down(m[q], off));
    if (lane == 0) smem[q * kWarps + warp] = m[q];
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < K; ++q) {
    float t = -INFINITY;
    for (int w = 0; w < kWarps; ++w) t = fmaxf(t, smem[q * kWarps + w]);
    m[q] = t;
  }
  __syncthreads();
}

/// Whether any thread of the block passes true.
__device__ bool block_any(bool b) { return __syncthreads_or(b) != 0; }

// ---- log-sum-exp ------------------------------------------------------------------------------

/// A thread's running log-sum-exp: max m and sum s of exp(z - m).
struct Online {
  float m;
  double s;
};

__device__ __forceinline__ Online online_empty() { return Online{-INFINITY, 0.0}; }

__device__ __forceinline__ double online_scaled(const Online& a, float m) {
  return a.m == m ? a.s : a.s * static_cast<double>(expf(a.m - m));
}

/// A row's log-normaliser as the kernels use it: log p = (z - m) - l, lse = m + l (in double:
/// `full`). An infinite max (or no entries) gives lse = m, as the CPU backend.
struct Lse {
  float m, l;
  double full;
};

__device__ __forceinline__ float logp(const Lse& a, float z) { return (z - a.m) - a.l; }

/// The block's log-normalisers of K running states (each thread's own in a[q]).
template <int K>
__device__ void block_lse(Online (&a)[K], Lse (&out)[K], float* fsmem, double* dsmem) {
  float m[K];
#pragma unroll
  for (int q = 0; q < K; ++q) m[q] = a[q].m;
  block_max<K>(m, fsmem);
  double s[K];
#pragma unroll
  for (int q = 0; q < K; ++q) s[q] = m[q] == -INFINITY ? 0.0 : online_scaled(a[q], m[q]);
  block_sum<K>(s, dsmem);
#pragma unroll
  for (int q = 0; q < K; ++q) {
    if (isinf(m[q])) {
      out[q] = Lse{m[q], 0.0f, static_cast<double>(m[q])};
    } else {
      const double l = log(s[q]);
      out[q] = Lse{m[q], static_cast<float>(l), static_cast<double>(m[q]) + l};
    }
  }
}

// ---- the forwards' log-sum-exp ------------------------------------------------------------------
//
// e^x is formed as 2^(x log2 e): 2^x is one special-function instruction where expf is several
// (the difference z - max is formed first and then scaled, so its rounding stays relative to the
// difference). A group of kGroup columns takes its max first, then its kGroup exponentials
// independently of each other (no dependent chain through a running max per column), and folds
// into the thread's running state once. The state stays in natural units (max m, sum of
// e^(z - m)), so a row whose other columns all underflow has lse = its max exactly.

constexpr float kLog2e = 1.4426950408889634f;
constexpr double kLn2 = 0.6931471805599453;

__device__ __forceinline__ float exp_via2(float x) { return exp2f(x * kLog2e); }

/// The larger of m and z, NaN sticking (fmaxf would drop it, and a NaN logit must reach the loss).
__device__ __forceinline__ float max_nan(float m, float z) { return isnan(z) || z > m ? z : m; }

/// Adds n (kGroup, or 1 for a tail column) values z to a running state: the group's max g, the
/// sum of e^(z - g) in float (at most kGroup terms, each <= 1), folded in double. A group of
/// -inf adds nothing; NaN reaches the sum; an infinite max leaves a sum block_lse ignores (its
/// log-normaliser is the max).
__device__ __forceinline__ void group_lse_add(Online& a, const float (&z)[kGroup], int n) {
  float g = z[0];
#pragma unroll
  for (int k = 1; k < kGroup; ++k) {
    if (k < n) g = max_nan(g, z[k]);
  }
  if (g == -INFINITY) return;
  float e[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) e[k] = k < n ? exp_via2(z[k] - g) : 0.0f;
  const float s = ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
  if (g > a.m) {
    a.s = a.s * static_cast<double>(exp_via2(a.m - g)) + static_cast<double>(s);
    a.m = g;
  } else {
    a.s += static_cast<double>(s * exp_via2(g - a.m));
  }
}

// ---- rows -------------------------------------------------------------------------------------

// Row access in groups of 8 consecutive elements (16 bytes of a 16-bit type, 32 of float32),
// kUnroll groups of each head loaded before any is used; a row whose start (in either head) is
// not 16-byte aligned, and the last V % 8 columns, go element by element. Each thread visits the
// columns of its groups, then its tail columns, in a fixed order: the same bits run to run.
constexpr int kUnroll = 4;

template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

/// Eight elements of a row as loaded (16-byte words), converted to float only where used, so
/// that kUnroll groups of both heads in flight hold 16 or 32 bytes each in registers.
template <typename T>
struct Group {
  static constexpr int kWords = kGroup / Segment<T>::kVec;
  U32x4 w[kWords];
};

/// Elements [0, 8) at p (16-byte aligned).
template <typename T>
__device__ __forceinline__ void load_group(const T* p, Group<T>& g) {
#pragma unroll
  for (int h = 0; h < Group<T>::kWords; ++h) g.w[h] = reinterpret_cast<const U32x4*>(p)[h];
}

template <typename T>
__device__ __forceinline__ void unpack_group(const Group<T>& g, float (&v)[kGroup]) {
  constexpr int kVec = Segment<T>::kVec;
#pragma unroll
  for (int h = 0; h < Group<T>::kWords; ++h) {
    Segment<T> seg;
    seg.raw = g.w[h];
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 q = seg_pair(seg, k);
      v[h * kVec + 2 * k] = q.x;
      v[h * kVec + 2 * k + 1] = q.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_group(T* p, const float (&v)[kGroup]) {
  constexpr int kVec = Segment<T>::kVec;
#pragma unroll
  for (int h = 0; h < kGroup / kVec; ++h) {
    Segment<T> seg;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) set_pair(seg, k, v[h * kVec + 2 * k], v[h * kVec + 2 * k + 1]);
    *reinterpret_cast<U32x4*>(p + h * kVec) = seg.raw;
  }
}

/// f(j0, a, b, n) over this thread's columns of a row of V: a the student's values of n
/// consecutive columns from column j0 (n = kGroup, or 1 for a tail column, whose other entries
/// are not read), b the teacher's (kTwo; else zeros). With kWrite, a's n values as f leaves them
/// are stored back over xs (each column read before it is written, by the same thread).
template <bool kTwo, bool kWrite, typename S, typename T, typename F>
__device__ __forceinline__ void row_chunks(S* xs, const T* xt, int64_t V, F&& f) {
  int64_t tail = 0;
  if (aligned16(xs) && (!kTwo || aligned16(xt))) {
    const int64_t groups = V / kGroup;
    auto visit = [&](int64_t g, const Group<S>& gs, const Group<T>& gt) {
      float a[kGroup], b[kGroup] = {};
      unpack_group(gs, a);
      if (kTwo) unpack_group(gt, b);
      f(g * kGroup, a, b, kGroup);
      if (kWrite) store_group(xs + g * kGroup, a);
    };
    int64_t g = threadIdx.x;
    for (; g + (kUnroll - 1) * kThreads < groups; g += kUnroll * kThreads) {
      Group<S> gs[kUnroll];
      Group<T> gt[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        load_group(xs + (g + u * kThreads) * kGroup, gs[u]);
        if (kTwo) load_group(xt + (g + u * kThreads) * kGroup, gt[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) visit(g + u * kThreads, gs[u], gt[u]);
    }
    for (; g < groups; g += kThreads) {
      Group<S> gs;
      Group<T> gt;
      load_group(xs + g * kGroup, gs);
      if (kTwo) load_group(xt + g * kGroup, gt);
      visit(g, gs, gt);
    }
    tail = groups * kGroup;
  }
  for (int64_t j = tail + threadIdx.x; j < V; j += kThreads) {
    float a[kGroup] = {}, b[kGroup] = {};
    a[0] = Elem<S>::to_float(xs[j]);
    if (kTwo) b[0] = Elem<T>::to_float(xt[j]);
    f(j, a, b, 1);
    if (kWrite) xs[j] = Elem<S>::from_float(a[0]);
  }
}

/// f(j, xs[j], xt[j]) (as float) over this thread's columns j of a row of V, xt read when kTwo
/// (else f gets 0 for it). With kWrite, xs[j] becomes f's value.
template <bool kTwo, bool kWrite, typename S, typename T, typename F>
__device__ __forceinline__ void row_visit(S* xs, const T* xt, int64_t V, F&& f) {
  row_chunks<kTwo, kWrite>(xs, xt, V, [&](int64_t j0, float (&a)[kGroup], const float (&b)[kGroup], int n) {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      if (e < n) a[e] = f(j0 + e, a[e], b[e]);
    }
  });
}

/// f(a, b, n) over this thread's columns of a row of V, in row_chunks' order (read only).
template <bool kTwo, typename S, typename T, typename F>
__device__ __forceinline__ void row_groups(const S* xs, const T* xt, int64_t V, F&& f) {
  row_chunks<kTwo, false>(const_cast<S*>(xs), xt, V,
                          [&](int64_t, const float (&a)[kGroup], const float (&b)[kGroup], int n) { f(a, b, n); });
}

/// Row i of a chunk (rows of stride ld) of dtype T.
template <typename T>
__device__ __forceinline__ T* chunk_row(const void* base, int64_t ld, int64_t i) {
  return const_cast<T*>(static_cast<const T*>(base)) + i * ld;
}

template <typename T>
__device__ __forceinline__ float load(const void* base, int64_t ld, int64_t i, int64_t j) {
  return Elem<T>::to_float(static_cast<const T*>(base)[i * ld + j]);
}

/// Row `row`'s label: -1 without labels (every row counts, no hard term).
__device__ int64_t label_of(const DistillRows& r, int64_t row) {
  if (r.labels == nullptr) return -1;
  return r.labels_i64 ? static_cast<const int64_t*>(r.labels)[row * r.label_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(r.labels)[row * r.label_stride]);
}

__device__ bool counted(const DistillRows& r, int64_t label) { return r.labels == nullptr || label != r.ignore_index; }

/// A counted row whose label cannot be read (outside [0, v_total)): its outputs become NaN.
__device__ bool bad_label(const DistillRows& r, int64_t label) {
  return r.labels != nullptr && (label < 0 || label >= r.v_total);
}

/// A global vocabulary index as a column of the call's rows: -1 where another shard holds it
/// (or there is no label).
__device__ __forceinline__ int64_t local_column(const DistillRows& r, int64_t global) {
  const int64_t j = global - r.v0;
  return global >= 0 && j >= 0 && j < r.V ? j : -1;
}

/// Whether any of the row's top-k ids lies outside [0, v_total) (block-wide).
__device__ bool bad_ids(const DistillRows& r, const DistillTeacherRows& t, int64_t row) {
  bool bad = false;
  const int64_t* ids = t.ids + row * t.ids_stride;
  for (int64_t k = threadIdx.x; k < t.K; k += kThreads) bad |= ids[k] < 0 || ids[k] >= r.v_total;
  return block_any(bad);
}

__device__ void put(float* base, int64_t stride, int64_t row, float v) {
  if (base != nullptr) base[row * stride] = v;
}

/// The forward's per-row outputs of one row (thread 0 writes them).
struct RowOut {
  float divergence, hard, entropy;
  float stats[kW];
};

__device__ void write_row(const DistillForwardParams& p, int64_t row, const RowOut& o) {
  if (threadIdx.x != 0) return;
  for (int q = 0; q < kW; ++q) p.stats[row * p.stats_width + q] = o.stats[q];
  put(p.divergence, p.divergence_stride, row, o.divergence);
  put(p.hard, p.hard_stride, row, o.hard);
  put(p.entropy, p.entropy_stride, row, o.entropy);
  // (1 - w) D + w hard, a term whose factor is 0 left out
  const float w = p.r.hard_weight;
  double loss = 0.0;
  if (w < 1.0f) loss += (1.0 - w) * o.divergence;
  if (w > 0.0f) loss += static_cast<double>(w) * o.hard;
  p.row_loss[row * p.row_loss_stride] = static_cast<float>(loss);
}

__device__ RowOut filled_row(float v) {
  RowOut o{v, v, v, {}};
  for (int q = 0; q < kW; ++q) o.stats[q] = v;
  return o;
}

// ---- the top-k form's sparse distributions ----------------------------------------------------

/// One row's normalisation of the sparse entries (TopkNorm): ls, lt the log-sums of the valid
/// student / teacher entries, and the tail entries.
struct SparseNorm {
  double ls, lt;
  float s_tail, t_tail;
  bool s_clamped;
};

/// log sum exp over the valid entries of x (block-wide), in double: max, then the sum.
template <class Get>
__device__ void sparse_lse2(int64_t K, const float* tlp, Get q_of, double* out_s, double* out_t, float* fsmem,
                            double* dsmem) {
  float m[2] = {-INFINITY, -INFINITY};
  for (int64_t k = threadIdx.x; k < K; k += kThreads) {
    if (tlp[k] == -INFINITY) continue;
    m[0] = fmaxf(m[0], q_of(k));
    m[1] = fmaxf(m[1], tlp[k]);
  }
  block_max<2>(m, fsmem);
  double s[2] = {0.0, 0.0};
  for (int64_t k = threadIdx.x; k < K; k += kThreads) {
    if (tlp[k] == -INFINITY) continue;
    s[0] += exp(static_cast<double>(q_of(k)) - m[0]);
    s[1] += exp(static_cast<double>(tlp[k]) - m[1]);
  }
  block_sum<2>(s, dsmem);
  *out_s = m[0] == -INFINITY ? -INFINITY : m[0] + log(s[0]);
  *out_t = m[1] == -INFINITY ? -INFINITY : m[1] + log(s[1]);
}

template <class Get>
__device__ SparseNorm sparse_norm(const DistillRows& r, int64_t K, const float* tlp, Get q_of, float* fsmem,
                                  double* dsmem) {
  SparseNorm n{0.0, 0.0, 0.0f, 0.0f, false};
  if (r.topk_norm == static_cast<int>(TopkNorm::kNone)) return n;
  sparse_lse2(K, tlp, q_of, &n.ls, &n.lt, fsmem, dsmem);
  if (r.topk_norm == static_cast<int>(TopkNorm::kTail)) {
    n.s_clamped = n.ls > kTailMaxLogSum;
    n.s_tail = static_cast<float>(log(-expm1(fmin(n.ls, kTailMaxLogSum))));
    n.t_tail = static_cast<float>(log(-expm1(fmin(n.lt, kTailMaxLogSum))));
  }
  return n;
}

/// Entry k's (s, t) after the normalisation, from the student's q and the teacher's log-prob.
__device__ __forceinline__ float2 sparse_entry(const DistillRows& r, const SparseNorm& n, float q, float t) {
  if (r.topk_norm == static_cast<int>(TopkNorm::kRenorm)) {
    return make_float2(static_cast<float>(q - n.ls), static_cast<float>(t - n.lt));
  }
  return make_float2(q, t);
}

/// The row's divergence of the sparse distributions (block-wide): the valid entries' terms
/// after the normalisation, in a fixed order, plus the tail entry's (TopkNorm::kTail).
template <class Get>
__device__ double sparse_divergence(const DistillRows& r, int64_t K, const float* tlp, Get q_of, float* fsmem,
                                    double* dsmem) {
  const SparseNorm n = sparse_norm(r, K, tlp, q_of, fsmem, dsmem);
  const DivergenceKind kind = static_cast<DivergenceKind>(r.kind);
  double d[1] = {0.0};
  for (int64_t k = threadIdx.x; k < K; k += kThreads) {
    if (tlp[k] == -INFINITY) continue;
    const float2 st = sparse_entry(r, n, q_of(k), tlp[k]);
    d[0] += detail::divergence_term(kind, st.x, st.y, r.beta, r.log_1mb, r.log_b);
  }
  block_sum<1>(d, dsmem);
  if (r.topk_norm == static_cast<int>(TopkNorm::kTail)) {
    d[0] += detail::divergence_term(kind, n.s_tail, n.t_tail, r.beta, r.log_1mb, r.log_b);
  }
  return d[0];
}

// ---- one column's terms ------------------------------------------------------------------------

/// One column's summands in the forward, from the student's and teacher's log-probabilities in
/// base-2 units s = log2 p_s and t = log2 p_t: p_s s (the entropy's, negated), the divergence
/// term f(s, t) (common/distill_math.h) and, for the JSD, p_s (s - l) (KL(p_s || m)'s), each in
/// base-2 units (the caller's sums times ln 2 are the natural ones: every term is a probability
/// times a difference of logs). p_s = 2^s and p_t = 2^t are formed once and the mixture's log
/// from them, l = log2((1 - beta) p_s + beta p_t): where that sum underflows every term is taken
/// as 0 (each is below the smallest float times |s - l|), and a term whose weight p_s or p_t is 0
/// adds exactly 0 (not 0 * inf). The mixture's log is the special-function unit's (__log2f, one
/// instruction, absolute error near 2^-22: far below the float rounding of the log-probabilities
/// it meets, |s| of order log2 V), where log2f is a polynomial of some 25 instructions.
struct EntryTerms {
  float entropy, divergence, aux;
};

__device__ __forceinline__ EntryTerms entry_terms2(DivergenceKind kind, float s, float t, const DistillRows& r) {
  const float ps = exp2f(s), pt = exp2f(t);
  EntryTerms e{ps == 0.0f ? 0.0f : ps * s, 0.0f, 0.0f};
  if (kind == DivergenceKind::kForwardKl) {
    e.divergence = pt == 0.0f ? 0.0f : pt * (t - s);
  } else if (kind == DivergenceKind::kReverseKl) {
    e.divergence = ps == 0.0f ? 0.0f : ps * (s - t);
  } else {
    // selects, not branches: a branch per column would keep the unrolled loop from overlapping
    // the columns' special-function latencies
    const float mix = r.one_mb * ps + r.beta * pt;
    const float l = __log2f(mix);
    const bool live = mix != 0.0f;  // else both weights are (all but) 0, and so are the terms
    const float fs = live && ps != 0.0f ? ps * (s - l) : 0.0f;
    e.divergence = (live && pt != 0.0f ? r.beta * pt * (t - l) : 0.0f) + r.one_mb * fs;
    e.aux = fs;
  }
  return e;
}

/// d D / d z_j (common/distill_math.h, distill_logit_grad) from the log-probabilities in base-2
/// units s = log2 p_s and t = log2 p_t, aux2 the auxiliary sum times log2 e: e^s, e^t and the
/// mixture's log are formed once each as 2^x and log2 (one special-function instruction each,
/// where expf and logf are several), as entry_terms2; a difference of base-2 logs times ln 2 is
/// the natural one. The kind is a constant and a zero weight is a select, not a branch, so the
/// unrolled column loop overlaps its columns' special-function latencies.
template <DivergenceKind kKind>
__device__ __forceinline__ float logit_grad2(float s, float t, float aux2, const DistillRows& r) {
  const float ps = exp2f(s), pt = exp2f(t);
  if constexpr (kKind == DivergenceKind::kForwardKl) {
    return ps - pt;
  } else if constexpr (kKind == DivergenceKind::kReverseKl) {
    return ps != 0.0f ? static_cast<float>(kLn2) * ps * (s - t - aux2) : 0.0f;
  } else {
    const float mix = r.one_mb * ps + r.beta * pt;
    const float v = static_cast<float>(kLn2) * r.one_mb * ps * (s - __log2f(mix) - aux2);
    return ps != 0.0f && mix != 0.0f ? v : 0.0f;
  }
}

// ---- the heads' transforms --------------------------------------------------------------------

/// A head's transform (common/distill_math.h) with whether either head has a soft-cap fixed at
/// compile time (kCap): the cap's branch inside an unrolled column loop may be if-converted,
/// paying a tanhf and a division per column even where no cap is set.
template <bool kCap>
__device__ __forceinline__ float head_y(const Transform& h, float x) {
  if constexpr (kCap) {
    return detail::transform_y(h, x);
  } else {
    return h.scale * x;
  }
}

/// dy/dx from y, as detail::transform_dy_of_y.
template <bool kCap>
__device__ __forceinline__ float head_dy(const Transform& h, float y) {
  if constexpr (kCap) {
    return detail::transform_dy_of_y(h, y);
  } else {
    return h.scale;
  }
}

// ---- the forward ------------------------------------------------------------------------------

/// Blocks an SM the full forward is compiled for: it is bound by the latency of its exponentials,
/// so three blocks (80 registers a thread, without spills where both heads are 16-bit) run it
/// faster than the two that its unbounded 106 registers leave; a float32 head would spill at 80.
template <typename S, typename T>
constexpr int forward_min_blocks() {
  return sizeof(S) == 2 && sizeof(T) == 2 ? 3 : 1;
}

/// Full form: one block per chunk row; S, T the student's and the teacher's logit dtypes; the
/// divergence (kKind, a DivergenceKind) and whether any row has a hard term (kHard: labels and a
/// hard weight) fixed at compile time, so that the unrolled column loops carry only their own
/// arithmetic and state: the kernel is bound by the latency of its exponentials, and a third
/// running state or another kind's terms, even never used, cost registers and so occupancy.
template <typename S, typename T, bool kCap, int kKind, bool kHard>
__global__ void __launch_bounds__(kThreads, forward_min_blocks<S, T>()) full_forward_kernel(const DistillForwardParams p) {
  __shared__ float fsmem[3 * kWarps];
  __shared__ double dsmem[3 * kWarps];
  const DistillRows& r = p.r;
  const int64_t i = blockIdx.x, row = r.r0 + i, V = r.V;
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) return write_row(p, row, filled_row(0.0f));
  if (bad_label(r, label)) return write_row(p, row, filled_row(NAN));
  const Transform hs{r.s_scale, r.s_softcap}, ht{r.t_scale, r.t_softcap};
  const bool hard = kHard && label >= 0;
  // pass 1: the log-sum-exps of z_student, z_teacher and (hard term) y_student
  const S* xs = chunk_row<S>(p.logits, p.ld, i);
  const T* xt = chunk_row<T>(p.t.logits, p.t.ld, i);
  Online a[3] = {online_empty(), online_empty(), online_empty()};
  row_groups<true>(xs, xt, V, [&](const float (&vs)[kGroup], const float (&vt)[kGroup], int n) {
    float zs[kGroup], zt[kGroup], ys[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      ys[k] = head_y<kCap>(hs, vs[k]);
      zs[k] = ys[k] * r.inv_t;
      zt[k] = head_y<kCap>(ht, vt[k]) * r.inv_t;
    }
    group_lse_add(a[0], zs, n);
    group_lse_add(a[1], zt, n);
    if (hard) group_lse_add(a[2], ys, n);
  });
  Lse l[3];
  block_lse<3>(a, l, fsmem, dsmem);
  // pass 2: entropy, divergence and the JSD's KL(p_s || m), against them, in base 2 (entry_terms2);
  // the float sums of a group added in double
  constexpr DivergenceKind kind = static_cast<DivergenceKind>(kKind);
  double acc[3] = {0.0, 0.0, 0.0};
  row_groups<true>(xs, xt, V, [&](const float (&vs)[kGroup], const float (&vt)[kGroup], int n) {
    float part[3] = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      if (k >= n) break;
      const float s2 = logp(l[0], head_y<kCap>(hs, vs[k]) * r.inv_t) * kLog2e;
      const float t2 = logp(l[1], head_y<kCap>(ht, vt[k]) * r.inv_t) * kLog2e;
      const EntryTerms e = entry_terms2(kind, s2, t2, r);
      part[0] += e.entropy;
      part[1] += e.divergence;
      part[2] += e.aux;
    }
#pragma unroll
    for (int q = 0; q < 3; ++q) acc[q] += static_cast<double>(part[q]);
  });
  block_sum<3>(acc, dsmem);
#pragma unroll
  for (int q = 0; q < 3; ++q) acc[q] *= kLn2;
  RowOut o{static_cast<float>(acc[1]), 0.0f, static_cast<float>(-acc[0]), {}};
  o.stats[0] = static_cast<float>(l[0].full);
  o.stats[1] = static_cast<float>(l[1].full);
  o.stats[2] = kind == DivergenceKind::kReverseKl ? o.divergence
               : kind == DivergenceKind::kJsd     ? static_cast<float>(acc[2])
                                                  : 0.0f;
  if (hard) {
    o.stats[3] = static_cast<float>(l[2].full);
    o.hard = static_cast<float>(l[2].full - head_y<kCap>(hs, load<S>(p.logits, p.ld, i, local_column(r, label))));
  }
  write_row(p, row, o);
}

/// Top-k form: one block per chunk row.
template <typename S, bool kCap>
__global__ void __launch_bounds__(kThreads) topk_forward_kernel(const DistillForwardParams p) {
  __shared__ float fsmem[2 * kWarps];
  __shared__ double dsmem[2 * kWarps];
  const DistillRows& r = p.r;
  const int64_t i = blockIdx.x, row = r.r0 + i, V = r.V, K = p.t.K;
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) return write_row(p, row, filled_row(0.0f));
  if (bad_label(r, label) || bad_ids(r, p.t, row)) return write_row(p, row, filled_row(NAN));
  const Transform hs{r.s_scale, r.s_softcap};
  const bool hard = label >= 0 && r.hard_weight > 0.0f;
  const S* xs = chunk_row<S>(p.logits, p.ld, i);
  Online a[2] = {online_empty(), online_empty()};
  row_groups<false>(xs, xs, V, [&](const float (&vs)[kGroup], const float (&)[kGroup], int n) {
    float zs[kGroup], ys[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      ys[k] = head_y<kCap>(hs, vs[k]);
      zs[k] = ys[k] * r.inv_t;
    }
    group_lse_add(a[0], zs, n);
    if (hard) group_lse_add(a[1], ys, n);
  });
  Lse l[2];
  block_lse<2>(a, l, fsmem, dsmem);
  double ent[1] = {0.0};
  row_groups<false>(xs, xs, V, [&](const float (&vs)[kGroup], const float (&)[kGroup], int n) {
    float part = 0.0f;
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      if (k >= n) break;
      const float s2 = logp(l[0], head_y<kCap>(hs, vs[k]) * r.inv_t) * kLog2e;
      const float ps = exp2f(s2);
      part += ps == 0.0f ? 0.0f : ps * s2;
    }
    ent[0] += static_cast<double>(part);
  });
  block_sum<1>(ent, dsmem);
  ent[0] *= kLn2;
  // the sparse entries: q_k, the student's log-probability at id k
  const int64_t* ids = p.t.ids + row * p.t.ids_stride;
  const float* tlp = p.t.logprobs + row * p.t.lp_stride;
  auto q_of = [&](int64_t k) {
    return logp(l[0], head_y<kCap>(hs, load<S>(p.logits, p.ld, i, local_column(r, ids[k]))) * r.inv_t);
  };
  const double d = sparse_divergence(r, K, tlp, q_of, fsmem, dsmem);
  RowOut o{static_cast<float>(d), 0.0f, static_cast<float>(-ent[0]), {0.0f, 0.0f, 0.0f, 0.0f}};
  o.stats[0] = static_cast<float>(l[0].full);
  if (hard) {
    o.stats[3] = static_cast<float>(l[1].full);
    o.hard = static_cast<float>(l[1].full - head_y<kCap>(hs, load<S>(p.logits, p.ld, i, local_column(r, label))));
  }
  write_row(p, row, o);
}

// ---- the backward -----------------------------------------------------------------------------

/// Row `row`'s upstream gradient, the mean's 1 / count included (as the CPU backend).
__device__ float upstream(const DistillBackwardParams& p, int64_t row) {
  if (p.reduction == static_cast<int>(Reduction::kNone)) return p.grad_loss[row * p.grad_stride];
  if (p.reduction == static_cast<int>(Reduction::kSum)) return p.grad_loss[0];
  return static_cast<float>(p.grad_loss[0] * (1.0 / static_cast<double>(*p.count)));
}

template <typename S>
__device__ void fill_row(const DistillBackwardParams& p, int64_t i, float v) {
  S* x = static_cast<S*>(p.logits) + i * p.ld;
  for (int64_t j = threadIdx.x; j < p.r.V; j += kThreads) x[j] = Elem<S>::from_float(v);
}

/// The hard term's part of dy at column j: b (softmax(y)_j - [j == label]).
__device__ __forceinline__ float hard_dy(float b, float y, float lse_h, int64_t j, int64_t label) {
  return b * (exp_via2(y - lse_h) - (j == label ? 1.0f : 0.0f));
}

/// Full form: one block per chunk row; the student's logits become their gradient in place. The
/// divergence kind (kKind) is a constant and each combination of the two terms has a column loop
/// of its own, so no column carries a branch on them (see logit_grad2).
template <typename S, typename T, bool kCap, int kKind>
__global__ void __launch_bounds__(kThreads) full_backward_kernel(const DistillBackwardParams p) {
  const DistillRows& r = p.r;
  const int64_t i = blockIdx.x, row = r.r0 + i, V = r.V;
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) return fill_row<S>(p, i, 0.0f);
  if (bad_label(r, label)) return fill_row<S>(p, i, NAN);
  const float g = upstream(p, row);
  const float a = r.hard_weight < 1.0f ? (1.0f - r.hard_weight) * g * r.inv_t : 0.0f;  // per unit dz
  const float b = r.hard_weight > 0.0f && label >= 0 ? r.hard_weight * g : 0.0f;
  const float* st = p.stats + row * p.stats_width;
  const int64_t column = local_column(r, label);  // the label's column here, or -1
  const Transform hs{r.s_scale, r.s_softcap}, ht{r.t_scale, r.t_softcap};
  constexpr DivergenceKind kind = static_cast<DivergenceKind>(kKind);
  S* x = static_cast<S*>(p.logits) + i * p.ld;
  const T* xt = a != 0.0f ? chunk_row<T>(p.t.logits, p.t.ld, i) : nullptr;  // (no teacher chunk at hard weight 1)
  const float lse_s = st[0], lse_t = st[1], cross2 = st[2] * kLog2e, lse_h = st[3];
  // the divergence's part of dy per unit a: each log-probability formed in natural units first,
  // then scaled, so its rounding stays relative to the difference
  auto soft = [&](float y, float xtj) {
    const float s2 = (y * r.inv_t - lse_s) * kLog2e, t2 = (head_y<kCap>(ht, xtj) * r.inv_t - lse_t) * kLog2e;
    return logit_grad2<kind>(s2, t2, cross2, r);
  };
  if (a != 0.0f && b != 0.0f) {
    row_visit<true, true>(x, xt, V, [&](int64_t j, float xj, float xtj) {
      const float y = head_y<kCap>(hs, xj);
      return (a * soft(y, xtj) + hard_dy(b, y, lse_h, j, column)) * head_dy<kCap>(hs, y);
    });
  } else if (a != 0.0f) {
    row_visit<true, true>(x, xt, V, [&](int64_t, float xj, float xtj) {
      const float y = head_y<kCap>(hs, xj);
      return a * soft(y, xtj) * head_dy<kCap>(hs, y);
    });
  } else {  // the hard term only (or an upstream gradient of 0): the teacher's chunk is not read
    row_visit<false, true>(x, x, V, [&](int64_t j, float xj, float) {
      const float y = head_y<kCap>(hs, xj);
      return (b != 0.0f ? hard_dy(b, y, lse_h, j, column) : 0.0f) * head_dy<kCap>(hs, y);
    });
  }
}

/// In-place bitonic sort of keys[0 .. n) (n a power of two) by the block.
__device__ void block_sort(uint64_t* keys, int64_t n) {
  for (int64_t size = 2; size <= n; size <<= 1) {
    for (int64_t stride = size / 2; stride > 0; stride >>= 1) {
      for (int64_t t = threadIdx.x; t < n / 2; t += kThreads) {
        const int64_t lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        const bool up = (lo & size) == 0;
        const uint64_t x = keys[lo], y = keys[hi];
        if ((x > y) == up) {
          keys[lo] = y;
          keys[hi] = x;
        }
      }
      __syncthreads();  // this stage's swaps done before the next stage reads
    }
  }
}

/// Top-k form: one block per chunk row. dD/dq_k (through the normalisation) first, into the
/// scratch; then the dense part of every column, -a e^{s_j} sum_k dD/dq_k (+ the hard term);
/// then each distinct id once: its column again, plus a dD/dq_k of each of its entries (k order).
/// Over a vocabulary shard the q_k come from the statistics (step 4 gathered them from every
/// shard) and only the ids this shard holds have columns here.
template <typename S, bool kCap>
__global__ void __launch_bounds__(kThreads) topk_backward_kernel(const DistillBackwardParams p) {
  __shared__ float fsmem[2 * kWarps];
  __shared__ double dsmem[2 * kWarps];
  const DistillRows& r = p.r;
  const int64_t i = blockIdx.x, row = r.r0 + i, V = r.V, K = p.t.K;
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) return fill_row<S>(p, i, 0.0f);
  if (bad_label(r, label) || bad_ids(r, p.t, row)) return fill_row<S>(p, i, NAN);
  const float g = upstream(p, row);
  const float a = r.hard_weight < 1.0f ? (1.0f - r.hard_weight) * g * r.inv_t : 0.0f;
  const float b = r.hard_weight > 0.0f && label >= 0 ? r.hard_weight * g : 0.0f;
  const float* st = p.stats + row * p.stats_width;
  const bool gathered_q = p.stats_width > kW;
  const int64_t column = local_column(r, label);
  const Transform hs{r.s_scale, r.s_softcap};
  S* x = static_cast<S*>(p.logits) + i * p.ld;
  const int64_t* ids = p.t.ids + row * p.t.ids_stride;
  const float* tlp = p.t.logprobs + row * p.t.lp_stride;
  float* ey = p.entry_y + i * K;
  float* eg = p.entry_g + i * K;
  float sum_gq = 0.0f;
  if (a != 0.0f) {
    for (int64_t k = threadIdx.x; k < K; k += kThreads) {
      const int64_t j = local_column(r, ids[k]);
      ey[k] = j >= 0 ? head_y<kCap>(hs, Elem<S>::to_float(x[j])) : 0.0f;
    }
    __syncthreads();  // ey complete: the norms read every entry
    auto q_of = [&](int64_t k) { return gathered_q ? st[kW + k] : ey[k] * r.inv_t - st[0]; };
    const SparseNorm n = sparse_norm(r, K, tlp, q_of, fsmem, dsmem);
    const DivergenceKind kind = static_cast<DivergenceKind>(r.kind);
    double tot[1] = {0.0};
    for (int64_t k = threadIdx.x; k < K; k += kThreads) {
      float gq = 0.0f;
      if (tlp[k] != -INFINITY) {
        const float2 e = sparse_entry(r, n, q_of(k), tlp[k]);
        gq = detail::divergence_dterm(kind, e.x, e.y, r.log_1mb, r.log_b, r.one_mb);
      }
      eg[k] = gq;
      tot[0] += gq;
    }
    block_sum<1>(tot, dsmem);
    const bool tail = r.topk_norm == static_cast<int>(TopkNorm::kTail) && !n.s_clamped;
    const float g_tail = tail ? detail::divergence_dterm(kind, n.s_tail, n.t_tail, r.log_1mb, r.log_b, r.one_mb) : 0.0f;
    double adjusted[1] = {0.0};
    for (int64_t k = threadIdx.x; k < K; k += kThreads) {
      if (tlp[k] == -INFINITY) continue;
      const float s = sparse_entry(r, n, q_of(k), tlp[k]).x;
      float gq = eg[k];
      if (r.topk_norm == static_cast<int>(TopkNorm::kRenorm)) {  // s_k = q_k - lse(q)
        gq -= static_cast<float>(expf(s) * tot[0]);
      } else if (tail) {  // d s_tail / d q_k = -e^{q_k - s_tail}
        gq -= g_tail * expf(s - n.s_tail);
      }
      eg[k] = gq;
      adjusted[0] += gq;
    }
    block_sum<1>(adjusted, dsmem);  // (its barriers also order eg's writes before the reads below)
    sum_gq = static_cast<float>(adjusted[0]);
    for (int64_t k = threadIdx.x; k < p.Kp; k += kThreads) {  // ids held elsewhere sort last, as padding
      const int64_t j = k < K ? local_column(r, ids[k]) : -1;
      p.keys[i * p.Kp + k] = j >= 0 ? (static_cast<uint64_t>(j) << 32) | static_cast<uint64_t>(k) : ~uint64_t(0);
    }
    __syncthreads();  // keys written before the sort
    block_sort(p.keys + i * p.Kp, p.Kp);
  }
  auto dense = [&](float y, int64_t j) {
    float dy = a != 0.0f ? -a * exp_via2(y * r.inv_t - st[0]) * sum_gq : 0.0f;
    if (b != 0.0f) dy += hard_dy(b, y, st[3], j, column);
    return dy * head_dy<kCap>(hs, y);
  };
  row_visit<false, true>(x, x, V, [&](int64_t j, float xj, float) { return dense(head_y<kCap>(hs, xj), j); });
  if (a == 0.0f) return;
  __syncthreads();  // the dense pass wrote every column before the ids' columns are rewritten
  const uint64_t* keys = p.keys + i * p.Kp;
  for (int64_t q = threadIdx.x; q < K; q += kThreads) {
    if (keys[q] == ~uint64_t(0)) continue;  // an id another shard holds
    const int64_t id = static_cast<int64_t>(keys[q] >> 32);
    if (q > 0 && static_cast<int64_t>(keys[q - 1] >> 32) == id) continue;  // not its id's first entry
    const int64_t k0 = static_cast<int64_t>(keys[q] & 0xffffffffu);
    const float y = ey[k0], dk = head_dy<kCap>(hs, y);
    float v = dense(y, id);
    for (int64_t e = q; e < K && keys[e] != ~uint64_t(0) && static_cast<int64_t>(keys[e] >> 32) == id; ++e) {
      v += a * eg[keys[e] & 0xffffffffu] * dk;
    }
    x[id] = Elem<S>::from_float(v);
  }
}

// ---- the reduction ----------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) finish_kernel(const DistillFinishParams p) {
  __shared__ double dsmem[2 * kWarps];
  double acc[2] = {0.0, 0.0};  // loss sum, counted rows
  for (int64_t i = threadIdx.x; i < p.N; i += kThreads) {
    if (!counted(p.r, label_of(p.r, i))) continue;
    acc[1] += 1.0;
    if (p.row_loss != nullptr) acc[0] += p.row_loss[i];
  }
  block_sum<2>(acc, dsmem);
  if (threadIdx.x != 0) return;
  const int64_t count = static_cast<int64_t>(acc[1]);
  if (p.count != nullptr) *p.count = count;
  if (p.row_loss == nullptr || p.loss == nullptr) return;
  double loss = acc[0];
  if (p.reduction == static_cast<int>(Reduction::kMean)) loss = count == 0 ? NAN : loss / static_cast<double>(count);
  p.loss[0] = static_cast<float>(loss);
}

// ---- the vocabulary-parallel steps --------------------------------------------------------------
//
// As the CPU backend's (src/cpu/distill_cpu.cpp): step 1 each row's (max, sum of exps) per head
// over the shard, step 2 the ranks' states folded in rank order (LseAccum), step 3 the sums over
// the shard against the global log-sum-exps, each handed on as a float32 pair (hi, lo), step 4
// the ranks' pairs added in double in rank order. Steps 2 and 4 read the same gathered bits in
// the same order on every rank, so every rank has the same results. A row whose label (or a
// top-k id) lies outside [0, v_total), or whose label no rank or several ranks hold, gets NaN
// instead of an error (no host synchronisation).

constexpr int kSW = kDistillShardStatsWidth;
constexpr int kStateColumns = 8;  // step 1's columns; the rest of a row is spare
constexpr int kPW = kDistillPartsWidth;

/// The block's (max, sum of exp(z - max)) of K running states, as the CPU's row_state: no finite
/// entry gives (-inf, 0), an infinite max (inf, 1).
template <int K>
__device__ void block_state(const Online (&a)[K], float (&m)[K], float (&s)[K], float* fsmem, double* dsmem) {
#pragma unroll
  for (int q = 0; q < K; ++q) m[q] = a[q].m;
  block_max<K>(m, fsmem);
  double t[K];
#pragma unroll
  for (int q = 0; q < K; ++q) t[q] = isinf(m[q]) ? 0.0 : online_scaled(a[q], m[q]);
  block_sum<K>(t, dsmem);
#pragma unroll
  for (int q = 0; q < K; ++q) s[q] = m[q] == -INFINITY ? 0.0f : isinf(m[q]) ? 1.0f : static_cast<float>(t[q]);
}

/// A double as a float32 pair whose sum in double is the double to about 2^-48 relative.
__device__ void split_double(double x, float* hi, float* lo) {
  *hi = static_cast<float>(x);
  *lo = isfinite(x) ? static_cast<float>(x - static_cast<double>(*hi)) : 0.0f;
}

/// Step 1, one block per chunk row: columns 0, 1 the student's state of z, 2, 3 the teacher's
/// (kTwo; else the empty state), 4, 5 the student's at temperature 1, 6 its y at the label and 7
/// the flag 1 where this shard holds the label (4..7 with a hard term only).
template <typename S, typename T, bool kTwo, bool kCap>
__global__ void __launch_bounds__(kThreads) shard_stats_kernel(const DistillShardStatsParams p) {
  __shared__ float fsmem[3 * kWarps];
  __shared__ double dsmem[3 * kWarps];
  const DistillRows& r = p.r;
  const int64_t i = blockIdx.x, row = r.r0 + i, V = r.V;
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) return;  // zeroed by the caller
  float* o = p.out + row * kSW;
  if (bad_label(r, label) || (!kTwo && bad_ids(r, p.t, row))) {
    if (threadIdx.x < kStateColumns) o[threadIdx.x] = NAN;  // column 8 stays the front end's
    return;
  }
  const Transform hs{r.s_scale, r.s_softcap}, ht{r.t_scale, r.t_softcap};
  const bool hard = label >= 0 && r.hard_weight > 0.0f;
  const S* xs = chunk_row<S>(p.logits, p.ld, i);
  const T* xt = kTwo ? chunk_row<T>(p.t.logits, p.t.ld, i) : nullptr;
  Online a[3] = {online_empty(), online_empty(), online_empty()};
  row_groups<kTwo>(xs, xt, V, [&](const float (&vs)[kGroup], const float (&vt)[kGroup], int n) {
    float zs[kGroup], zt[kGroup], ys[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      ys[k] = head_y<kCap>(hs, vs[k]);
      zs[k] = ys[k] * r.inv_t;
      zt[k] = kTwo ? head_y<kCap>(ht, vt[k]) * r.inv_t : 0.0f;
    }
    group_lse_add(a[0], zs, n);
    if (kTwo) group_lse_add(a[1], zt, n);
    if (hard) group_lse_add(a[2], ys, n);
  });
  float m[3], sum[3];
  block_state<3>(a, m, sum, fsmem, dsmem);
  if (threadIdx.x != 0) return;
  o[0] = m[0];
  o[1] = sum[0];
  o[2] = kTwo ? m[1] : -INFINITY;
  o[3] = kTwo ? sum[1] : 0.0f;
  if (!hard) return;
  o[4] = m[2];
  o[5] = sum[2];
  const int64_t j = local_column(r, label);
  if (j >= 0) {
    o[6] = head_y<kCap>(hs, load<S>(p.logits, p.ld, i, j));
    o[7] = 1.0f;
  }
}

/// Step 3, one block per chunk row: (D, KL(p_s || m), entropy) over the shard, each as a pair
/// (kTwo); the top-k form: the entropy's pair, then q_k at the ids this shard holds.
template <typename S, typename T, bool kTwo, bool kCap>
__global__ void __launch_bounds__(kThreads) shard_parts_kernel(const DistillShardPartsParams p) {
  __shared__ double dsmem[3 * kWarps];
  const DistillRows& r = p.r;
  const int64_t i = blockIdx.x, row = r.r0 + i, V = r.V;
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) return;  // zeroed by the caller
  float* o = p.parts + row * p.width;
  if (bad_label(r, label) || (!kTwo && bad_ids(r, p.t, row))) {
    for (int64_t k = threadIdx.x; k < p.width; k += kThreads) o[k] = NAN;
    return;
  }
  const Transform hs{r.s_scale, r.s_softcap}, ht{r.t_scale, r.t_softcap};
  const float lse_s = p.row_stats[row * kW], lse_t = p.row_stats[row * kW + 1];
  const DivergenceKind kind = static_cast<DivergenceKind>(r.kind);
  S* xs = chunk_row<S>(p.logits, p.ld, i);
  const T* xt = kTwo ? chunk_row<T>(p.t.logits, p.t.ld, i) : nullptr;
  double acc[3] = {0.0, 0.0, 0.0};  // D, KL(p_s || m), sum p_s s
  row_visit<kTwo, false>(xs, xt, V, [&](int64_t, float xsj, float xtj) {
    const float s = head_y<kCap>(hs, xsj) * r.inv_t - lse_s;
    const float ps = expf(s);
    if (ps != 0.0f) acc[2] += static_cast<double>(ps) * s;
    if (kTwo) {
      const float t = head_y<kCap>(ht, xtj) * r.inv_t - lse_t;
      acc[0] += detail::divergence_term(kind, s, t, r.beta, r.log_1mb, r.log_b);
      if (kind == DivergenceKind::kJsd && ps != 0.0f) {
        acc[1] += static_cast<double>(ps) * (s - detail::mixture_log(s, t, r.log_1mb, r.log_b));
      }
    }
    return xsj;
  });
  block_sum<3>(acc, dsmem);
  if (!kTwo) {
    const int64_t* ids = p.t.ids + row * p.t.ids_stride;
    for (int64_t k = threadIdx.x; k < p.t.K; k += kThreads) {
      const int64_t j = local_column(r, ids[k]);
      if (j >= 0) o[kPW + k] = head_y<kCap>(hs, load<S>(p.logits, p.ld, i, j)) * r.inv_t - lse_s;
    }
  }
  if (threadIdx.x != 0) return;
  if (kTwo) {
    split_double(acc[0], o + 0, o + 1);
    split_double(acc[1], o + 2, o + 3);
  }
  split_double(-acc[2], o + 4, o + 5);
}

/// Step 2, one thread per row.
__global__ void __launch_bounds__(kThreads) shard_merge_kernel(const DistillShardMergeParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= p.N) return;
  float* o = p.row_stats + i * kW;
  float* hard_out = p.hard + i * p.hard_stride;
  for (int q = 0; q < kW; ++q) o[q] = 0.0f;
  *hard_out = 0.0f;
  const int64_t label = label_of(p.r, i);
  if (!counted(p.r, label)) return;
  const bool hard = p.r.labels != nullptr && p.r.hard_weight > 0.0f;
  detail::LseAccum s = detail::lse_accum_empty(), t = detail::lse_accum_empty(), h = detail::lse_accum_empty();
  double y = 0.0;
  int holders = 0;
  for (int64_t rank = 0; rank < p.world; ++rank) {  // rank order: the same bits on every rank
    const float* g = p.gathered + (rank * (p.N + 1) + i) * kSW;
    detail::lse_accum_add(s, detail::LseState{g[0], g[1], 0.0f});
    detail::lse_accum_add(t, detail::LseState{g[2], g[3], 0.0f});
    if (!hard) continue;
    detail::lse_accum_add(h, detail::LseState{g[4], g[5], 0.0f});
    if (g[7] != 0.0f) {
      y = g[6];
      ++holders;
    }
  }
  if (hard && holders != 1) {  // the shards do not tile the vocabulary at this label
    for (int q = 0; q < kW; ++q) o[q] = NAN;
    *hard_out = NAN;
    return;
  }
  o[0] = detail::lse_accum_value(s);
  o[1] = t.s == 0.0 ? 0.0f : detail::lse_accum_value(t);  // a top-k teacher's states are all empty
  if (!hard) return;
  const double lse_h = static_cast<double>(h.m) + log(h.s);
  o[3] = static_cast<float>(lse_h);
  *hard_out = static_cast<float>(lse_h - y);
}

/// Step 4, one block per row.
template <bool kTopk>
__global__ void __launch_bounds__(kThreads) shard_reduce_kernel(const DistillShardReduceParams p) {
  __shared__ float fsmem[2 * kWarps];
  __shared__ double dsmem[2 * kWarps];
  const DistillRows& r = p.f.r;
  const int64_t row = blockIdx.x, K = p.K, N = p.N;
  float* q_out = p.f.stats + row * p.f.stats_width + kW;  // the top-k form's q
  const int64_t label = label_of(r, row);
  if (!counted(r, label)) {
    for (int64_t k = threadIdx.x; k < K; k += kThreads) q_out[k] = 0.0f;
    return write_row(p.f, row, filled_row(0.0f));
  }
  const float* rs = p.row_stats + row * kW;
  RowOut o{0.0f, p.hard[row * p.hard_stride], 0.0f, {rs[0], rs[1], rs[2], rs[3]}};
  double sums[3] = {0.0, 0.0, 0.0};
  for (int64_t rank = 0; rank < p.world; ++rank) {  // rank order: the same bits on every rank
    const float* g = p.gathered + (rank * N + row) * p.width;
    for (int q = 0; q < 3; ++q) sums[q] += static_cast<double>(g[2 * q]) + static_cast<double>(g[2 * q + 1]);
  }
  o.entropy = static_cast<float>(sums[2]);
  const DivergenceKind kind = static_cast<DivergenceKind>(r.kind);
  if (kTopk) {
    auto q_of = [&](int64_t k) {  // one rank's entry and zeros: exact in any order, summed in rank order
      float q = 0.0f;
      for (int64_t rank = 0; rank < p.world; ++rank) q += p.gathered[(rank * N + row) * p.width + kPW + k];
      return q;
    };
    for (int64_t k = threadIdx.x; k < K; k += kThreads) q_out[k] = q_of(k);
    o.divergence = static_cast<float>(sparse_divergence(r, K, p.teacher_logprobs + row * p.lp_stride, q_of, fsmem, dsmem));
  } else {
    o.divergence = static_cast<float>(sums[0]);
    o.stats[2] = kind == DivergenceKind::kReverseKl ? o.divergence
                 : kind == DivergenceKind::kJsd     ? static_cast<float>(sums[1])
                                                    : 0.0f;
  }
  write_row(p.f, row, o);
}

// ---- dispatch ---------------------------------------------------------------------------------

template <typename F>
void by_dtype(DType d, F&& f) {
  if (d == DType::kFloat32) f(float{});
  else if (d == DType::kBFloat16) f(BFloat16{});
  else f(Half{});
}

/// launch(S, T, two, cap) with the student's logit type, the teacher's, whether a teacher head
/// is read (a top-k teacher: T = S, two false) and whether either head has a soft-cap.
template <typename F>
void by_heads(DType student, const DistillTeacherRows& t, const DistillRows& r, F&& launch) {
  const bool capped = r.s_softcap > 0.0f || (t.K == 0 && r.t_softcap > 0.0f);
  auto with_cap = [&](auto s_tag, auto t_tag, auto two) {
    if (capped) {
      launch(s_tag, t_tag, two, std::true_type{});
    } else {
      launch(s_tag, t_tag, two, std::false_type{});
    }
  };
  by_dtype(student, [&](auto s_tag) {
    if (t.K > 0) {
      with_cap(s_tag, s_tag, std::false_type{});
      return;
    }
    by_dtype(t.dtype, [&](auto t_tag) { with_cap(s_tag, t_tag, std::true_type{}); });
  });
}

}  // namespace

/// f(kind, hard) with the divergence kind and whether the call has a hard term as constants.
template <typename F>
void by_terms(const DistillRows& r, F&& f) {
  auto with_kind = [&](auto hard) {
    switch (static_cast<DivergenceKind>(r.kind)) {
      case DivergenceKind::kForwardKl:
        return f(std::integral_constant<int, static_cast<int>(DivergenceKind::kForwardKl)>{}, hard);
      case DivergenceKind::kReverseKl:
        return f(std::integral_constant<int, static_cast<int>(DivergenceKind::kReverseKl)>{}, hard);
      default:
        return f(std::integral_constant<int, static_cast<int>(DivergenceKind::kJsd)>{}, hard);
    }
  };
  if (r.labels != nullptr && r.hard_weight > 0.0f) {
    with_kind(std::true_type{});
  } else {
    with_kind(std::false_type{});
  }
}

void launch_distill_forward(const DistillForwardParams& p, cudaStream_t stream) {
  if (p.r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(p.r.rows);
  by_heads(p.dtype, p.t, p.r, [&](auto s_tag, auto t_tag, auto two, auto cap) {
    if constexpr (decltype(two)::value) {
      by_terms(p.r, [&](auto kind, auto hard) {
        full_forward_kernel<decltype(s_tag), decltype(t_tag), decltype(cap)::value, decltype(kind)::value,
                            decltype(hard)::value><<<blocks, kThreads, 0, stream>>>(p);
      });
    } else {
      topk_forward_kernel<decltype(s_tag), decltype(cap)::value><<<blocks, kThreads, 0, stream>>>(p);
    }
  });
}

void launch_distill_backward(const DistillBackwardParams& p, cudaStream_t stream) {
  if (p.r.rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(p.r.rows);
  by_heads(p.dtype, p.t, p.r, [&](auto s_tag, auto t_tag, auto two, auto cap) {
    if constexpr (decltype(two)::value) {
      by_terms(p.r, [&](auto kind, auto) {
        full_backward_kernel<decltype(s_tag), decltype(t_tag), decltype(cap)::value, decltype(kind)::value>
            <<<blocks, kThreads, 0, stream>>>(p);
      });
    } else {
      topk_backward_kernel<decltype(s_tag), decltype(cap)::value><<<blocks, kThreads, 0, stream>>>(p);
    }
  });
}

void launch_distill_finish(const DistillFinishParams& p, cudaStream_t stream) {
  finish_kernel<<<1, kThreads, 0, stream>>>(p);
}

void launch_distill_shard_stats(const DistillShardStatsParams& p, cudaStream_t stream) {
  if (p.r.rows == 0) return;
  by_heads(p.dtype, p.t, p.r, [&](auto s_tag, auto t_tag, auto two, auto cap) {
    shard_stats_kernel<decltype(s_tag), decltype(t_tag), decltype(two)::value, decltype(cap)::value>
        <<<static_cast<unsigned>(p.r.rows), kThreads, 0, stream>>>(p);
  });
}

void launch_distill_shard_parts(const DistillShardPartsParams& p, cudaStream_t stream) {
  if (p.r.rows == 0) return;
  by_heads(p.dtype, p.t, p.r, [&](auto s_tag, auto t_tag, auto two, auto cap) {
    shard_parts_kernel<decltype(s_tag), decltype(t_tag), decltype(two)::value, decltype(cap)::value>
        <<<static_cast<unsigned>(p.r.rows), kThreads, 0, stream>>>(p);
  });
}

void launch_distill_shard_merge(const DistillShardMergeParams& p, cudaStream_t stream) {
  if (p.N == 0) return;
  shard_merge_kernel<<<static_cast<unsigned>((p.N + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
}

void launch_distill_shard_reduce(const DistillShardReduceParams& p, cudaStream_t stream) {
  if (p.N == 0) return;
  const unsigned blocks = static_cast<unsigned>(p.N);
  if (p.K > 0) {
    shard_reduce_kernel<true><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    shard_reduce_kernel<false><<<blocks, kThreads, 0, stream>>>(p);
  }
}

}  // namespace cuda
}  // namespace fusedce
