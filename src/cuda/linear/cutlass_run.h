// What every CUTLASS GemmUniversal of the library shares (cutlass_products.cu, window_forward.cu,
// logprobs/lp_fused_products.cu; all compiled for sm_90a alone): the hardware description, the
// leading-dimension strides, one checked launch without a workspace, and the frame of a register
// epilogue. Include only from those CUTLASS translation units.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <type_traits>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {
namespace cutlass_run {

/// The device's multiprocessor count for CUTLASS's persistent scheduler.
inline cutlass::KernelHardwareInfo hardware_of(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  hw.sm_count = n;
  return hw;
}

/// A CuTe stride with leading dimension `ld`: the one dynamic mode among the first two (the other
/// is the static unit stride); the batch mode is unused.
template <class Stride>
Stride stride_with_ld(int64_t ld) {
  Stride s{};
  if constexpr (!cute::is_static<std::remove_cv_t<std::remove_reference_t<decltype(cute::get<0>(s))>>>::value) {
    cute::get<0>(s) = ld;
  }
  if constexpr (!cute::is_static<std::remove_cv_t<std::remove_reference_t<decltype(cute::get<1>(s))>>>::value) {
    cute::get<1>(s) = ld;
  }
  return s;
}

/// What CUTLASS's adapter for register epilogues (Sm90TmaWarpSpecializedAdapter) asks of an
/// epilogue that takes the accumulators in registers and writes what it likes: the element and
/// stride types it names (bf16, no source tensor) and the host hooks of an epilogue without a
/// workspace, its arguments being its parameters (`P`). An epilogue derives from it and adds its
/// SharedStorage, TensorStorage, constructor and operator().
template <class P>
struct RegisterEpilogueBase {
  using bf16 = cutlass::bfloat16_t;
  struct ThreadEpilogueOp {
    using ElementOutput = bf16;
    using ElementAccumulator = float;
    using ElementCompute = float;
    using ElementD = bf16;
    static constexpr int kCount = 2;
    struct Params {};
  };
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = bf16;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using ElementD = bf16;
  using StrideD = StrideC;
  using ElementOutput = bf16;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using Arguments = P;
  using Params = P;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  CUTLASS_DEVICE bool is_source_needed() { return false; }
};

/// A warp group's 128 x 192 bf16 output tile staged in shared memory for TMA stores (the window
/// form's E, the log-probabilities' dlogits): three boxes of 128 rows x 64 columns, each row's
/// 16-byte pieces swizzled as the TMA's 128-byte swizzle expects (piece k of row r at k ^ (r % 8);
/// the stage 1024-byte aligned), so that a warp's pair stores (8 rows x 4 adjacent words) fall in
/// 32 different banks. The ping-pong kernel runs its two warp groups' epilogues one after the
/// other (its order barrier), so one stage serves both.
struct TileStage {
  static constexpr int kBoxCols = 64, kBoxRows = 128, kBoxBytes = kBoxCols * kBoxRows * 2;
  static constexpr int kTileCols = 192, kBytes = kTileCols / kBoxCols * kBoxBytes;

  /// The byte of tile row rl, tile column lc.
  CUTLASS_HOST_DEVICE static int at(int rl, int lc) {
    const int box = lc / kBoxCols, byte = (lc % kBoxCols) * 2;
    return box * kBoxBytes + rl * (kBoxCols * 2) + ((((byte >> 4) ^ (rl & 7)) << 4) | (byte & 15));
  }
  /// A row's bytes plus a lane's 2 lane_col (lane_col < 8, the lane's first column of each piece).
  CUTLASS_DEVICE static char* row(char* smem, int rl, int lane_col) { return smem + rl * (kBoxCols * 2) + 2 * lane_col; }
  /// A lane's pair of a row (at's byte from per-row and constant parts): `row` from row(), sw =
  /// (rl % 8) 16, off (a multiple of 8) the pair's column past lane_col. Callers pass columns as
  /// constants past lane_col: columns formed per entry are the same for every row, and ptxas
  /// would keep them all live across the rows, spilling.
  CUTLASS_DEVICE static uint32_t* pair(char* row, int sw, int off) {
    return reinterpret_cast<uint32_t*>(row + (off / kBoxCols) * kBoxBytes + ((((off % kBoxCols) / 8) << 4) ^ sw));
  }

