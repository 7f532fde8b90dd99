// dlogits[i, :] *= grad_loss[i] (or the scalar grad_loss[0]): the upstream-gradient rescale of a
// gradient formed with an upstream gradient of 1. Persistent blocks walk the (row, chunk) items;
// with a scalar factor of exactly 1 (the common case: a mean or sum loss whose backward starts
// at 1) every block returns at once, and an item whose row factor is 1 is skipped without
// touching the row. Otherwise 2 * V * sizeof(T) bytes per row (read + write), bandwidth-bound.
// (Persistent blocks, not one block per item: at 8192 x 128256 that would launch 131072 blocks
// that return at once, about 90 us of GPU time in every torch-op backward.)
#pragma once

#include "cuda/ce/kernels.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

template <typename T>
__global__ void __launch_bounds__(kRescaleThreads) ce_rescale_kernel(const RescaleParams p) {
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  if (p.grad_scalar && p.grad_loss[0] == 1.0f) return;
  const int64_t items = p.rows * p.chunks_per_row;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t row = w / p.chunks_per_row;
    const int64_t chunk = w % p.chunks_per_row;
    const float f = p.grad_loss[p.grad_scalar ? 0 : row * p.grad_stride];
    if (f == 1.0f) continue;
    T* y = static_cast<T*>(p.dlogits) + row * p.stride;
    const int off = row_offset(y);
    const int64_t nseg = row_segments(p.vocab, off, kVec);
    const int64_t s0 = chunk * kRescaleThreads * kRescaleItems + threadIdx.x;
    Segment<T> reg[kRescaleItems];
#pragma unroll
    for (int k = 0; k < kRescaleItems; ++k) {
      const int64_t s = s0 + k * kRescaleThreads;
      if (s < nseg) reg[k] = load_segment(y, s, off, p.vocab, E::from_float(0.0f));
    }
#pragma unroll
    for (int k = 0; k < kRescaleItems; ++k) {
      const int64_t s = s0 + k * kRescaleThreads;
      if (s >= nseg) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e) reg[k].e[e] = E::from_float(E::to_float(reg[k].e[e]) * f);
      store_segment(y, s, off, p.vocab, reg[k]);
    }
  }
}

}  // namespace cuda
}  // namespace fusedce
