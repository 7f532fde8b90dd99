// The kernels of window_kernels.h. Bandwidth-trivial next to the products: the merge reads a
// row's partials and two rows of H, the rebase touches only flagged rows, the row scales read
// and write (n, H) once. Every sum has a fixed order.
#include "cuda/port.h"  // first: the platform's runtime header

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/linear/window_forward.h"
#include "cuda/linear/window_kernels.h"
#include "cuda/linear/window_math.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {
namespace {

using window_math::ahead;
constexpr int kMergeWarps = 8;
constexpr int kMetricsThreads = 1024;

__global__ void __launch_bounds__(kMergeWarps * 32) window_merge_kernel(const WindowMergeParams p) {
  const int64_t i = int64_t(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= p.n) return;
  const float* sr = p.sum + i * p.tiles;
  const float* mr = p.offset + i * p.tiles;
  const bool metrics = p.centred != nullptr;
  float K = -INFINITY, Mx = -INFINITY;
  float top = -INFINITY;  // metrics: the row's argmax, over the tiles' (torch.argmax's order)
  int top_col = INT_MAX;
  for (int64_t t = lane; t < p.tiles; t += 32) {
    K = fmaxf(K, window_offset(mr[t]));
    Mx = fmaxf(Mx, mr[t]);
    if (metrics && ahead(p.top[i * p.tiles + t], p.top_col[i * p.tiles + t], top, top_col)) {
      top = p.top[i * p.tiles + t], top_col = p.top_col[i * p.tiles + t];
    }
  }
  for (int o = 16; o > 0; o /= 2) {
    K = fmaxf(K, __shfl_xor_sync(0xffffffffu, K, o));
    Mx = fmaxf(Mx, __shfl_xor_sync(0xffffffffu, Mx, o));
    const float v = __shfl_xor_sync(0xffffffffu, top, o);
    const int j = __shfl_xor_sync(0xffffffffu, top_col, o);
    if (ahead(v, j, top, top_col)) top = v, top_col = j;
  }
  float S = 0.0f, U = 0.0f, C = 0.0f;  // U, C: the entropy's sums (metrics)
  bool apart = false;  // some tile took an offset other than K
  for (int64_t t = lane; t < p.tiles; t += 32) {
    const float k = window_offset(mr[t]);
    const float f = window_math::factor(mr[t], K);
    apart = apart || k != K;
    S = fmaf(sr[t], f, S);
    if (metrics) {
      U = fmaf(p.centred[i * p.tiles + t], f, U);
      C = fmaf(sr[t] * f, Mx - mr[t], C);
    }
  }
  for (int o = 16; o > 0; o /= 2) {
    S += __shfl_xor_sync(0xffffffffu, S, o);
    U += __shfl_xor_sync(0xffffffffu, U, o);
    C += __shfl_xor_sync(0xffffffffu, C, o);
  }
  apart = __any_sync(0xffffffffu, apart);

  const int64_t t = p.target[i];
  const bool ignored = t == p.ignore_index;
  const bool valid = !ignored && t >= 0 && t < p.V;
  const BFloat16* h = static_cast<const BFloat16*>(p.hidden) + i * p.ld_hidden;
  float dot = 0.0f;
  if (valid) {
    const BFloat16* w = static_cast<const BFloat16*>(p.weight) + t * p.ld_weight;
    for (int64_t j = lane; j < p.H; j += 32) dot = fmaf(Elem<BFloat16>::to_float(h[j]), Elem<BFloat16>::to_float(w[j]), dot);
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  }
  float sdot = 0.0f;  // label smoothing: h . sum_j v_j w_j
  if (p.smooth != nullptr && !ignored) {
    for (int64_t j = lane; j < p.H; j += 32) sdot = fmaf(Elem<BFloat16>::to_float(h[j]), p.smooth[j], sdot);
    for (int o = 16; o > 0; o /= 2) sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
  }
  if (lane != 0) return;
  const float lse = window_math::lse(K, S);
  detail::LossConstants lc = p.lc;
  if (p.weight_sum != nullptr) lc.weight_sum = *p.weight_sum;
  const float scale = lc.logit_scale;
  if (valid && p.bias != nullptr) dot += Elem<BFloat16>::to_float(static_cast<const BFloat16*>(p.bias)[t]);
  const float zt = detail::transform_logit(dot, lc, lc.softcap != 0.0f);
  // A target outside [0, V) has no logit and no weight: NaN, as the logits path gives it.
  const float wt = ignored ? 0.0f : !valid ? NAN : p.class_weight ? p.class_weight[t * p.weight_stride] : 1.0f;
  const float ssum = p.smooth != nullptr ? window_math::smooth_sum(scale, sdot, p.smooth[p.H]) : 0.0f;
  p.loss[i] = ignored ? 0.0f : detail::row_loss(lc, lse, zt, wt, ssum, p.class_weight != nullptr);
  p.lse[i] = ignored ? 0.0f : lse;
  if (metrics) {
    p.entropy[i] = ignored ? 0.0f : window_math::entropy(S, K, Mx, C, U);
    p.correct[i] = !ignored && top_col == t;
  }
  if (!p.grad) return;
  p.kmax[i] = K;
  const detail::RowGrad rg = detail::row_grad(lc, lse, wt, p.grad[i] * (p.alpha ? *p.alpha : 1.0f));
  const window_math::RowFactor f =
      ignored ? window_math::RowFactor{0.0f, 1.0f, 0.0f} : window_math::row_factor(rg.g_a * scale, rg.g_bt * scale, S);
  p.r[i] = f.r;
  if (p.q != nullptr) p.q[i] = ignored ? 0.0f : -rg.g_c * scale;
  if (p.r16 != nullptr) static_cast<BFloat16*>(p.r16)[i] = Elem<BFloat16>::from_float(f.r);
  p.rescale[i] = f.rescale;
  // The target's entry in the frame of K: c 2^(z_t log2 e - K) - d (times the soft-cap's factor),
  // from the exact logit.
  const float entry = valid ? window_math::target_entry(zt, K, f, lc.softcap) : NAN;
  p.target_entry[i] = entry;
  const bool flag = !ignored && (apart || f.rescale != 1.0f);
  p.rebase[i] = flag;
  if (valid && !flag) {
    static_cast<BFloat16*>(p.e)[i * p.ld_e + t] = Elem<BFloat16>::from_float(entry);
  }
}

__global__ void __launch_bounds__(256) window_rebase_kernel(const WindowRebaseParams p) {
  const int64_t i = blockIdx.x;
  if (!p.rebase[i]) return;
  const float K = p.kmax[i], c = p.rescale[i];
  const float* mr = p.offset + i * p.tiles;
  BFloat16* e = static_cast<BFloat16*>(p.e) + i * p.ld_e;
  for (int64_t v = threadIdx.x; v < p.V; v += blockDim.x) {
    const float f = exp2f(window_offset(mr[v / kWindowTile]) - K) * c;
    e[v] = Elem<BFloat16>::from_float(Elem<BFloat16>::to_float(e[v]) * f);
  }
  __syncthreads();  // the entry is written over the scaled one
  const int64_t t = p.target[i];
  if (threadIdx.x == 0 && t >= 0 && t < p.V) e[t] = Elem<BFloat16>::from_float(p.target_entry[i]);
}

/// One thread a group of 4 entries of a row (H % 4 == 0, so a group never spans two rows).
__global__ void row_scale_kernel(const RowScaleParams p) {
  const int64_t groups = p.H / 4, total = p.n * groups;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < total; c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = c / groups, j = (c % groups) * 4;
    const float r = p.r[i];
    const float q = p.q != nullptr ? p.q[i] : 0.0f;
    float x[4];
    if (p.src_f32) {
      const float* s = static_cast<const float*>(p.src) + i * p.ld_src + j;
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = s[k];
    } else {
      const BFloat16* s = static_cast<const BFloat16*>(p.src) + i * p.ld_src + j;
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = Elem<BFloat16>::to_float(s[k]);
    }
    BFloat16* o = static_cast<BFloat16*>(p.out) + i * p.ld_out + j;
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = Elem<BFloat16>::from_float(p.q != nullptr ? fmaf(q, p.vec[j + k], x[k] * r) : x[k] * r);
  }
}

