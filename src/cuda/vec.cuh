// 16-byte vector access to rows of float32 / bfloat16 / float16 at any element alignment.
//
// A row is cut into 16-byte segments aligned in memory: segment s holds elements
// [s * kVec - off, s * kVec - off + kVec) of the row, where off is how many elements the row's
// start lies past a 16-byte boundary. Full segments move with one vector instruction; the (at
// most two) partial ones at the row's ends move element by element, so no byte outside the row
// is touched, whatever V and the row stride are.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fusedce {
namespace cuda {

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <typename T>
struct Segment {
  static constexpr int kVec = 16 / sizeof(T);
  union {
    uint4 raw;
    T e[kVec];
  };
};

/// Largest element of a segment (NaN ignored, as fmaxf), as float. 16-bit types compare packed
/// pairs (one max per two elements) and convert once.
__device__ __forceinline__ float seg_max(const Segment<float>& s) {
  return fmaxf(fmaxf(s.e[0], s.e[1]), fmaxf(s.e[2], s.e[3]));
}
__device__ __forceinline__ float seg_max(const Segment<__nv_bfloat16>& s) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&s.raw);
  const __nv_bfloat162 m = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));
  return fmaxf(__low2float(m), __high2float(m));
}
__device__ __forceinline__ float seg_max(const Segment<__half>& s) {
  const __half2* h = reinterpret_cast<const __half2*>(&s.raw);
  const __half2 m = __hmax2(__hmax2(h[0], h[1]), __hmax2(h[2], h[3]));
  return fmaxf(__low2float(m), __high2float(m));
}

/// Elements 2i and 2i+1 of a segment as floats.
__device__ __forceinline__ float2 seg_pair(const Segment<float>& s, int i) { return make_float2(s.e[2 * i], s.e[2 * i + 1]); }
__device__ __forceinline__ float2 seg_pair(const Segment<__nv_bfloat16>& s, int i) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&s.raw)[i]);
}
__device__ __forceinline__ float2 seg_pair(const Segment<__half>& s, int i) {
  return __half22float2(reinterpret_cast<const __half2*>(&s.raw)[i]);
}

/// Sets elements 2i and 2i+1 (rounded to nearest even; one conversion per pair for 16-bit types).
__device__ __forceinline__ void set_pair(Segment<float>& s, int i, float a, float b) {
  s.e[2 * i] = a;
  s.e[2 * i + 1] = b;
}
__device__ __forceinline__ void set_pair(Segment<__nv_bfloat16>& s, int i, float a, float b) {
  reinterpret_cast<__nv_bfloat162*>(&s.raw)[i] = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void set_pair(Segment<__half>& s, int i, float a, float b) {
  reinterpret_cast<__half2*>(&s.raw)[i] = __floats2half2_rn(a, b);
}

/// Elements the row start lies past its 16-byte boundary.
template <typename T>
__device__ __forceinline__ int row_offset(const T* row) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(row) / sizeof(T)) % Segment<T>::kVec);
}

/// Segments covering a row of V elements starting `off` elements past a boundary.
__host__ __device__ __forceinline__ int64_t row_segments(int64_t V, int off, int vec) {
  return (V + off + vec - 1) / vec;
}

/// Load segment s of a row (elements outside [0, V) are set to `fill`).
template <typename T>
__device__ __forceinline__ Segment<T> load_segment(const T* row, int64_t s, int off, int64_t V, T fill) {
  constexpr int kVec = Segment<T>::kVec;
  Segment<T> seg;
  const int64_t j0 = s * kVec - off;
  if (j0 >= 0 && j0 + kVec <= V) {
    // Read-only path, no L1 allocation: each logit is read once. (In place, the gradient store
    // to these bytes comes later from the same thread, after every read of them.)
    const uint4* ptr = reinterpret_cast<const uint4*>(row + j0);
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(seg.raw.x), "=r"(seg.raw.y), "=r"(seg.raw.z), "=r"(seg.raw.w)
                 : "l"(ptr));
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int64_t j = j0 + e;
      seg.e[e] = (j >= 0 && j < V) ? row[j] : fill;
    }
  }
  return seg;
}

/// Store segment s of a row (elements outside [0, V) are not written).
template <typename T>
__device__ __forceinline__ void store_segment(T* row, int64_t s, int off, int64_t V, const Segment<T>& seg) {
  constexpr int kVec = Segment<T>::kVec;
  const int64_t j0 = s * kVec - off;
  if (j0 >= 0 && j0 + kVec <= V) {
    __stcs(reinterpret_cast<uint4*>(row + j0), seg.raw);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int64_t j = j0 + e;
      if (j >= 0 && j < V) row[j] = seg.e[e];
    }
  }
}

}  // namespace cuda
}  // namespace fusedce
