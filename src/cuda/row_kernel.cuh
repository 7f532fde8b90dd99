// The fused cross-entropy row pass (forward statistics, and the gradient in the same sweep).
//
// What it fuses: per row, one read of the logits into registers; the row's max, sum of exps,
// target logit, smoothing sum, argmax and entropy terms from those registers; the merge of the
// blocks' partial states across a thread-block cluster through distributed shared memory (sm_90),
// so every block of the row learns the row's lse; then dlogits written straight from the same
// registers. Nothing of size N x V is stored besides dlogits, and no logit is read twice when the
// row fits the cluster's registers (pieces == 1; else each piece is re-read for the gradient).
//
// Bytes: forward N*V*sizeof(T) read; with the gradient 2*N*V*sizeof(T). The limit is device memory
// bandwidth; the exps (one MUFU.EX2 per element per sweep) stay under the SFU rate at that bandwidth.
#pragma once

#include <cooperative_groups.h>

#include <cfloat>
#include <cstdint>

#include "common/numeric.h"
#include "cuda/kernels.h"
#include "cuda/params.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

constexpr int kMaxThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;

/// A block's (or cluster's) partial statistics of one row.
struct RowPartial {
  detail::LseState st;
  float smooth;    // sum z (or sum w z)
  float amax_v;    // argmax value and index (metrics)
  int64_t amax_i;
  float z_target;  // the target's z, from the one thread that holds it
  int has_target;
};

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

__device__ __forceinline__ RowPartial shfl_down_partial(const RowPartial& p, int delta) {
  RowPartial r;
  r.st.m = __shfl_down_sync(0xffffffffu, p.st.m, delta);
  r.st.s = __shfl_down_sync(0xffffffffu, p.st.s, delta);
  r.st.ez = __shfl_down_sync(0xffffffffu, p.st.ez, delta);
  r.smooth = __shfl_down_sync(0xffffffffu, p.smooth, delta);
  r.amax_v = __shfl_down_sync(0xffffffffu, p.amax_v, delta);
  r.amax_i = __shfl_down_sync(0xffffffffu, p.amax_i, delta);
  r.z_target = __shfl_down_sync(0xffffffffu, p.z_target, delta);
  r.has_target = __shfl_down_sync(0xffffffffu, p.has_target, delta);
  return r;
}

/// exp(x) for x <= 0 (or -inf / NaN) through the SFU: exp2 of a pre-scaled argument.
__device__ __forceinline__ float fast_exp(float x) { return exp2f(x * kLog2e); }

/// tanh through one exp and one division: saturates at +-1, keeps NaN, absolute error ~1e-7.
__device__ __forceinline__ float softcap_tanh(float y) {
  return 1.0f - 2.0f / (exp2f(2.0f * kLog2e * y) + 1.0f);
}

__device__ __forceinline__ float transform(float x, const detail::LossConstants& c, bool softcap) {
  return softcap ? c.softcap * softcap_tanh(x * c.inv_softcap) : x * c.logit_scale;
}

__device__ __forceinline__ int64_t load_target_dev(const RowParams& p, int64_t row) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[row * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[row * p.target_stride]);
}

/// Shared memory of the row pass.
struct RowShared {
  RowPartial warp[kMaxThreads / 32];
  RowPartial block;  // this block's partial, read by the cluster's other blocks
  RowPartial row;    // the merged row
};