/// Stage 1 of the column sums: block (x, s) sums its 256 columns over slice s of the rows, in row
/// order; column `cols` is the last vector's (or the weights').
__global__ void __launch_bounds__(256) column_sums_partial_kernel(const ColumnSumParams p) {
  const int64_t c = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (c > p.cols) return;
  const int64_t s = blockIdx.y;
  const int64_t r0 = p.rows * s / p.slices, r1 = p.rows * (s + 1) / p.slices;
  const BFloat16* x = static_cast<const BFloat16*>(p.x);
  const BFloat16* last = static_cast<const BFloat16*>(p.last);
  float acc = 0.0f;
  for (int64_t i = r0; i < r1; ++i) {
    const float w = p.w != nullptr ? p.w[i * p.w_stride] : 1.0f;
    const float v = c < p.cols ? Elem<BFloat16>::to_float(x[i * p.ld + c])
                    : last != nullptr ? Elem<BFloat16>::to_float(last[i])
                    : p.last_ones ? 1.0f : 0.0f;
    acc = fmaf(w, v, acc);
  }
  p.partial[s * (p.cols + 1) + c] = acc;
}

/// Stage 2: the slices' partials summed in slice order, and the optional bf16 parts written.
__global__ void __launch_bounds__(256) column_sums_final_kernel(const ColumnSumParams p) {
  const int64_t c = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (c > p.cols) return;
  float acc = 0.0f;
  for (int s = 0; s < p.slices; ++s) acc += p.partial[int64_t(s) * (p.cols + 1) + c];
  p.out[c] = acc;
  const window_math::Split parts = window_math::split_bf16(acc);
  if (c < p.cols && p.split != nullptr) {
    BFloat16* o = static_cast<BFloat16*>(p.split);
    for (int k = 0; k < kSmoothRows; ++k) o[k * p.ld_split + c] = Elem<BFloat16>::from_float(window_math::smooth_part(parts, k, false));
  }
  if (c == p.cols && p.split_last != nullptr) {
    BFloat16* o = static_cast<BFloat16*>(p.split_last);
    for (int k = 0; k < kSmoothRows; ++k) o[k] = Elem<BFloat16>::from_float(window_math::smooth_part(parts, k, false));
  }
}

