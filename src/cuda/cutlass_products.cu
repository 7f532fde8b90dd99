// CUTLASS kernels for the linear cross-entropy's three products (cutlass_products.h), sm_90a.
// Each product is one GemmUniversal of CUTLASS's collective builders: TMA loads into a
// multi-stage shared-memory ring, WGMMA with float32 accumulation, a warp-specialized persistent
// kernel, and a TMA epilogue that adds the float32 C (the grad_weight accumulator) before the one
// rounding to D's type. Tile shapes per product are those measured fastest on an H200 at the
// benchmark's shapes (bench/RESULTS.md, "CUTLASS products").
#include "cuda/cutlass_products.h"

#include <cuda_runtime.h>

#include <sstream>
#include <type_traits>

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

/// A CuTe stride with leading dimension `ld`: the one dynamic mode among the first two (the
/// other is the static unit stride); the batch mode is unused.
template <class Stride>
Stride stride_with_ld(int64_t ld) {
  Stride s{};
  if constexpr (!is_static<remove_cvref_t<decltype(get<0>(s))>>::value) get<0>(s) = ld;
  if constexpr (!is_static<remove_cvref_t<decltype(get<1>(s))>>::value) get<1>(s) = ld;
  return s;
}

/// One kernel: D (M x N, row-major) = A (M x K) . B (K x N) (+ C), bf16 operands, float32
/// accumulation. LayoutA / LayoutB in CUTLASS's tags (RowMajor A: K contiguous; RowMajor B: N
/// contiguous; ColumnMajor B: K contiguous).
template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Tile, class Cluster, class Schedule,
          class EpilogueSchedule>
struct Kernel {
  // ElementC void: no C operand (D = product).
  static constexpr int kAlignC = 16 / sizeof(std::conditional_t<std::is_void_v<ElementC>, ElementD, ElementC>);
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

  /// beta multiplies C (0: C is not read, though it must be a valid address of C's shape).
  static Status run(int M, int N, int K, const void* a, int64_t lda, const void* b, int64_t ldb, const void* c,
                    int64_t ldc, float beta, void* d, int64_t ldd, int sm_count, cudaStream_t stream) {
    using GK = GemmKernel;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const bf16*>(a), stride_with_ld<typename GK::StrideA>(lda), static_cast<const bf16*>(b),
         stride_with_ld<typename GK::StrideB>(ldb)},
        {{1.0f, beta}, static_cast<const ElementC*>(c), stride_with_ld<typename GK::StrideC>(ldc), static_cast<ElementD*>(d),
         stride_with_ld<typename GK::StrideD>(ldd)},
        cutlass::KernelHardwareInfo{0, sm_count}};
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return Status(StatusCode::kUnsupported, "CUTLASS cannot run this product");
    }
    if (Gemm::get_workspace_size(args) != 0) {
      return Status(StatusCode::kUnsupported, "CUTLASS product needs a workspace");
    }
    cutlass::Status s = gemm.initialize(args, nullptr, stream);
    if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
    if (s != cutlass::Status::kSuccess) {
      const cudaError_t e = cudaGetLastError();
      std::ostringstream os;
      os << "CUTLASS product failed: " << cutlassGetStatusString(s) << " (" << cudaGetErrorString(e) << ")";
      return Status(StatusCode::kDeviceError, os.str());
    }
    return Status::Ok();
  }
};

// Cooperative: two consumer warp groups share each 128 x 256 tile (64 x 256 float32 accumulators
// each, which fit their registers), a cluster of two CTAs along M sharing B's tiles by multicast.
// On an H200 at the benchmark's shapes it runs each of the three products at 800-860 TFLOP/s,
// 1-5% ahead of cuBLASLt (dev/cutlass_probe); pingpong tiles of 128 x 256 do not fit the
// registers (the WGMMAs serialize) and 256 x 128 cooperative tiles ran behind.
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiCooperative = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Tile = Shape<_128, _256, _64>;
using Cluster = Shape<_2, _1, _1>;
template <class LayoutA, class LayoutB, class ElementC, class ElementD>
using ProductKernel = Kernel<LayoutA, LayoutB, ElementC, ElementD, Tile, Cluster, Cooperative, EpiCooperative>;

