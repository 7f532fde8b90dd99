// One-block passes over the batch, before and after the row kernel.
//
// prepare: reads the N targets (and the V class weights) once: the mean's denominator, the sum
// of class weights, the first out-of-range target. finalize: sums the per-row losses, entropies
// and correct flags. Both sum in a fixed order (strided per thread in double, then a tree), so
// results are the same bits run to run. Bytes: N * 8 (+ V * 4) and N * 9: microseconds at the
// batch sizes of training.
#include <cstdint>

#include "cuda/kernels.h"

namespace fusedce {
namespace cuda {
namespace {

constexpr int kBatchThreads = 1024;

__device__ __forceinline__ int64_t batch_target(const BatchParams& p, int64_t i) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[i * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[i * p.target_stride]);
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
  for (int64_t i = threadIdx.x; i < p.rows; i += blockDim.x) {
    const int64_t t = batch_target(p, i);
    if (t == p.ignore_index) continue;
    if (t < 0 || t >= p.vocab) {
      atomicMin(&bad_row, static_cast<unsigned long long>(i));
    } else {
      den += p.class_weight ? static_cast<double>(p.class_weight[t * p.weight_stride]) : 1.0;
    }
  }
  if (p.class_weight) {
    for (int64_t j = threadIdx.x; j < p.vocab; j += blockDim.x) wsum += p.class_weight[j * p.weight_stride];
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

__global__ void __launch_bounds__(kBatchThreads) ce_finalize_kernel(const BatchParams p) {
  __shared__ double smem[kBatchThreads];
  double loss = 0.0, entropy = 0.0, correct = 0.0;
  for (int64_t i = threadIdx.x; i < p.rows; i += blockDim.x) {
    if (p.loss_out) loss += p.row_loss[i];
    if (p.num_correct_out) {
      entropy += p.row_entropy[i];
      correct += p.row_correct[i];
    }
  }
  if (p.loss_out) {
    loss = block_sum(loss, smem);
    if (threadIdx.x == 0) {
      // mean: the prepare pass's denominator (0 when every row is ignored: 0 / 0 = NaN, as PyTorch).
      *p.loss_out = p.mean ? static_cast<float>(loss / p.batch->denominator)
                           : static_cast<float>(loss);
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

}  // namespace

void launch_prepare(const BatchParams& p, cudaStream_t stream) {
  ce_prepare_kernel<<<1, kBatchThreads, 0, stream>>>(p);
}

void launch_finalize(const BatchParams& p, cudaStream_t stream) {
  ce_finalize_kernel<<<1, kBatchThreads, 0, stream>>>(p);
}

}  // namespace cuda
}  // namespace fusedce
