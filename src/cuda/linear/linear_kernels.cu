// The small kernels of the CUDA linear cross-entropy (see linear.h): everything but the matrix
// products (cuBLASLt) and the cross-entropy sweep (the logits kernels). All are bandwidth-trivial
// next to the products; what matters is that none needs the host and every sum has a fixed order.
#include "cuda/port.h"  // first: the platform's runtime header

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/linear/linear.h"
#include "cuda/linear/size_ladder.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {
namespace {

constexpr int kPrepareThreads = 1024;
constexpr int kRowsPerThread = 8;  // consecutive rows per thread per tile of the compaction

__device__ int64_t load_target(const LinearPrepareParams& p, int64_t i) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[i * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[i * p.target_stride]);
}

/// Exclusive prefix sum of `v` over the block; `total` gets the block's sum.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[kPrepareThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t s = lane < kPrepareThreads / 32 ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const int64_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[kPrepareThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

__global__ void __launch_bounds__(kPrepareThreads) linear_prepare_kernel(const LinearPrepareParams p) {
  __shared__ double weight_part[kPrepareThreads];
  __shared__ double class_part[kPrepareThreads];
  __shared__ int64_t bad_part[kPrepareThreads];
  double wsum = 0.0;  // this thread's rows, in row order: the same bits every run
  int64_t bad = INT64_MAX;
  int64_t base = 0;
  const int64_t tile = int64_t(kPrepareThreads) * kRowsPerThread;
  for (int64_t t0 = 0; t0 < p.rows; t0 += tile) {
    const int64_t r0 = t0 + int64_t(threadIdx.x) * kRowsPerThread;
    int64_t keep = 0;
    int64_t eff[kRowsPerThread];
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t i = r0 + k;
      eff[k] = p.ignore_index;
      if (i < p.rows) {
        if (p.shift > 0) {
          eff[k] = i % p.shift == p.shift - 1 ? p.ignore_index : load_target(p, i + 1);
        } else {
          eff[k] = load_target(p, i);
        }
        p.eff_target[i] = eff[k];
        const bool counted = eff[k] != p.ignore_index;
        if (counted) {
          if (eff[k] < 0 || eff[k] >= p.vocab) {
            bad = min(bad, i);
          } else {
            wsum += p.class_weight ? double(p.class_weight[eff[k] * p.weight_stride]) : 1.0;
          }
        }
        keep += (!p.compact || counted) ? 1 : 0;
      }
    }
    int64_t total = 0;
    int64_t at = base + block_exclusive_scan(keep, &total);
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t i = r0 + k;
      if (i < p.rows && (!p.compact || eff[k] != p.ignore_index)) p.idx[at++] = i;
    }
    base += total;
  }
  double csum = 0.0;  // the class weights, strided per thread as the logits path's prepare sums them
  if (p.class_weight) {
    for (int64_t j = threadIdx.x; j < p.vocab; j += kPrepareThreads) csum += p.class_weight[j * p.weight_stride];
  }
  weight_part[threadIdx.x] = wsum;
  class_part[threadIdx.x] = csum;
  bad_part[threadIdx.x] = bad;
  __syncthreads();
  for (int s = kPrepareThreads / 2; s > 0; s >>= 1) {  // a fixed tree: deterministic
    if (threadIdx.x < s) {
      weight_part[threadIdx.x] += weight_part[threadIdx.x + s];
      class_part[threadIdx.x] += class_part[threadIdx.x + s];
      bad_part[threadIdx.x] = min(bad_part[threadIdx.x], bad_part[threadIdx.x + s]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *p.count = base;
    *p.denom = static_cast<float>(weight_part[0]);
    *p.bad_row = bad_part[0];
    if (p.weight_sum) *p.weight_sum = p.class_weight ? static_cast<float>(class_part[0]) : static_cast<float>(p.vocab);
  }
}

template <typename T>
__device__ void copy_row(const T* src, T* dst, int64_t H) {
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[h] = src[h];
}

__device__ void copy_row_any(const void* src, void* dst, int64_t H, DType d) {
  if (d == DType::kFloat32) {
    copy_row(static_cast<const float*>(src), static_cast<float*>(dst), H);
  } else {
    copy_row(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), H);
  }
}

size_t elem_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

__global__ void product_scale_kernel(const ProductScaleParams p) {
  float alpha = 1.0f, row = 1.0f;
  if (p.reduction != static_cast<int>(Reduction::kNone)) {
    float g = p.grad_loss ? p.grad_loss[0] : 1.0f;
    if (p.reduction == static_cast<int>(Reduction::kMean)) g /= *p.denom;
    if (isfinite(g)) {
      alpha = g;
    } else {
      row = g;
    }
  }
  p.out[0] = alpha;
  p.out[1] = 0.0f;
  p.out[2] = 1.0f;
  p.out[3] = row;
}

