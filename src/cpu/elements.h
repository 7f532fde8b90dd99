// Single elements of a float32 / bfloat16 / float16 buffer, read and written as float32: the
// CPU paths' staging of matrices and vectors whose dtype is known only at run time (hidden rows,
// weight and bias copies, gradient outputs). Not for the row sweeps over logits, which convert
// whole chunks at once (kernels_impl.h).
#pragma once

#include <cstdint>

#include "common/numeric.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cpu {

/// Element i of base, whose elements have dtype d (float32, bfloat16 or float16), as float32.
inline float load_elem(const void* base, DType d, int64_t i) {
  switch (d) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return detail::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return detail::fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

/// Writes v into element i of base, rounded to nearest even for the 16-bit dtypes.
inline void store_elem(void* base, DType d, int64_t i, float v) {
  switch (d) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = detail::float_to_bf16(v); break;
    default: static_cast<uint16_t*>(base)[i] = detail::float_to_fp16(v); break;
  }
}

}  // namespace cpu
}  // namespace fusedce
