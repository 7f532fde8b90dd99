// One-block passes over the batch, before and after the row kernel.
//
// prepare: reads the N targets (and the V class weights) once: the mean's denominator, the sum
// of class weights, the first out-of-range target. finalize: sums the per-row losses, entropies
// and correct flags (and counts the mean's rows when no prepare ran). split merge: for few rows
// split over blocks, folds each row's partials into its results, then finalizes. On sm_90 the
// stream kernel does the last two itself (finish.cuh); these serve the row kernels (GPUs before
// sm_90, or PlanChoices::stream off) and PlanChoices::stream_finish off. Both sum in a fixed
// order (strided per thread in double, then a tree), so results are the same bits run to run. Bytes: N * 8 (+ V * 4) and N * 9: microseconds at the
// batch sizes of training (the strided loops keep kBatchUnroll loads in flight per thread).
#include <cstdint>

#include "cuda/ce/element_math.cuh"
#include "cuda/ce/kernels.h"

namespace fusedce {
namespace cuda {
namespace {

constexpr int kBatchThreads = 1024;

__device__ __forceinline__ int64_t batch_target(const BatchParams& p, int64_t i) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[i * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[i * p.target_stride]);
}

// Loads in flight per thread in the strided loops below: one block must cover a batch's targets
// and a vocabulary's class weights, and a loop with one load in flight per thread is latency-bound
// (1024 threads x 4 bytes a microsecond: ~130 us for 128K class weights).
constexpr int kBatchUnroll = 8;

// Visits i = threadIdx.x, threadIdx.x + blockDim.x, ... < n in that order (so sums keep their
// order and bits), kBatchUnroll indices at a time: load(i) for all of them first, so their
// latencies overlap, then use(i, loaded) in order.
template <typename Load, typename Use>
__device__ __forceinline__ void strided_batches(int64_t n, Load load, Use use) {
  for (int64_t i0 = threadIdx.x; i0 < n; i0 += int64_t(blockDim.x) * kBatchUnroll) {
    decltype(load(i0)) v[kBatchUnroll];
#pragma unroll
    for (int u = 0; u < kBatchUnroll; ++u) {
      const int64_t i = i0 + int64_t(u) * blockDim.x;
      if (i < n) v[u] = load(i);
    }
#pragma unroll
    for (int u = 0; u < kBatchUnroll; ++u) {
      const int64_t i = i0 + int64_t(u) * blockDim.x;
      if (i < n) use(i, v[u]);
    }
  }
}

// Fixed-order tree sum of one double per thread; the result is returned to thread 0.
__device__ double block_sum(double v, double* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();  // all values stored before the tree reads them
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) smem[threadIdx.x] += smem[threadIdx.x + half];
    __syncthreads();  // this level done before the next reads it
  }
  const double r = smem[0];
  __syncthreads();  // everyone read smem[0] before smem is reused
  return r;
}

__global__ void __launch_bounds__(kBatchThreads) ce_prepare_kernel(const BatchParams p) {
  __shared__ double smem[kBatchThreads];
  __shared__ unsigned long long bad_row;
  if (threadIdx.x == 0) bad_row = INT64_MAX;
  __syncthreads();  // bad_row initialised before any atomicMin
  double den = 0.0, wsum = 0.0;
  struct TargetWeight {
    int64_t t;
    float w;  // the target's class weight (1 unweighted; 0 when ignored or out of range)
  };
  strided_batches(
      p.rows,
      [&](int64_t i) {
        const int64_t t = batch_target(p, i);
        const bool valid = t != p.ignore_index && t >= 0 && t < p.vocab;
        return TargetWeight{t, !valid ? 0.0f : p.class_weight ? p.class_weight[t * p.weight_stride] : 1.0f};
      },
      [&](int64_t i, const TargetWeight& tw) {
        if (tw.t == p.ignore_index) return;
        if (tw.t < 0 || tw.t >= p.vocab) {
          atomicMin(&bad_row, static_cast<unsigned long long>(i));
        } else {
          den += static_cast<double>(tw.w);
        }
      });
  if (p.class_weight) {
    strided_batches(
        p.vocab, [&](int64_t j) { return p.class_weight[j * p.weight_stride]; },
        [&](int64_t, float w) { wsum += w; });
  }
  den = block_sum(den, smem);
  wsum = block_sum(wsum, smem);
  if (threadIdx.x == 0) {
    BatchScalars& b = *p.batch;
    b.denominator = den;
    b.weight_sum = p.class_weight ? static_cast<float>(wsum) : static_cast<float>(p.vocab);
    b.g_chain = p.mean ? static_cast<float>(1.0 / den) : 1.0f;
    b.bad_row = static_cast<int64_t>(bad_row);
    b.bad_value = bad_row != INT64_MAX ? batch_target(p, static_cast<int64_t>(bad_row)) : 0;
  }
}