/// Fused row kernel. kItems: 16-byte segments per thread per piece (kept in registers);
/// kGrad: write dlogits; kForward: compute the statistics (else lse comes from lse_in);
/// kExtras: softcap / smoothing / class weights / metrics compiled in (runtime flags pick).
template <typename T, int kItems, bool kForward, bool kGrad, bool kExtras>
__global__ void __launch_bounds__(max_row_threads(kItems)) ce_row_kernel(const RowParams p) {
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  __shared__ RowShared sh;

  const int rank = p.cluster > 1 ? static_cast<int>(blockIdx.x % p.cluster) : 0;
  const int64_t row = static_cast<int64_t>(blockIdx.x / p.cluster);
  if (row >= p.rows) return;  // uniform for the whole cluster
  const int64_t V = p.vocab;
  const T* x = static_cast<const T*>(p.logits) + row * p.logits_stride;
  T* dx = kGrad ? static_cast<T*>(p.dlogits) + row * p.dlogits_stride : nullptr;
  const int off = row_offset(x);
  // dlogits rows may sit at another alignment than the logits rows (different strides).
  const int doff = kGrad ? row_offset(dx) : 0;
  const int64_t t = load_target_dev(p, row);
  const int64_t nseg = row_segments(V, off, kVec);
  const int64_t piece_segs = static_cast<int64_t>(blockDim.x) * kItems;
  const int64_t block_seg0 = static_cast<int64_t>(rank) * p.pieces * piece_segs;

  if (t == p.ignore_index) {
    // Ignored row: no statistics, zero gradient. The branch is uniform over the cluster, so no
    // block waits at a cluster barrier the others skip.
    if (kForward && rank == 0 && threadIdx.x == 0) {
      p.row_loss[row * p.row_loss_stride] = 0.0f;
      if (p.lse_out) p.lse_out[row * p.lse_stride] = 0.0f;
      if (kExtras && p.metrics) {
        p.row_entropy[row] = 0.0f;
        p.row_correct[row] = 0;
      }
    }
    if (kGrad) {
      // dlogits may sit at another alignment (one segment more): the last block covers the rest.
      const int64_t dseg = row_segments(V, doff, kVec);
      const int64_t end = rank == p.cluster - 1 ? dseg : block_seg0 + p.pieces * piece_segs;
      Segment<T> zero;
      zero.raw = make_uint4(0, 0, 0, 0);
      for (int64_t s = block_seg0 + threadIdx.x; s < end && s < dseg; s += blockDim.x) {
        store_segment(dx, s, doff, V, zero);
      }
    }
    return;
  }

  const bool valid_t = t >= 0 && t < V;
  const float w_t = !valid_t ? NAN : (kExtras && p.class_weight ? p.class_weight[t * p.weight_stride] : 1.0f);
  detail::LossConstants c = p.c;
  if (kExtras && p.class_weight && p.batch) c.weight_sum = p.batch->weight_sum;
  const T neg_inf = E::from_float(-INFINITY);

  Segment<T> reg[kItems];  // the piece held in registers
  float lse;

  auto load_piece = [&](int piece) {
    const int64_t s0 = block_seg0 + static_cast<int64_t>(piece) * piece_segs + threadIdx.x;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t s = s0 + static_cast<int64_t>(k) * blockDim.x;
      if (s < nseg) {
        reg[k] = load_segment(x, s, off, V, neg_inf);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) reg[k].e[e] = neg_inf;
      }
    }
  };

  if (kForward) {
    RowPartial mine;
    mine.z_target = 0.0f;
    mine.has_target = 0;
    mine.st = detail::lse_empty();
    mine.smooth = 0.0f;
    mine.amax_v = -INFINITY;
    mine.amax_i = INT64_MAX;
    for (int piece = 0; piece < p.pieces; ++piece) {
      load_piece(piece);
      const int64_t s0 = block_seg0 + static_cast<int64_t>(piece) * piece_segs + threadIdx.x;
      // Pass 1 over the registers: max, target, smoothing sum, argmax.
      float m = -INFINITY;
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int64_t j0 = (s0 + static_cast<int64_t>(k) * blockDim.x) * kVec - off;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const int64_t j = j0 + e;
          const bool in_row = j >= 0 && j < V;
          const float z = in_row ? transform(E::to_float(reg[k].e[e]), c, kExtras && p.softcap) : -INFINITY;
          m = fmaxf(m, z);
          if (j == t) {
            mine.z_target = z;
            mine.has_target = 1;
          }
          if (kExtras) {
            if (p.smoothing && in_row) mine.smooth += p.class_weight ? p.class_weight[j * p.weight_stride] * z : z;
            if (p.metrics && in_row && argmax_better(z, j, mine.amax_v, mine.amax_i)) {
              mine.amax_v = z;
              mine.amax_i = j;
            }
          }
        }
      }
      // Pass 2: sum of exps (and the entropy term) against this thread's max.
      const float ref = detail::lse_ref(m);
      float s = 0.0f, ez = 0.0f;
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int64_t j0 = (s0 + static_cast<int64_t>(k) * blockDim.x) * kVec - off;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const int64_t j = j0 + e;
          const bool in_row = j >= 0 && j < V;
          const float z = in_row ? transform(E::to_float(reg[k].e[e]), c, kExtras && p.softcap) : -INFINITY;
          const float ex = fast_exp(z - ref);
          s += ex;
          if (kExtras && p.metrics) ez += ex > 0.0f ? ex * z : 0.0f;
        }
      }
      mine.st = detail::lse_merge(mine.st, detail::LseState{m, s, ez});
    }

    // Block reduction in a fixed order: warp shuffles, then warp 0 over the warps.
    const bool metrics = kExtras && p.metrics;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mine = merge_partial(mine, shfl_down_partial(mine, d), metrics);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    if (lane == 0) sh.warp[warp] = mine;
    __syncthreads();  // warp partials visible to warp 0
    if (warp == 0) {  // sh.block is written only here, and read after the next barrier
      RowPartial b = sh.warp[0];
      for (int w = 1; w < nwarps; ++w) b = merge_partial(b, sh.warp[w], metrics);
      if (lane == 0) sh.block = b;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p.cluster > 1) {
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();  // every block's partial (and z_target) written before any is read
      if (threadIdx.x == 0) {
        RowPartial r = *cluster.map_shared_rank(&sh.block, 0);
        for (int q = 1; q < p.cluster; ++q) r = merge_partial(r, *cluster.map_shared_rank(&sh.block, q), metrics);
        sh.row = r;
      }
      cluster.sync();  // no block leaves (freeing its shared memory) while others still read it
    } else
