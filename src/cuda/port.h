// The one place where the GPU backend's sources differ between CUDA (nvcc, NVIDIA GPUs) and HIP
// (clang / hipcc, AMD GPUs). The kernels and the launcher are written once, in CUDA spelling where
// both platforms agree, and call what is defined here where they do not:
//   - runtime API names (HIP: macros to the hip* names; clusters and cudaLaunchKernelEx have no
//     HIP counterpart and stay behind FUSEDCE_PLATFORM_HIP in the launcher);
//   - the warp (wavefront) size, kWarpSize, which every warp-level reduction is written against,
//     and warp shuffles (full-warp masks on CUDA; HIP's shuffles take none);
//   - 16-bit float types (BFloat16, Half, and their pairs) and the conversions and packed max the
//     kernels use (ROCm 5.2 has hip_bfloat16 but no bfloat16 pair arithmetic);
//   - U32x4, the 16-byte word of a segment, with streaming loads and stores of it;
//   - the approximate 2^x and 1/x (one hardware instruction each);
//   - kHopperFeatures: whether thread-block clusters and the streaming kernel (sm_90 bulk copies,
//     mbarriers, inline PTX) exist at all. On HIP they are compiled out and never picked.
// On CUDA every definition below is the CUDA spelling itself, so nvcc emits the same code as
// before this header existed.
#pragma once

#if defined(__HIP__)
#define FUSEDCE_PLATFORM_HIP 1
#else
#define FUSEDCE_PLATFORM_HIP 0
#endif

#if FUSEDCE_PLATFORM_HIP

#include <hip/hip_bfloat16.h>
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>

// Runtime API: the CUDA names the launcher uses, as their HIP equivalents.
#define cudaDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDevAttrL2CacheSize hipDeviceAttributeL2CacheSize
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaError_t hipError_t
#define cudaErrorNotSupported hipErrorNotSupported
#define cudaFreeAsync hipFreeAsync
#define cudaFuncAttribute hipFuncAttribute
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaFuncSetAttribute(kernel, attr, value) \
  hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value)
#define cudaGetDevice hipGetDevice
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaMallocAsync hipMallocAsync
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemsetAsync hipMemsetAsync
#define cudaSetDevice hipSetDevice
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStream_t hipStream_t
#define cudaSuccess hipSuccess

#else  // CUDA

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#endif

