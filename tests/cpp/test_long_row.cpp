// One row of V = 2^24 ... 2^30 logits: the loss and lse must stay within float32's rounding of
// the float64 value whatever V is. A row is folded from thousands of partial sums (chunks on the
// CPU, a split's chunks per thread on the GPU); folded in float32, their rounding compounds with
// V (a relative 5e-6 at 2^28 on an ascending row, whose max moves at every chunk, and 2e-6 at
// 2^24), ten to a hundred times the bound below.
//
// Rows: an ascending ramp over [-4, 4) (the max moves at every chunk: the rescale of the
// running sum is taken thousands of times), and uniform random values on [-4, 4). The float64
// reference is computed in one streaming pass over the same generator (no copy of the row).
//
// Memory: the row on the backend (1 GiB for 2^28 float32, 2 GiB for 2^30 bfloat16) plus a
// 16 MiB staging slice. Time on two CPU cores: about 20 s for the whole suite.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "fixture.h"
#include "harness.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

enum class Pattern { kRamp, kRandom };

struct LongRowCase {
  BackendKind backend;
  int log2_vocab;
  DType dtype;
  Pattern pattern;
};

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Logit j of the row, as the kernel sees it (rounded to the dtype).
float logit(const LongRowCase& c, int64_t j) {
  const int64_t V = int64_t(1) << c.log2_vocab;
  float x;
  if (c.pattern == Pattern::kRamp) {
    x = static_cast<float>(-4.0 + 8.0 * static_cast<double>(j) / static_cast<double>(V));
  } else {
    x = static_cast<float>(static_cast<double>(mix64(static_cast<uint64_t>(j)) >> 11) * 0x1p-53 * 8.0 - 4.0);
  }
  if (c.dtype == DType::kBFloat16) x = fusedce::detail::bf16_to_float(fusedce::detail::float_to_bf16(x));
  return x;
}

class LongRow : public BackendTest<LongRowCase> {};

TEST_P(LongRow, LossWithinFloat32Rounding) {
  const LongRowCase c = GetParam();
  Backend& b = backend();
  const int64_t V = int64_t(1) << c.log2_vocab;
  const size_t el = c.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t target = V / 3 + 17;

  DeviceBuffer logits(b, static_cast<size_t>(V) * el);
  {
    constexpr int64_t kSlice = int64_t(1) << 22;
    std::vector<uint8_t> host(static_cast<size_t>(kSlice) * el);
    for (int64_t j0 = 0; j0 < V; j0 += kSlice) {
      const int64_t n = std::min(kSlice, V - j0);
      for (int64_t k = 0; k < n; ++k) {
        const float x = logit(c, j0 + k);
        if (c.dtype == DType::kFloat32) {
          std::memcpy(&host[k * 4], &x, 4);
        } else {
          const uint16_t h = fusedce::detail::float_to_bf16(x);
          std::memcpy(&host[k * 2], &h, 2);
        }
      }
      logits.upload(host.data(), static_cast<size_t>(n) * el, static_cast<size_t>(j0) * el);
    }
  }
  const std::vector<int64_t> tgt_host{target};
  DeviceBuffer tgt = DeviceBuffer::from_vector(b, tgt_host);
  DeviceBuffer loss(b, 4), lse(b, 4), correct(b, 8), entropy(b, 4);

  fusedce::Options o;
  o.reduction = fusedce::Reduction::kNone;
  o.return_metrics = true;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(loss.data(), DType::kFloat32, 1);
  out.lse = fusedce::vector(lse.data(), DType::kFloat32, 1);
  out.num_correct = fusedce::vector(correct.data(), DType::kInt64, 1);
  out.entropy_sum = fusedce::vector(entropy.data(), DType::kFloat32, 1);
  const size_t ws_bytes = fusedce::cross_entropy_workspace_size(fusedce::Job::kForward, b.device(), 1, V, o);
  DeviceBuffer ws(b, ws_bytes);
  const fusedce::Status s = fusedce::cross_entropy_forward(
      b.device(), fusedce::matrix(logits.data(), c.dtype, 1, V), fusedce::vector(tgt.data(), DType::kInt64, 1), o,
      out, fusedce::Workspace{ws_bytes > 0 ? ws.data() : nullptr, ws_bytes});
  b.synchronize();
  ASSERT_TRUE(s.ok()) << s.message();
  float got_loss = 0.0f, got_lse = 0.0f, got_entropy = 0.0f;
  loss.download(&got_loss, 4);
  lse.download(&got_lse, 4);
  entropy.download(&got_entropy, 4);

  // float64 reference in one pass: online max and sum of exps, and the entropy's E[z].
  double m = -INFINITY, sum = 0.0, ez = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    const double x = logit(c, j);
    if (x > m) {
      const double f = std::exp(m - x);
      sum *= f;
      ez *= f;
      m = x;
    }
    const double e = std::exp(x - m);
    sum += e;
    ez += e * x;
  }
  const double ref_lse = m + std::log(sum);
  const double ref_loss = ref_lse - static_cast<double>(logit(c, target));
  const double ref_entropy = ref_lse - ez / sum;

  // float32 level: a few roundings of the quantities the loss is formed from (lse and the
  // target logit), whatever V is.
  const double eps = std::ldexp(1.0, -24);
  const double bound = 8.0 * eps * (std::fabs(ref_lse) + std::fabs(ref_loss));
  EXPECT_LE(std::fabs(got_lse - ref_lse), bound) << "lse " << got_lse << " vs " << ref_lse;
  EXPECT_LE(std::fabs(got_loss - ref_loss), bound) << "loss " << got_loss << " vs " << ref_loss << " (relative error "
                                                   << std::fabs(got_loss - ref_loss) / ref_loss << ")";
  EXPECT_LE(std::fabs(got_entropy - ref_entropy), bound) << "entropy " << got_entropy << " vs " << ref_entropy;
  RecordProperty("relative_loss_error", std::to_string(std::fabs(got_loss - ref_loss) / ref_loss));
}

std::vector<LongRowCase> long_row_cases() {
  std::vector<LongRowCase> v;
  for (BackendKind k : all_backends()) {
    for (int lg : {24, 26, 28}) v.push_back({k, lg, DType::kFloat32, Pattern::kRamp});
    v.push_back({k, 28, DType::kFloat32, Pattern::kRandom});
    v.push_back({k, 30, DType::kBFloat16, Pattern::kRamp});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Fold, LongRow, ::testing::ValuesIn(long_row_cases()),
                         [](const ::testing::TestParamInfo<LongRowCase>& info) {
                           const LongRowCase& c = info.param;
                           return std::string(backend_name(c.backend)) + "_V2e" + std::to_string(c.log2_vocab) + "_" +
                                  (c.dtype == DType::kFloat32 ? "f32" : "bf16") + "_" +
                                  (c.pattern == Pattern::kRamp ? "ramp" : "random");
                         });

}  // namespace
}  // namespace fusedce_test
