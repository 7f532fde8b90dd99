// 16-byte vector access to rows of float32 / bfloat16 / float16 at any element alignment.
//
// A row is cut into 16-byte segments aligned in memory: segment s holds elements
// [s * kVec - off, s * kVec - off + kVec) of the row, where off is how many elements the row's
// start lies past a 16-byte boundary. Full segments move with one vector instruction; the (at
// most two) partial ones at the row's ends move element by element, so no byte outside the row
// is touched, whatever V and the row stride are.
#pragma once

#include <cstdint>

#include "cuda/port.h"
#include "cuda/sizes.h"

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
struct Elem<BFloat16> {
  static __device__ __forceinline__ float to_float(BFloat16 x) { return cuda::to_float(x); }
  static __device__ __forceinline__ BFloat16 from_float(float x) { return bf16_from_float(x); }
};
template <>
struct Elem<Half> {
  static __device__ __forceinline__ float to_float(Half x) { return cuda::to_float(x); }
  static __device__ __forceinline__ Half from_float(float x) { return half_from_float(x); }
};

template <typename T>
struct Segment {
  static constexpr int kVec = 16 / sizeof(T);
  union {
    U32x4 raw;
    T e[kVec];
  };
};

/// Largest element of a segment (NaN ignored, as fmaxf), as float. 16-bit types compare packed
/// pairs (one max per two elements) and convert once.
__device__ __forceinline__ float seg_max(const Segment<float>& s) {
  return fmaxf(fmaxf(s.e[0], s.e[1]), fmaxf(s.e[2], s.e[3]));
}
__device__ __forceinline__ float seg_max(const Segment<BFloat16>& s) {
  const BFloat162* h = reinterpret_cast<const BFloat162*>(&s.raw);
  const BFloat162 m = max2(max2(h[0], h[1]), max2(h[2], h[3]));
  return fmaxf(low_float(m), high_float(m));
}
__device__ __forceinline__ float seg_max(const Segment<Half>& s) {
  const Half2* h = reinterpret_cast<const Half2*>(&s.raw);
  const Half2 m = max2(max2(h[0], h[1]), max2(h[2], h[3]));
  return fmaxf(low_float(m), high_float(m));
}

/// Elements 2i and 2i+1 of a segment as floats.
__device__ __forceinline__ float2 seg_pair(const Segment<float>& s, int i) { return make_float2(s.e[2 * i], s.e[2 * i + 1]); }
__device__ __forceinline__ float2 seg_pair(const Segment<BFloat16>& s, int i) {
  // bfloat16 is the top half of a float: one shift or one mask per element (the library
  // conversion spent a PRMT and a shift on the high half).
  const uint32_t w = i == 0 ? s.raw.x : i == 1 ? s.raw.y : i == 2 ? s.raw.z : s.raw.w;
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 seg_pair(const Segment<Half>& s, int i) {
  return to_float2(reinterpret_cast<const Half2*>(&s.raw)[i]);
}

/// Sets elements 2i and 2i+1 (rounded to nearest even; one conversion per pair for 16-bit types).
__device__ __forceinline__ void set_pair(Segment<float>& s, int i, float a, float b) {
  s.e[2 * i] = a;
  s.e[2 * i + 1] = b;
}
__device__ __forceinline__ void set_pair(Segment<BFloat16>& s, int i, float a, float b) {
  reinterpret_cast<BFloat162*>(&s.raw)[i] = bf162_from_floats(a, b);
}
__device__ __forceinline__ void set_pair(Segment<Half>& s, int i, float a, float b) {
  reinterpret_cast<Half2*>(&s.raw)[i] = half2_from_floats(a, b);
}

/// Elements the row start lies past its 16-byte boundary.
template <typename T>
__device__ __forceinline__ int row_offset(const T* row) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(row) / sizeof(T)) % Segment<T>::kVec);
}

/// Load segment s of a row (elements outside [0, V) are set to `fill`).
template <typename T>
__device__ __forceinline__ Segment<T> load_segment(const T* row, int64_t s, int off, int64_t V, T fill) {
  constexpr int kVec = Segment<T>::kVec;
  Segment<T> seg;
  const int64_t j0 = s * kVec - off;
  if (j0 >= 0 && j0 + kVec <= V) {
    // Streaming load: each logit is read once. (In place, the gradient store to these bytes comes
    // later from the same thread, after every read of them.)
    seg.raw = load_streaming(reinterpret_cast<const U32x4*>(row + j0));
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
    store_streaming(reinterpret_cast<U32x4*>(row + j0), seg.raw);
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
