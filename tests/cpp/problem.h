// Test inputs: logits in any of the three float dtypes laid out as a (possibly strided, possibly
// offset) slice of a wider host buffer, targets with a chosen dtype and stride, class weights,
// and the seeded generator that fills them (outliers so softmax is not flat, a fixed share of
// ignored rows).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "fusedce/types.h"

namespace fusedce_test {

/// Element size of a logits dtype.
size_t elem_size(fusedce::DType dtype);
/// `v` rounded to `dtype` (float32: unchanged), as float.
float round_to(fusedce::DType dtype, float v);
/// Writes `v` (rounded to the dtype) as element `index` of a raw buffer.
void store_value(void* base, fusedce::DType dtype, int64_t index, float v);
/// Reads element `index` of a raw buffer of float32 / bfloat16 / float16 as double.
double load_value(const void* base, fusedce::DType dtype, int64_t index);
/// A quiet NaN of the dtype, stored at `index`.
void store_nan(void* base, fusedce::DType dtype, int64_t index);
/// n consecutive elements from `index` on, converted (rounded) / widened in one loop.
void store_values(void* base, fusedce::DType dtype, int64_t index, const float* v, int64_t n);
void load_values(const void* base, fusedce::DType dtype, int64_t index, double* out, int64_t n);

/// A seeded generator for the running test: the seed is a hash of the test's full name, so each
/// test gets its own inputs and a failure reproduces exactly.
std::mt19937_64 test_rng();
/// The FNV-1a hash the seed is made from (stable across compilers, unlike std::hash).
uint64_t fnv1a(const std::string& s);

struct Problem {
  fusedce::DType dtype = fusedce::DType::kFloat32;
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t row_stride = 0;  ///< elements between row starts in `logits`
  int64_t offset = 0;      ///< elements before row 0 (a slice starting mid-row of a wider buffer)
  std::vector<uint8_t> logits;  ///< the whole host buffer, padding included (padding is NaN)

  fusedce::DType target_dtype = fusedce::DType::kInt64;
  int64_t target_stride = 1;
  std::vector<int64_t> target;  ///< N logical values (ignored rows hold ignore_index)
  int64_t ignore_index = -100;

  std::vector<float> class_weight;  ///< (V,) or empty for none
  int64_t weight_stride = 1;

  int64_t index(int64_t i, int64_t j) const { return offset + i * row_stride + j; }
  double x(int64_t i, int64_t j) const { return load_value(logits.data(), dtype, index(i, j)); }
  void set(int64_t i, int64_t j, float v) { store_value(logits.data(), dtype, index(i, j), v); }
  /// Row i's V logits, widened to double.
  void load_row(int64_t i, double* out) const { load_values(logits.data(), dtype, index(i, 0), out, vocab); }
  bool ignored(int64_t i) const { return target[i] == ignore_index; }
  int64_t num_ignored() const;
};

struct GenSpec {
  fusedce::DType dtype = fusedce::DType::kFloat32;
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t row_pad = 0;  ///< row_stride = vocab + row_pad
  int64_t offset = 0;
  fusedce::DType target_dtype = fusedce::DType::kInt64;
  int64_t target_stride = 1;
  int64_t ignore_index = -100;
  /// Share of rows whose target is ignore_index: exactly round(fraction * rows) of them.
  double ignore_fraction = 0.3;
  bool class_weight = false;
  int64_t weight_stride = 1;
};

/// Logits: a bulk of triangular values on [-4, 4] (the sum of two uniforms: cheap to draw for
/// the 67M-element cases, and bell-shaped enough), plus max(1, V / 1000) outliers per row
/// at 8 + k / 16, k in [0, 64): far above the rest so softmax is peaked, and on a 1/16 grid that
/// every dtype holds exactly, so equal outliers are exact ties and distinct ones differ by far
/// more than rounding (argmax is then the same in float32 and float64). Targets: a third of the
/// non-ignored rows point at one of the row's outliers (small losses, correct predictions), the
/// rest are uniform over [0, V). Class weights: uniform in [0.25, 2].
Problem make_problem(const GenSpec& spec, std::mt19937_64& rng);

/// Makes exactly `rows` the ignored ones: their targets become ignore_index, and a row that was
/// ignored before gets the valid target (7 i + 1) mod V.
void set_ignored_rows(Problem& p, const std::vector<int64_t>& rows);

}  // namespace fusedce_test
