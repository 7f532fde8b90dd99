// dlogits[i, :] *= grad_loss[i] (or the scalar grad_loss[0]): the upstream-gradient rescale of a
// gradient formed with an upstream gradient of 1. A block whose row factor is exactly 1 returns
// before touching the row, so the common case costs a launch and no traffic; otherwise
// 2 * V * sizeof(T) bytes per row (read + write), bandwidth-bound.
#pragma once

#include "cuda/kernels.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {

template <typename T>
__global__ void __launch_bounds__(kRescaleThreads) ce_rescale_kernel(const RescaleParams p) {
  using E = Elem<T>;
  constexpr int kVec = Segment<T>::kVec;
  const int64_t row = blockIdx.x / p.chunks_per_row;
  const int64_t chunk = blockIdx.x % p.chunks_per_row;
  const float f = p.grad_loss[p.grad_scalar ? 0 : row * p.grad_stride];
  if (f == 1.0f) return;
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

}  // namespace cuda
}  // namespace fusedce