#endif
    {
      if (threadIdx.x == 0) sh.row = sh.block;
    }
    __syncthreads();  // sh.row visible to the whole block
    lse = detail::lse_value(sh.row.st);

    if (rank == 0 && threadIdx.x == 0) {
      const float smooth = sh.row.smooth;
      // A target outside [0, V) was held by no thread: its z is NaN, and so is the loss.
      const float z_t = sh.row.has_target ? sh.row.z_target : NAN;
      p.row_loss[row * p.row_loss_stride] =
          detail::row_loss(c, lse, z_t, w_t, smooth, kExtras && p.class_weight != nullptr);
      if (p.lse_out) p.lse_out[row * p.lse_stride] = lse;
      if (metrics) {
        p.row_entropy[row] = lse - sh.row.st.ez / sh.row.st.s;
        p.row_correct[row] = sh.row.amax_i == t ? 1 : 0;
      }
    }
  } else {
    lse = p.lse_in[row * p.lse_in_stride];
  }

  if (kGrad) {
    const float g_chain = p.batch ? p.batch->g_chain : 1.0f;
    const float g = g_chain * (p.grad_loss ? p.grad_loss[p.grad_scalar ? 0 : row * p.grad_stride] : 1.0f);
    const detail::RowGrad rg = detail::row_grad(c, lse, w_t, g);
    const bool same_layout = doff == off;
    for (int piece = 0; piece < p.pieces; ++piece) {
      // Registers still hold the piece when there is one piece per block and the forward ran.
      if (!kForward || p.pieces > 1) load_piece(piece);
      const int64_t s0 = block_seg0 + static_cast<int64_t>(piece) * piece_segs + threadIdx.x;
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int64_t s = s0 + static_cast<int64_t>(k) * blockDim.x;
        const int64_t j0 = s * kVec - off;
        Segment<T> out;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const int64_t j = j0 + e;
          const float z = transform(E::to_float(reg[k].e[e]), c, kExtras && p.softcap);
          float d = rg.g_a * fast_exp(z - lse);
          if (kExtras && p.class_weight) {
            d -= rg.g_c * ((j >= 0 && j < V) ? p.class_weight[j * p.weight_stride] : 0.0f);
          } else {
            d -= rg.g_c;
          }
          if (j == t) d -= rg.g_bt;
          d *= detail::dz_dx(z, c, kExtras && p.softcap);
          out.e[e] = E::from_float(d);
        }
        if (s < nseg) {
          if (same_layout) {
            store_segment(dx, s, off, V, out);
          } else {
            // Different alignment of dlogits rows: element by element (rare: strided views).
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
              const int64_t j = j0 + e;
              if (j >= 0 && j < V) dx[j] = out.e[e];
            }
          }
        }
      }
    }
  }
}

}  // namespace cuda
}  // namespace fusedce