namespace fusedce {
namespace cuda {

#if FUSEDCE_PLATFORM_HIP

/// Lanes of a warp (an AMD wavefront): 64 on CDNA (gfx90a, gfx942). clang defines the value for
/// the host pass too, so host launch planning and device reductions agree; the architectures of
/// one build must share it.
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
/// No thread-block clusters, no streaming (bulk-copy) kernel: those are sm_90 features.
constexpr bool kHopperFeatures = false;

using BFloat16 = hip_bfloat16;
using Half = __half;
using Half2 = __half2;
/// Two bfloat16 values, low element first (the layout of CUDA's __nv_bfloat162).
struct alignas(4) BFloat162 {
  BFloat16 x, y;
};

__device__ __forceinline__ float to_float(BFloat16 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(Half x) { return __half2float(x); }
__device__ __forceinline__ BFloat16 bf16_from_float(float x) { return BFloat16::round_to_bfloat16(x); }
__device__ __forceinline__ Half half_from_float(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float low_float(BFloat162 x) { return to_float(x.x); }
__device__ __forceinline__ float high_float(BFloat162 x) { return to_float(x.y); }
__device__ __forceinline__ float low_float(Half2 x) { return __low2float(x); }
__device__ __forceinline__ float high_float(Half2 x) { return __high2float(x); }
__device__ __forceinline__ float2 to_float2(BFloat162 x) { return make_float2(to_float(x.x), to_float(x.y)); }
__device__ __forceinline__ float2 to_float2(Half2 x) { return __half22float2(x); }
__device__ __forceinline__ BFloat162 bf162_from_floats(float a, float b) {
  return BFloat162{bf16_from_float(a), bf16_from_float(b)};
}
__device__ __forceinline__ Half2 half2_from_floats(float a, float b) { return __floats2half2_rn(a, b); }

/// Elementwise max of two pairs, NaN ignored (as fmaxf). The max of two 16-bit values is one of
/// them, so going through float is exact.
__device__ __forceinline__ BFloat162 max2(BFloat162 a, BFloat162 b) {
  return bf162_from_floats(fmaxf(low_float(a), low_float(b)), fmaxf(high_float(a), high_float(b)));
}
__device__ __forceinline__ Half2 max2(Half2 a, Half2 b) {
  return __floats2half2_rn(fmaxf(__low2float(a), __low2float(b)), fmaxf(__high2float(a), __high2float(b)));
}

/// Lane (lane + delta)'s value; lanes past the end of the warp get their own.
template <typename V>
__device__ __forceinline__ V shfl_down(V v, int delta) {
  return __shfl_down(v, static_cast<unsigned>(delta));
}
/// Lane (lane ^ mask)'s value (a butterfly: every lane ends with the warp's result).
template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int mask) {
  return __shfl_xor(v, mask);
}
/// Lane src's value, to every lane.
template <typename V>
__device__ __forceinline__ V shfl_idx(V v, int src) {
  return __shfl(v, src);
}

/// 16 bytes as four 32-bit words: a plain struct (HIP's uint4 has a user-defined assignment, which
/// a union member cannot have; a clang vector in the segment union costs scratch memory).
struct alignas(16) U32x4 {
  unsigned int x, y, z, w;
};
__device__ __forceinline__ U32x4 u32x4_zero() { return U32x4{0u, 0u, 0u, 0u}; }

typedef unsigned int NativeU32x4 __attribute__((ext_vector_type(4)));  // what the builtins move

/// A 16-byte load of data read once (non-temporal: kept out of the caches where the ISA allows).
__device__ __forceinline__ U32x4 load_streaming(const U32x4* ptr) {
  const NativeU32x4 v = __builtin_nontemporal_load(reinterpret_cast<const NativeU32x4*>(ptr));
  return U32x4{v.x, v.y, v.z, v.w};
}
/// A 16-byte store of data not read again soon (non-temporal).
__device__ __forceinline__ void store_streaming(U32x4* ptr, U32x4 v) {
  const NativeU32x4 w = {v.x, v.y, v.z, v.w};
  __builtin_nontemporal_store(w, reinterpret_cast<NativeU32x4*>(ptr));
}

/// 2^x in one hardware instruction (v_exp_f32); -inf gives 0, NaN stays NaN.
__device__ __forceinline__ float ex2(float x) {
#if __has_builtin(__builtin_amdgcn_exp2f)
  return __builtin_amdgcn_exp2f(x);
#else
  return __builtin_exp2f(x);  // LLVM < 17 lowers this to a bare v_exp_f32
#endif
}

/// 2^x with subnormal results kept (below 2^-126: the log-probabilities' sums of the entries
/// but the max, which carry a collapsed row's log-probability).
__device__ __forceinline__ float ex2_subnormal(float x) { return exp2f(x); }

/// 1/x in one hardware instruction (v_rcp_f32).
__device__ __forceinline__ float rcp(float x) { return __builtin_amdgcn_rcpf(x); }

#else  // CUDA

constexpr int kWarpSize = 32;
/// Thread-block clusters and the streaming kernel exist; the launcher uses them on sm_90 devices.
constexpr bool kHopperFeatures = true;

using BFloat16 = __nv_bfloat16;
using BFloat162 = __nv_bfloat162;
using Half = __half;
using Half2 = __half2;

__device__ __forceinline__ float to_float(BFloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(Half x) { return __half2float(x); }
__device__ __forceinline__ BFloat16 bf16_from_float(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ Half half_from_float(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float low_float(BFloat162 x) { return __low2float(x); }
__device__ __forceinline__ float high_float(BFloat162 x) { return __high2float(x); }
__device__ __forceinline__ float low_float(Half2 x) { return __low2float(x); }
__device__ __forceinline__ float high_float(Half2 x) { return __high2float(x); }
__device__ __forceinline__ float2 to_float2(BFloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_float2(Half2 x) { return __half22float2(x); }
__device__ __forceinline__ BFloat162 bf162_from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ Half2 half2_from_floats(float a, float b) { return __floats2half2_rn(a, b); }

/// Elementwise max of two pairs, NaN ignored (as fmaxf): one packed instruction.
__device__ __forceinline__ BFloat162 max2(BFloat162 a, BFloat162 b) { return __hmax2(a, b); }
__device__ __forceinline__ Half2 max2(Half2 a, Half2 b) { return __hmax2(a, b); }

/// Lane (lane + delta)'s value; lanes past the end of the warp get their own. Every lane of the
/// warp takes part.
template <typename V>
__device__ __forceinline__ V shfl_down(V v, int delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
/// Lane (lane ^ mask)'s value (a butterfly: every lane ends with the warp's result).
template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
/// Lane src's value, to every lane.
template <typename V>
__device__ __forceinline__ V shfl_idx(V v, int src) {
  return __shfl_sync(0xffffffffu, v, src);
}

/// 16 bytes as four 32-bit words.
using U32x4 = uint4;
__device__ __forceinline__ U32x4 u32x4_zero() { return make_uint4(0, 0, 0, 0); }

/// A 16-byte load of data read once: the read-only path, no L1 allocation.
__device__ __forceinline__ U32x4 load_streaming(const U32x4* ptr) {
  U32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}
/// A 16-byte store of data not read again soon (evict-first).
__device__ __forceinline__ void store_streaming(U32x4* ptr, U32x4 v) { __stcs(ptr, v); }

/// 2^x on the SFU (one MUFU.EX2); -inf gives 0, NaN stays NaN, results below 2^-126 flush to 0
/// (they vanish next to the row's max term anyway).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// 2^x on the SFU with subnormal results kept (below 2^-126 the input is halved and the result
/// squared: two predicated multiplies): the log-probabilities' sums of the entries but the max,
/// which carry a collapsed row's log-probability.
__device__ __forceinline__ float ex2_subnormal(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// 1/x on the SFU (one MUFU.RCP).
__device__ __forceinline__ float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#endif

}  // namespace cuda
}  // namespace fusedce
