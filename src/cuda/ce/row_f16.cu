// Instantiations of the row, streaming and rescale kernels for Half (one translation unit per dtype).
#include "cuda/ce/kernels.h"
#include "cuda/ce/rescale_kernel.cuh"
#include "cuda/ce/row_kernel.cuh"
#include "cuda/ce/stream_kernel.cuh"

namespace fusedce {
namespace cuda {
namespace {

template <int kItems, bool kExtras>
RowKernel pick_job(bool forward, bool grad) {
  if (forward && grad) return ce_row_kernel<Half, kItems, true, true, kExtras>;
  if (forward) return ce_row_kernel<Half, kItems, true, false, kExtras>;
  return ce_row_kernel<Half, kItems, false, true, kExtras>;
}

}  // namespace

RowKernel select_row_kernel_f16(int items, bool forward, bool grad, bool extras) {
  if (items >= 4) return extras ? pick_job<4, true>(forward, grad) : pick_job<4, false>(forward, grad);
  return extras ? pick_job<1, true>(forward, grad) : pick_job<1, false>(forward, grad);
}

RescaleKernel rescale_kernel_f16() { return ce_rescale_kernel<Half>; }

StreamKernel select_stream_kernel_f16(bool grad, StreamOpts opts, int groups) {
  return pick_stream_kernel<Half>(grad, opts, groups);
}

}  // namespace cuda
}  // namespace fusedce
