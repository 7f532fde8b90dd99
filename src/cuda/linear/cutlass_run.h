// What every CUTLASS GemmUniversal of the library shares (cutlass_products.cu, window_forward.cu,
// logprobs/lp_fused_products.cu; all compiled for sm_90a alone): the hardware description, the
// leading-dimension strides, one checked launch without a workspace, and the frame of a register
// epilogue. Include only from those CUTLASS translation units.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"
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

}  // namespace cutlass_run
}  // namespace cuda
}  // namespace fusedce