__global__ void smooth_rows_kernel(const SmoothRowsParams p) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < p.V; j += int64_t(gridDim.x) * blockDim.x) {
    const float v = p.class_weight != nullptr ? p.class_weight[j * p.weight_stride] : 1.0f;
    const window_math::Split parts = window_math::split_bf16(v);
    BFloat16* e = static_cast<BFloat16*>(p.e);
    for (int k = 0; k < kSmoothRows; ++k) e[k * p.ld_e + j] = Elem<BFloat16>::from_float(window_math::smooth_part(parts, k, true));
  }
}

__global__ void __launch_bounds__(kMetricsThreads) window_metrics_kernel(const WindowMetricsParams p) {
  __shared__ double ent[kMetricsThreads];
  __shared__ long long cor[kMetricsThreads];
  double e = 0.0;
  long long c = 0;
  for (int64_t i = threadIdx.x; i < p.n; i += kMetricsThreads) e += p.entropy[i], c += p.correct[i];
  ent[threadIdx.x] = e;
  cor[threadIdx.x] = c;
  __syncthreads();
  for (int w = kMetricsThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) ent[threadIdx.x] += ent[threadIdx.x + w], cor[threadIdx.x] += cor[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *p.entropy_sum = static_cast<float>(ent[0]), *p.num_correct = cor[0];
}

unsigned grid_of(int64_t work, int threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 4096)));
}

}  // namespace

void launch_window_merge(const WindowMergeParams& p, cudaStream_t stream) {
  if (p.n <= 0) return;
  window_merge_kernel<<<static_cast<unsigned>((p.n + kMergeWarps - 1) / kMergeWarps), kMergeWarps * 32, 0, stream>>>(p);
}

void launch_window_rebase(const WindowRebaseParams& p, cudaStream_t stream) {
  if (p.n <= 0) return;
  window_rebase_kernel<<<static_cast<unsigned>(p.n), 256, 0, stream>>>(p);
}

void launch_window_metrics(const WindowMetricsParams& p, cudaStream_t stream) {
  window_metrics_kernel<<<1, kMetricsThreads, 0, stream>>>(p);
}

void launch_column_sums(const ColumnSumParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(p.cols / 256 + 1);  // columns 0..cols
  column_sums_partial_kernel<<<dim3(blocks, static_cast<unsigned>(p.slices)), 256, 0, stream>>>(p);
  column_sums_final_kernel<<<blocks, 256, 0, stream>>>(p);
}

void launch_smooth_rows(const SmoothRowsParams& p, cudaStream_t stream) {
  if (p.V <= 0) return;
  smooth_rows_kernel<<<grid_of(p.V, 256), 256, 0, stream>>>(p);
}

void launch_row_scale(const RowScaleParams& p, cudaStream_t stream) {
  if (p.n <= 0 || p.H <= 0) return;
  row_scale_kernel<<<grid_of(p.n * (p.H / 4), 256), 256, 0, stream>>>(p);
}

}  // namespace cuda
}  // namespace fusedce