// logits: A = hidden (K = H contiguous), B = weight (V x H): K contiguous.
using LogitsKernel = ProductKernel<RowMajor, ColumnMajor, void, bf16>;
// grad_hidden: A = dlogits (K = V contiguous), B = weight (V x H): N = H contiguous.
using GradHiddenKernel = ProductKernel<RowMajor, RowMajor, void, bf16>;
// grad_weight: A = dlogits^T (M = V contiguous), B = hidden (rows x H): N = H contiguous; into the
// float32 accumulator, or rounded to bf16 from accumulator + product, or rounded directly.
using GradWeightAccKernel = ProductKernel<ColumnMajor, RowMajor, float, float>;
using GradWeightOutKernel = ProductKernel<ColumnMajor, RowMajor, float, bf16>;
using GradWeightDirectKernel = ProductKernel<ColumnMajor, RowMajor, void, bf16>;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// TMA needs 16-byte aligned bases and row strides that are multiples of 16 bytes, and CUTLASS
/// asks the same of every contiguous extent: V and H (the rows may be any number); int sizes.
bool addressable(const Product& p) {
  const int64_t big = (int64_t(1) << 31) - 1;
  if (p.rows <= 0 || p.V <= 0 || p.H <= 0 || p.rows > big || p.V > big || p.H > big) return false;
  if (p.V % 8 || p.H % 8) return false;
  const size_t d_el = p.d_dtype == DType::kFloat32 ? 4 : 2;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d) || (p.c && !aligned16(p.c))) return false;
  if (p.lda % 8 || p.ldb % 8 || (p.ldd * int64_t(d_el)) % 16 || (p.c && p.ldc % 4)) return false;
  return true;
}

int sm_count_of(int device) {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  return n;
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

Status run_product(const Product& p) {
  if (!addressable(p)) return Status(StatusCode::kUnsupported, "operands TMA cannot address");
  const int sms = sm_count_of(p.device);
  const int rows = static_cast<int>(p.rows), V = static_cast<int>(p.V), H = static_cast<int>(p.H);
  switch (p.kind) {
    case ProductKind::kLogits:
      if (p.d_dtype != DType::kBFloat16 || p.c) break;
      return LogitsKernel::run(rows, V, H, p.a, p.lda, p.b, p.ldb, nullptr, p.ldd, 0.0f, p.d, p.ldd, sms, p.stream);
    case ProductKind::kGradHidden:
      if (p.d_dtype != DType::kBFloat16 || p.c) break;
      return GradHiddenKernel::run(rows, H, V, p.a, p.lda, p.b, p.ldb, nullptr, p.ldd, 0.0f, p.d, p.ldd, sms, p.stream);
    case ProductKind::kGradWeight:
      if (p.d_dtype == DType::kFloat32) {
        // The first chunk (no C) names D as C, unread at beta 0.
        return GradWeightAccKernel::run(V, H, rows, p.a, p.lda, p.b, p.ldb, p.c ? p.c : p.d, p.c ? p.ldc : p.ldd,
                                        p.c ? 1.0f : 0.0f, p.d, p.ldd, sms, p.stream);
      }
      if (p.d_dtype == DType::kBFloat16 && p.c == nullptr) {
        return GradWeightDirectKernel::run(V, H, rows, p.a, p.lda, p.b, p.ldb, nullptr, p.ldd, 0.0f, p.d, p.ldd, sms, p.stream);
      }
      if (p.d_dtype == DType::kBFloat16) {
        return GradWeightOutKernel::run(V, H, rows, p.a, p.lda, p.b, p.ldb, p.c, p.ldc, 1.0f, p.d, p.ldd, sms, p.stream);
      }
      break;
  }
  return Status(StatusCode::kUnsupported, "no CUTLASS kernel for this product's types");
}

}  // namespace cuda
}  // namespace fusedce