/// One block per position: the row's target, upstream gradient and (compacting) hidden row.
__global__ void linear_gather_kernel(const LinearGatherParams p, size_t elem) {
  const int64_t k = blockIdx.x;
  if (p.count && p.p0 + k >= *p.count) {  // padding of a device-sized chunk: exact zeros
    if (threadIdx.x == 0) {
      if (p.target_out) p.target_out[k] = p.ignore_index;
      if (p.grad_out) p.grad_out[k] = 0.0f;
    }
    if (p.hidden_out) {
      char* dst = static_cast<char*>(p.hidden_out) + size_t(k) * p.H * elem;
      for (int64_t b = threadIdx.x; b < p.H * int64_t(elem); b += blockDim.x) dst[b] = 0;
    }
    return;
  }
  const int64_t row = p.idx[p.p0 + k];
  if (threadIdx.x == 0) {
    if (p.target_out) p.target_out[k] = p.eff_target[row];
    if (p.grad_out) {
      float g;
      if (p.reduction == static_cast<int>(Reduction::kNone)) {
        g = p.grad_loss ? p.grad_loss[row * p.grad_stride] : 1.0f;
      } else {
        g = *p.row_grad;
      }
      p.grad_out[k] = g;
    }
  }
  if (p.hidden_out) {
    const char* src = static_cast<const char*>(p.hidden) + size_t(row) * p.hidden_stride * elem;
    char* dst = static_cast<char*>(p.hidden_out) + size_t(k) * p.H * elem;
    copy_row_any(src, dst, p.H, p.dtype);
  }
}

__global__ void linear_scatter_kernel(const LinearScatterParams p, size_t elem) {
  const int64_t k = blockIdx.x;
  if (p.count && p.p0 + k >= *p.count) return;  // padding of a device-sized chunk
  const int64_t row = p.idx[p.p0 + k];
  if (threadIdx.x == 0) {
    if (p.lse_out) p.lse_out[row * p.lse_stride] = p.lse_in[k];
    p.row_loss[row] = p.loss_in[k];
  }
  if (p.gh_in) {
    const char* src = static_cast<const char*>(p.gh_in) + size_t(k) * p.H * elem;
    char* dst = static_cast<char*>(p.gh_out) + size_t(row) * p.gh_stride * elem;
    copy_row_any(src, dst, p.H, p.dtype);
  }
}

__global__ void shard_gather_kernel(const ShardGatherParams p) {
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < p.n; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p.idx[p.p0 + k];
    p.lse_out[k] = p.lse[row * p.lse_stride];
    p.row_weight_out[k] = p.row_weight[row * p.row_weight_stride];
    if (p.grad_loss) p.grad_out[k] = p.grad_loss[row * p.grad_stride];
  }
}

/// One block per position.
__global__ void row_scatter_kernel(const RowScatterParams p) {
  const int64_t k = blockIdx.x;
  const float* src = p.src + k * p.width;
  float* dst = p.dst + p.idx[p.p0 + k] * p.dst_stride;
  for (int64_t j = threadIdx.x; j < p.width; j += blockDim.x) dst[j] = p.add ? dst[j] + src[j] : src[j];
}

constexpr int kSliceThreads = 256;

/// A logit plus its bias, rounded to the dtype: the one rounding both low_memory passes apply.
template <typename T>
__device__ __forceinline__ float with_bias(float x, T b) {
  return Elem<T>::to_float(Elem<T>::from_float(x + Elem<T>::to_float(b)));
}

template <typename T>
__global__ void add_bias_kernel(T* x, int64_t ld, int64_t rows, int64_t cols, const T* bias) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < cols; j += int64_t(gridDim.x) * blockDim.x) {
      x[r * ld + j] = Elem<T>::from_float(with_bias(Elem<T>::to_float(x[r * ld + j]), bias[j]));
    }
  }
}