  /// The TMA map of a rows x cols bf16 matrix at row stride ld (elements) in the stage's boxes,
  /// as wide as the columns rounded down to 8 (a TMA store over a row's end by less than 16 bytes
  /// writes the whole 16-byte piece, past the row's end: store() writes the rest); false where the
  /// TMA cannot address it (a base not 16-byte aligned, a row stride not a multiple of 16 bytes,
  /// fewer than 8 columns).
  static bool map(void* base, int64_t rows, int64_t cols, int64_t ld, cute::TmaDescriptor* out) {
    if (reinterpret_cast<uintptr_t>(base) % 16 || ld % 8 || ld >= (int64_t(1) << 36) || cols < 8 || rows < 1) {
      return false;
    }
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols & ~int64_t(7)), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
    const cuuint32_t box[2] = {kBoxCols, kBoxRows};
    const cuuint32_t step[2] = {1, 1};
    return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
               out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
           CUDA_SUCCESS;
  }

  /// The staged tile out to the matrix `out` (rows M, columns N, row stride ld) at (row0, col0):
  /// after every thread's stores into the stage (made visible to the TMA unit by each thread's
  /// proxy fence, then a barrier of the warp group), one thread stores the boxes that hold columns
  /// below N8 = N rounded down to 8 (the map's width) and waits until the TMA has read them,
  /// before the warp group leaves its epilogue: the other warp group's epilogue, the stage's next
  /// user, starts only when every thread of this one has left it (the kernel's order barrier).
  /// The columns [N8, N), where this tile holds them, go out from the stage by one thread a row.
  /// `map` points at the kernel's parameter (a grid constant), where the TMA reads it.
  CUTLASS_DEVICE static void store(const cute::TmaDescriptor* map, char* smem, int row0, int col0, int M, int N,
                                   int thread_idx, cutlass::bfloat16_t* out, int64_t ld) {
    const int n8 = N & ~7;
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup,
                                      cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    if (thread_idx == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kTileCols / kBoxCols; ++b) {
        if (col0 + b * kBoxCols < n8) {
          cute::SM90_TMA_STORE_2D::copy(map, smem + b * kBoxBytes, col0 + b * kBoxCols, row0);
        }
      }
      cute::tma_store_arrive();
    }
    if (n8 < N && col0 + kTileCols > n8 && thread_idx < kBoxRows && row0 + thread_idx < M) {
      cutlass::bfloat16_t* dst = out + int64_t(row0 + thread_idx) * ld;
      for (int col = n8 > col0 ? n8 : col0; col < N; ++col) {
        dst[col] = *reinterpret_cast<const cutlass::bfloat16_t*>(smem + at(thread_idx, col - col0));
      }
    }
    if (thread_idx == 0) cute::tma_store_wait<0>();
  }
};

/// One product: kUnsupported (nothing launched) where CUTLASS cannot run it or it would need a
/// workspace; a launch failure is a device error naming `what`.
template <class Gemm>
Status run(const typename Gemm::Arguments& args, cudaStream_t stream, const char* what) {
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
    os << what << " failed: " << cutlassGetStatusString(s) << " (" << cudaGetErrorString(e) << ")";
    return Status(StatusCode::kDeviceError, os.str());
  }
  return Status::Ok();
}

/// The products with a register epilogue (the window form's logits, the log-probabilities'):
/// rows (rows x H) . weight rows (cols x H)^T, both bf16 with H contiguous, float32
/// accumulation, on 128 x 192 ping-pong tiles (a warp group's 128 x 192 float32 accumulators: 192
/// registers a thread, which the ping-pong kernel's register split allows; one warp group's
/// epilogue runs while the other's main loop does) in clusters of two CTAs along M that share the
/// weight's tiles by multicast: the configuration that tied cuBLASLt's logits product at the
/// linear path's shapes (docs/performance.md, "The scaled-exp epilogue"). `EpiCore` derives from
/// RegisterEpilogueBase.
template <class EpiCore>
struct RowsProduct {
  using Tile = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Epi = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpiCore>;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
      cutlass::bfloat16_t, cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using GK = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
  using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;

  /// One launch at the persistent scheduler's tile order (raster, swizzle); `what` names it in
  /// an error.
  static Status run(int64_t rows, int64_t cols, int64_t H, const void* hidden, int64_t ld_hidden, const void* weight,
                    int64_t ld_weight, const typename EpiCore::Params& epi, RasterOrder raster, int swizzle,
                    int device, cudaStream_t stream, const char* what) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(H), 1},
                                  {static_cast<const cutlass::bfloat16_t*>(hidden),
                                   stride_with_ld<typename GK::StrideA>(ld_hidden),
                                   static_cast<const cutlass::bfloat16_t*>(weight),
                                   stride_with_ld<typename GK::StrideB>(ld_weight)},
                                  epi,
                                  hardware_of(device)};
    args.scheduler.raster_order = raster;
    args.scheduler.max_swizzle_size = swizzle;
    return cutlass_run::run<Gemm>(args, stream, what);
  }
};

}  // namespace cutlass_run
}  // namespace cuda
}  // namespace fusedce
