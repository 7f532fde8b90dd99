// The CUTLASS kernel of cutlass_products.h, sm_90a: one GemmUniversal of CUTLASS's collective
// builders: TMA loads into a multi-stage shared-memory ring, WGMMA with float32 accumulation, a
// warp-specialized persistent kernel, and a TMA epilogue that adds the float32 C (the grad_weight
// accumulator) before the one rounding to D's type.
#include "cuda/linear/cutlass_products.h"

#include <cuda_runtime.h>

#include "cuda/linear/cutlass_run.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace fusedce {
namespace cuda {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

/// One kernel: D (M x N, row-major) = A (M x K) . B (K x N) (+ C), bf16 operands, float32
/// accumulation. LayoutA / LayoutB in CUTLASS's tags (RowMajor A: K contiguous; RowMajor B: N
/// contiguous; ColumnMajor B: K contiguous).
template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Tile, class Cluster, class Schedule,
          class EpilogueSchedule>
struct Kernel {
  static constexpr int kAlignC = 16 / sizeof(ElementC);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, ElementC, RowMajor, kAlignC, ElementD, RowMajor, kAlignD, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, LayoutA, 8, bf16, LayoutB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  /// alpha (*alpha on the device, 1 where null) multiplies the product, beta C (0: C is not read,
  /// though it must be a valid address of C's shape).
  static Status run(int M, int N, int K, const void* a, int64_t lda, const void* b, int64_t ldb, const void* c,
                    int64_t ldc, const float* alpha, float beta, void* d, int64_t ldd, int device,
                    cudaStream_t stream) {
    using GK = GemmKernel;
    using cutlass_run::stride_with_ld;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const bf16*>(a), stride_with_ld<typename GK::StrideA>(lda), static_cast<const bf16*>(b),
         stride_with_ld<typename GK::StrideB>(ldb)},
        {{1.0f, beta, alpha}, static_cast<const ElementC*>(c), stride_with_ld<typename GK::StrideC>(ldc), static_cast<ElementD*>(d),
         stride_with_ld<typename GK::StrideD>(ldd)},
        cutlass_run::hardware_of(device)};
    return cutlass_run::run<Gemm>(args, stream, "CUTLASS product");
  }
};

// Cooperative: two consumer warp groups share each 128 x 256 tile (64 x 256 float32 accumulators
// each, which fit their registers), a cluster of two CTAs along M sharing B's tiles by multicast.
// On an H200 with random bf16 data it ran the rounded grad_weight product within 2% of
// cuBLASLt's float32-output product at the benchmark's shapes (dev/cutlass_probe), so the
// rounding pass it replaces is a saving; pingpong 128 x 256 tiles serialize their WGMMAs for
// want of registers.
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiCooperative = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Tile = Shape<_128, _256, _64>;
using Cluster = Shape<_2, _1, _1>;

// D (V x H) = A (V x rows) . B (rows x H) + C: A = dlogits^T (M = V contiguous), B = hidden
// (N = H contiguous), C the float32 accumulator, D the bf16 grad_weight.
using RoundedWeightKernel = Kernel<ColumnMajor, RowMajor, float, bf16, Tile, Cluster, Cooperative, EpiCooperative>;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// TMA needs 16-byte aligned bases and row strides that are multiples of 16 bytes, and CUTLASS
/// asks the same of every contiguous extent: V and H (the rows may be any number); int sizes.
bool addressable(const RoundedWeightProduct& p) {
  const int64_t big = (int64_t(1) << 31) - 1;
  if (p.rows <= 0 || p.V <= 0 || p.H <= 0 || p.rows > big || p.V > big || p.H > big) return false;
  if (p.V % 8 || p.H % 8) return false;
  if (!aligned16(p.dlogits) || !aligned16(p.hidden) || !aligned16(p.acc) || !aligned16(p.grad_weight)) return false;
  return p.ld_dlogits % 8 == 0 && p.ld_hidden % 8 == 0 && p.ld_acc % 4 == 0 && p.ld_grad_weight % 8 == 0;
}

}  // namespace

bool cutlass_products_available(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

Status run_rounded_weight_product(const RoundedWeightProduct& p) {
  if (!addressable(p)) return Status(StatusCode::kUnsupported, "operands TMA cannot address");
  return RoundedWeightKernel::run(static_cast<int>(p.V), static_cast<int>(p.H), static_cast<int>(p.rows), p.dlogits,
                                  p.ld_dlogits, p.hidden, p.ld_hidden, p.acc, p.ld_acc, p.alpha, 1.0f, p.grad_weight,
                                  p.ld_grad_weight, p.device, p.stream);
}

}  // namespace cuda
}  // namespace fusedce
