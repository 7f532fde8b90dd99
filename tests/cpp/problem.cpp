#include "problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "common/numeric.h"
#include "gtest/gtest.h"

namespace fusedce_test {

using fusedce::DType;
namespace nd = fusedce::detail;

size_t elem_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kBFloat16: return nd::bf16_to_float(nd::float_to_bf16(v));
    case DType::kFloat16: return nd::fp16_to_float(nd::float_to_fp16(v));
    default: return v;
  }
}

void store_value(void* base, DType dtype, int64_t index, float v) {
  if (dtype == DType::kFloat32) {
    std::memcpy(static_cast<char*>(base) + index * 4, &v, 4);
    return;
  }
  const uint16_t h = dtype == DType::kBFloat16 ? nd::float_to_bf16(v) : nd::float_to_fp16(v);
  std::memcpy(static_cast<char*>(base) + index * 2, &h, 2);
}

double load_value(const void* base, DType dtype, int64_t index) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, static_cast<const char*>(base) + index * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, static_cast<const char*>(base) + index * 2, 2);
  return dtype == DType::kBFloat16 ? nd::bf16_to_float(h) : nd::fp16_to_float(h);
}

void store_nan(void* base, DType dtype, int64_t index) { store_value(base, dtype, index, NAN); }

void store_values(void* base, DType dtype, int64_t index, const float* v, int64_t n) {
  if (dtype == DType::kFloat32) {
    std::memcpy(static_cast<char*>(base) + index * 4, v, n * 4);
    return;
  }
  std::vector<uint16_t> h(n);
  if (dtype == DType::kBFloat16) {
    for (int64_t k = 0; k < n; ++k) h[k] = nd::float_to_bf16(v[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) h[k] = nd::float_to_fp16(v[k]);
  }
  std::memcpy(static_cast<char*>(base) + index * 2, h.data(), n * 2);
}

void load_values(const void* base, DType dtype, int64_t index, double* out, int64_t n) {
  if (dtype == DType::kFloat32) {
    const char* p = static_cast<const char*>(base) + index * 4;
    for (int64_t k = 0; k < n; ++k) {
      float f;
      std::memcpy(&f, p + k * 4, 4);
      out[k] = f;
    }
    return;
  }
  const char* p = static_cast<const char*>(base) + index * 2;
  for (int64_t k = 0; k < n; ++k) {
    uint16_t h;
    std::memcpy(&h, p + k * 2, 2);
    out[k] = dtype == DType::kBFloat16 ? nd::bf16_to_float(h) : nd::fp16_to_float(h);
  }
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::mt19937_64 test_rng() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "no-test";
  if (info != nullptr) name = std::string(info->test_suite_name()) + "." + info->name();
  return std::mt19937_64(fnv1a(name));
}

int64_t Problem::num_ignored() const {
  return std::count(target.begin(), target.end(), ignore_index);
}

Problem make_problem(const GenSpec& s, std::mt19937_64& rng) {
  Problem p;
  p.dtype = s.dtype;
  p.rows = s.rows;
  p.vocab = s.vocab;
  p.row_stride = s.vocab + s.row_pad;
  p.offset = s.offset;
  p.target_dtype = s.target_dtype;
  p.target_stride = s.target_stride;
  p.ignore_index = s.ignore_index;
  p.weight_stride = s.weight_stride;

  const int64_t total = s.offset + s.rows * p.row_stride;
  p.logits.resize(static_cast<size_t>(total) * elem_size(s.dtype));
  // Padding and the part before the slice hold NaN: a kernel that reads them gives NaN losses.
  {
    const std::vector<float> nan(std::max<int64_t>(1, p.row_stride), NAN);
    for (int64_t k = 0; k < total; k += p.row_stride) {
      store_values(p.logits.data(), s.dtype, k, nan.data(), std::min(p.row_stride, total - k));
    }
  }

  std::uniform_int_distribution<int64_t> column(0, s.vocab - 1);
  std::uniform_int_distribution<int> grid(0, 63);
  const int64_t outliers = std::max<int64_t>(1, s.vocab / 1000);
  std::vector<std::vector<int64_t>> outlier_pos(s.rows);
  std::vector<float> row(s.vocab);
  for (int64_t i = 0; i < s.rows; ++i) {
    for (int64_t j = 0; j < s.vocab; ++j) {
      const uint64_t bits = rng();  // two 32-bit uniforms: their sum is triangular on [0, 2)
      const double u = static_cast<double>(bits >> 32) + static_cast<double>(bits & 0xffffffffu);
      row[j] = static_cast<float>(4.0 * (u * 0x1p-32 - 1.0));
    }
    for (int64_t k = 0; k < outliers; ++k) {
      const int64_t j = column(rng);
      row[j] = 8.0f + static_cast<float>(grid(rng)) / 16.0f;
      outlier_pos[i].push_back(j);
    }
    store_values(p.logits.data(), s.dtype, p.index(i, 0), row.data(), s.vocab);
  }

  // Exactly round(fraction * N) ignored rows, at random positions.
  const int64_t n_ignored = std::llround(s.ignore_fraction * static_cast<double>(s.rows));
  std::vector<int64_t> order(s.rows);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<bool> ignore(s.rows, false);
  for (int64_t k = 0; k < n_ignored; ++k) ignore[order[k]] = true;

  p.target.resize(s.rows);
  std::uniform_int_distribution<int> third(0, 2);
  for (int64_t i = 0; i < s.rows; ++i) {
    if (ignore[i]) {
      p.target[i] = s.ignore_index;
      continue;
    }
    int64_t t;
    do {
      if (third(rng) == 0) {
        std::uniform_int_distribution<size_t> pick(0, outlier_pos[i].size() - 1);
        t = outlier_pos[i][pick(rng)];
      } else {
        t = column(rng);
      }
    } while (t == s.ignore_index);  // a custom ignore_index inside [0, V) is kept for ignored rows
    p.target[i] = t;
  }

  if (s.class_weight) {
    std::uniform_real_distribution<float> weight(0.25f, 2.0f);
    p.class_weight.resize(s.vocab);
    for (auto& w : p.class_weight) w = weight(rng);
  }
  return p;
}

void set_ignored_rows(Problem& p, const std::vector<int64_t>& rows) {
  for (int64_t i = 0; i < p.rows; ++i) {
    if (p.target[i] == p.ignore_index) p.target[i] = (7 * i + 1) % p.vocab;
  }
  for (int64_t i : rows) p.target[i] = p.ignore_index;
}

}  // namespace fusedce_test