// The batch sums of the per-row results, in a fixed order. With count_rows, the mean's
// denominator too (no prepare pass ran).
__device__ void finalize_sums(const BatchParams& p, double* smem) {
  double loss = 0.0, entropy = 0.0, correct = 0.0, den = 0.0;
  struct RowResults {
    float loss, entropy;
    uint8_t correct, counted;
  };
  strided_batches(
      p.rows,
      [&](int64_t i) {
        RowResults r = {0.0f, 0.0f, 0, 0};
        if (p.loss_out) r.loss = p.row_loss[i];
        if (p.num_correct_out) {
          r.entropy = p.row_entropy[i];
          r.correct = p.row_correct[i];
        }
        if (p.count_rows) {
          const int64_t t = batch_target(p, i);
          r.counted = t != p.ignore_index && t >= 0 && t < p.vocab;
        }
        return r;
      },
      [&](int64_t, const RowResults& r) {
        if (p.loss_out) loss += r.loss;
        if (p.num_correct_out) {
          entropy += r.entropy;
          correct += r.correct;
        }
        if (p.count_rows) den += r.counted ? 1.0 : 0.0;
      });
  if (p.loss_out) {
    loss = block_sum(loss, smem);
    den = p.count_rows ? block_sum(den, smem) : 0.0;
    if (threadIdx.x == 0) {
      // mean: the denominator (0 when every row is ignored: 0 / 0 = NaN, as PyTorch).
      if (p.mean) den = p.count_rows ? den : p.batch->denominator;
      *p.loss_out = p.mean ? static_cast<float>(loss / den) : static_cast<float>(loss);
    }
  }
  if (p.num_correct_out) {
    entropy = block_sum(entropy, smem);
    correct = block_sum(correct, smem);
    if (threadIdx.x == 0) {
      *p.entropy_out = static_cast<float>(entropy);
      *p.num_correct_out = static_cast<int64_t>(correct);
    }
  }
}

__global__ void __launch_bounds__(kBatchThreads) ce_finalize_kernel(const BatchParams p) {
  __shared__ double smem[kBatchThreads];
  finalize_sums(p, smem);
}

// Few rows split over blocks (the stream kernel): each row's partials folded by one warp in a
// fixed tree order (the bits do not depend on which split finished first), the row's results
// written, then the batch sums. Rows whose target is ignore_index were written by the stream
// kernel and published no partials.
__global__ void __launch_bounds__(kBatchThreads) ce_split_merge_kernel(const BatchParams bp, const RowParams rp,
                                                                        const RowPartial* parts, int splits) {
  __shared__ double smem[kBatchThreads];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  const bool metrics = rp.metrics;
  const bool weighted = rp.class_weight != nullptr;
  detail::LossConstants c = rp.c;
  if (weighted && rp.batch) c.weight_sum = rp.batch->weight_sum;
  const int lanes = min(splits, kWarpSize);
  for (int64_t row = warp; row < rp.rows; row += nwarps) {
    const int64_t t = batch_target(bp, row);
    if (t == bp.ignore_index) continue;
    const RowPartial* q = parts + row * splits;
    // Lanes past the last split hold a copy of it that the tree never merges.
    RowPartial a = q[min(lane, splits - 1)];
    if (lane + kWarpSize < splits) a = merge_partial(a, q[lane + kWarpSize], metrics);
    for (int d = 1; d < kWarpSize; d *= 2) {
      const RowPartial o = shfl_down_partial(a, d, metrics, true);
      if ((lane & (2 * d - 1)) == 0 && lane + d < lanes) a = merge_partial(a, o, metrics);
    }
    if (lane == 0) {
      const bool valid_t = t >= 0 && t < rp.vocab;
      const float w_t = !valid_t ? NAN : (weighted ? rp.class_weight[t * rp.weight_stride] : 1.0f);
      write_row_results(rp, row, a, detail::lse_value(a.st), a.has_target ? a.z_target : NAN, c, w_t, valid_t ? t : -1,
                        weighted, metrics);
    }
  }
  __syncthreads();  // every row's results written before the sums read them
  if (bp.loss_out || bp.num_correct_out) finalize_sums(bp, smem);
}

}  // namespace

void launch_prepare(const BatchParams& p, cudaStream_t stream) {
  ce_prepare_kernel<<<1, kBatchThreads, 0, stream>>>(p);
}

void launch_finalize(const BatchParams& p, cudaStream_t stream) {
  ce_finalize_kernel<<<1, kBatchThreads, 0, stream>>>(p);
}

void launch_split_merge(const BatchParams& bp, const RowParams& rp, const void* partials, int splits,
                        cudaStream_t stream) {
  ce_split_merge_kernel<<<1, kBatchThreads, 0, stream>>>(bp, rp, static_cast<const RowPartial*>(partials), splits);
}

}  // namespace cuda
}  // namespace fusedce