/// One block per position of the slice; 16-byte segments (rows are aligned: the slice buffer's
/// row stride is a multiple of 16 bytes). Every logit of a segment is read before its dlogits
/// are stored over it.
template <typename T>
__global__ void __launch_bounds__(kSliceThreads) linear_slice_grad_kernel(const LinearSliceGradParams p) {
  constexpr int kVec = Segment<T>::kVec;
  const int64_t k = blockIdx.x;
  T* row = static_cast<T*>(p.logits) + k * p.ld;
  const int64_t segs = row_segments(p.cols, 0, kVec);
  const int64_t t = p.eff_target[p.idx[p.p0 + k]];
  if (t == p.ignore_index) {
    Segment<T> zero;
    zero.raw = u32x4_zero();
    for (int64_t s = threadIdx.x; s < segs; s += kSliceThreads) store_segment(row, s, 0, p.cols, zero);
    return;
  }
  const bool valid_t = t >= 0 && t < p.vocab;
  const bool weighted = p.class_weight != nullptr;
  detail::LossConstants c = p.c;
  c.weight_sum = *p.weight_sum;
  // An out-of-range target (unchecked) makes the row NaN, as the logits path does.
  const float w_t = !valid_t ? NAN : (weighted ? p.class_weight[t * p.weight_stride] : 1.0f);
  const float lse = p.lse[p.p0 + k];
  const detail::RowGrad rg = detail::row_grad(c, lse, w_t, p.grad[p.p0 + k]);
  const int64_t tl = valid_t ? t - p.v0 : -1;  // target column inside the slice, if there
  for (int64_t s = threadIdx.x; s < segs; s += kSliceThreads) {
    Segment<T> seg = load_segment(row, s, 0, p.cols, Elem<T>::from_float(0.0f));
#pragma unroll
    for (int e = 0; e < kVec; e += 2) {
      float d[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t j = s * kVec + e + h;
        float x = Elem<T>::to_float(seg.e[e + h]);
        // Rounded to T as add_bias_kernel rounded the first pass's logits: the lse saved there
        // belongs to exactly these values (one 16-bit unit on a dominant logit moves its
        // probability by percents).
        if (p.bias && j < p.cols) x = Elem<T>::to_float(Elem<T>::from_float(with_bias(x, static_cast<const T*>(p.bias)[p.v0 + j])));
        const float z = detail::transform_logit(x, c, p.softcap);
        const float pj = expf(z - lse);
        const float wj = weighted && j < p.cols ? p.class_weight[(p.v0 + j) * p.weight_stride] : 1.0f;
        float g = rg.g_a * pj - rg.g_c * wj;
        if (j == tl) g -= rg.g_bt;
        d[h] = g * detail::dz_dx(z, c, p.softcap);
      }
      set_pair(seg, e / 2, d[0], d[1]);
    }
    store_segment(row, s, 0, p.cols, seg);
  }
}

constexpr int kFinishThreads = 1024;

__global__ void __launch_bounds__(kFinishThreads) linear_finish_kernel(const LinearFinishParams p) {
  __shared__ double part[kFinishThreads];
  __shared__ double ent[kFinishThreads];
  __shared__ long long cor[kFinishThreads];
  double s = 0.0, e = 0.0;
  long long c = 0;
  for (int64_t i = threadIdx.x; i < p.rows; i += kFinishThreads) s += p.row_loss[i];
  if (p.chunk_entropy) {
    for (int64_t i = threadIdx.x; i < p.chunks; i += kFinishThreads) {
      e += p.chunk_entropy[i];
      c += p.chunk_correct[i];
    }
  }
  part[threadIdx.x] = s;
  ent[threadIdx.x] = e;
  cor[threadIdx.x] = c;
  __syncthreads();
  for (int k = kFinishThreads / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) {
      part[threadIdx.x] += part[threadIdx.x + k];
      ent[threadIdx.x] += ent[threadIdx.x + k];
      cor[threadIdx.x] += cor[threadIdx.x + k];
    }
    __syncthreads();
  }
  if (p.reduction == static_cast<int>(Reduction::kNone)) {
    for (int64_t i = threadIdx.x; i < p.rows; i += kFinishThreads) p.loss_out[i * p.loss_stride] = p.row_loss[i];
  }
  if (threadIdx.x == 0) {
    if (p.reduction != static_cast<int>(Reduction::kNone)) {
      double total = part[0];
      // All rows ignored: 0 / 0 = NaN, as PyTorch's mean.
      if (p.reduction == static_cast<int>(Reduction::kMean)) total /= double(*p.denom);
      p.loss_out[0] = static_cast<float>(total);
    }
    if (p.chunk_entropy) {
      *p.entropy_out = static_cast<float>(ent[0]);
      *p.correct_out = cor[0];
    }
  }
}

template <typename T>
__global__ void convert_kernel(const ConvertParams p) {
  const int64_t n = p.rows * p.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.cols, c = i - r * p.cols;
    static_cast<T*>(p.dst)[r * p.dst_stride + c] = Elem<T>::from_float(p.src[i]);
  }
}

template <typename T>
__global__ void fill_ones_kernel(T* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = Elem<T>::from_float(1.0f);
  }
}

__global__ void zero_strided_kernel(float* dst, int64_t n, int64_t stride) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i * stride] = 0.0f;
  }
}

#if FUSEDCE_GRAPH_SWITCH
__global__ void linear_branch_kernel(const LinearBranchParams p) {
  const int64_t count = *p.count;
  unsigned v;
  if (p.kind == LinearBranchParams::kChunk) {
    v = static_cast<unsigned>(LadderBranch::of(p.size, p.rungs, p.capacity, count - p.p0));
  } else {
    v = count <= 0 ? 0u : (count <= p.capacity ? 1u : 2u);
  }
  cudaGraphSetConditional(p.handle, v);
}
#endif

unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks));
}

}  // namespace

void launch_linear_prepare(const LinearPrepareParams& p, cudaStream_t stream) {
  linear_prepare_kernel<<<1, kPrepareThreads, 0, stream>>>(p);
}

void launch_linear_gather(const LinearGatherParams& p, cudaStream_t stream) {
  if (p.n <= 0) return;
  linear_gather_kernel<<<static_cast<unsigned>(p.n), p.hidden_out ? 256 : 32, 0, stream>>>(p, elem_bytes(p.dtype));
}

#if FUSEDCE_GRAPH_SWITCH
void launch_linear_branch(const LinearBranchParams& p, cudaStream_t stream) {
  linear_branch_kernel<<<1, 1, 0, stream>>>(p);
}
#endif

void launch_linear_scatter(const LinearScatterParams& p, cudaStream_t stream) {
  if (p.n <= 0) return;
  linear_scatter_kernel<<<static_cast<unsigned>(p.n), p.gh_in ? 256 : 32, 0, stream>>>(p, elem_bytes(p.dtype));
}

void launch_shard_gather(const ShardGatherParams& p, cudaStream_t stream) {
  if (p.n > 0) shard_gather_kernel<<<grid_for(p.n, 256), 256, 0, stream>>>(p);
}

void launch_row_scatter(const RowScatterParams& p, cudaStream_t stream) {
  if (p.n > 0) row_scatter_kernel<<<static_cast<unsigned>(p.n), p.width <= 64 ? 32 : 256, 0, stream>>>(p);
}

void launch_linear_finish(const LinearFinishParams& p, cudaStream_t stream) {
  linear_finish_kernel<<<1, kFinishThreads, 0, stream>>>(p);
}

void launch_convert(const ConvertParams& p, cudaStream_t stream) {
  const unsigned grid = grid_for(p.rows * p.cols, 256);
  switch (p.dtype) {
    case DType::kFloat32: convert_kernel<float><<<grid, 256, 0, stream>>>(p); break;
    case DType::kBFloat16: convert_kernel<BFloat16><<<grid, 256, 0, stream>>>(p); break;
    default: convert_kernel<Half><<<grid, 256, 0, stream>>>(p); break;
  }
}

void launch_linear_slice_grad(const LinearSliceGradParams& p, cudaStream_t stream) {
  if (p.n <= 0 || p.cols <= 0) return;
  const unsigned grid = static_cast<unsigned>(p.n);
  switch (p.dtype) {
    case DType::kFloat32: linear_slice_grad_kernel<float><<<grid, kSliceThreads, 0, stream>>>(p); break;
    case DType::kBFloat16: linear_slice_grad_kernel<BFloat16><<<grid, kSliceThreads, 0, stream>>>(p); break;
    default: linear_slice_grad_kernel<Half><<<grid, kSliceThreads, 0, stream>>>(p); break;
  }
}

void launch_product_scale(const ProductScaleParams& p, cudaStream_t stream) {
  product_scale_kernel<<<1, 1, 0, stream>>>(p);
}

void launch_add_bias(void* x, int64_t ld, int64_t rows, int64_t cols, const void* bias, DType dtype,
                     cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((cols + 255) / 256, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  switch (dtype) {
    case DType::kFloat32:
      add_bias_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(x), ld, rows, cols, static_cast<const float*>(bias));
      break;
    case DType::kBFloat16:
      add_bias_kernel<<<grid, 256, 0, stream>>>(static_cast<BFloat16*>(x), ld, rows, cols,
                                                static_cast<const BFloat16*>(bias));
      break;
    default:
      add_bias_kernel<<<grid, 256, 0, stream>>>(static_cast<Half*>(x), ld, rows, cols, static_cast<const Half*>(bias));
      break;
  }
}

void launch_fill_ones(void* dst, int64_t n, DType dtype, cudaStream_t stream) {
  const unsigned grid = grid_for(n, 256);
  switch (dtype) {
    case DType::kFloat32: fill_ones_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(dst), n); break;
    case DType::kBFloat16: fill_ones_kernel<<<grid, 256, 0, stream>>>(static_cast<BFloat16*>(dst), n); break;
    default: fill_ones_kernel<<<grid, 256, 0, stream>>>(static_cast<Half*>(dst), n); break;
  }
}

void launch_zero_strided(float* dst, int64_t n, int64_t stride, cudaStream_t stream) {
  if (n > 0) zero_strided_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dst, n, stride);
}

}  // namespace cuda
}  // namespace fusedce
