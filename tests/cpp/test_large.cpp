// N * V above 2^31 elements: 8193 rows of Gemma's 262144-class vocabulary in bfloat16, about
// 4.3 GB of logits; row 8192 starts exactly at element 2^31, so any 32-bit index arithmetic
// breaks there. Forward only, per-row losses and lse; every row's loss must be finite and
// positive (or 0 if ignored), num_correct is known exactly by construction, and a few rows,
// both ends and both sides of 2^31, are checked against the float64 reference.
//
// Memory: the logits buffer on the backend (4.3 GB) plus 64-row host staging slices while
// filling it; the reference reads single rows back. About 4.4 GB in all.
#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "common/numeric.h"
#include "fixture.h"
#include "harness.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

constexpr int64_t kRows = 8193;
constexpr int64_t kVocab = 262144;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int64_t row_argmax(int64_t i) { return (i * 7919 + 13) % kVocab; }

// Row i from a counter-based generator (any row can be made on its own, on any thread): bulk
// values on a 1/16 grid in [-4, 4), four per 64-bit draw; seven outliers at 8, 8.5, ..., 11 in
// random columns; one maximum of 12 at row_argmax(i), so the argmax of every row is known.
void fill_row(uint64_t seed, int64_t i, uint16_t* row) {
  static const std::vector<uint16_t> grid = [] {
    std::vector<uint16_t> g(128);
    for (int k = 0; k < 128; ++k) g[k] = fusedce::detail::float_to_bf16(static_cast<float>(k - 64) / 16.0f);
    return g;
  }();
  const uint64_t base = seed ^ (static_cast<uint64_t>(i) * kVocab);
  for (int64_t j = 0; j < kVocab; j += 4) {
    const uint64_t r = splitmix64(base + static_cast<uint64_t>(j));
    for (int k = 0; k < 4; ++k) row[j + k] = grid[(r >> (16 * k)) & 127];
  }
  for (int k = 0; k < 7; ++k) {
    const int64_t col = static_cast<int64_t>(splitmix64(~base + static_cast<uint64_t>(k)) % kVocab);
    row[col] = fusedce::detail::float_to_bf16(8.0f + 0.5f * static_cast<float>(k));
  }
  row[row_argmax(i)] = fusedce::detail::float_to_bf16(12.0f);
}

class LargeBatch : public BackendTest<BackendKind> {};

TEST_P(LargeBatch, MoreThan2To31LogitsForward) {
  Backend& b = backend();
  std::mt19937_64 rng = test_rng();
  const uint64_t seed = rng();
  ASSERT_GT(kRows * kVocab, int64_t(1) << 31);
  ASSERT_EQ((kRows - 1) * kVocab, int64_t(1) << 31) << "the last row starts at element 2^31";

  // Targets: 30% ignored, a third of the rest at the row's maximum, the others anywhere.
  std::vector<int64_t> target(kRows);
  int64_t expected_correct = 0;
  for (int64_t i = 0; i < kRows; ++i) {
    const uint64_t r = rng();
    if (r % 10 < 3 && i != 0 && i != 8191 && i != 8192) {
      target[i] = -100;
    } else if ((r >> 8) % 3 == 0) {
      target[i] = row_argmax(i);
      ++expected_correct;
    } else {
      target[i] = static_cast<int64_t>((r >> 16) % kVocab);
      expected_correct += target[i] == row_argmax(i);
    }
  }

  DeviceBuffer logits(b, static_cast<size_t>(kRows * kVocab) * 2);
  {
    // Filled in slices of 64 rows on two threads; each slice is generated on the host and copied.
    constexpr int64_t kSlice = 64;
    const int64_t slices = (kRows + kSlice - 1) / kSlice;
    auto fill = [&](int64_t first_slice, int64_t step) {
      std::vector<uint16_t> host(kSlice * kVocab);
      for (int64_t s = first_slice; s < slices; s += step) {
        const int64_t r0 = s * kSlice, r1 = std::min(kRows, r0 + kSlice);
        for (int64_t i = r0; i < r1; ++i) fill_row(seed, i, &host[(i - r0) * kVocab]);
        logits.upload(host.data(), static_cast<size_t>((r1 - r0) * kVocab) * 2, static_cast<size_t>(r0 * kVocab) * 2);
      }
    };
    std::thread helper(fill, 1, 2);
    fill(0, 2);
    helper.join();
  }
  DeviceBuffer tgt = DeviceBuffer::from_vector(b, target);
  DeviceBuffer loss(b, kRows * 4), lse(b, kRows * 4), correct(b, 8), entropy(b, 4);

  fusedce::Options o;
  o.reduction = fusedce::Reduction::kNone;
  o.return_metrics = true;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(loss.data(), DType::kFloat32, kRows);
  out.lse = fusedce::vector(lse.data(), DType::kFloat32, kRows);
  out.num_correct = fusedce::vector(correct.data(), DType::kInt64, 1);
  out.entropy_sum = fusedce::vector(entropy.data(), DType::kFloat32, 1);
  const size_t ws_bytes = fusedce::cross_entropy_workspace_size(fusedce::Job::kForward, b.device(), kRows, kVocab, o);
  DeviceBuffer ws(b, ws_bytes);
  const fusedce::Status s = fusedce::cross_entropy_forward(
      b.device(), fusedce::matrix(logits.data(), DType::kBFloat16, kRows, kVocab),
      fusedce::vector(tgt.data(), DType::kInt64, kRows), o, out,
      fusedce::Workspace{ws_bytes > 0 ? ws.data() : nullptr, ws_bytes});
  b.synchronize();
  ASSERT_TRUE(s.ok()) << s.message();

  const std::vector<float> got_loss = loss.to_host_as<float>();
  const std::vector<float> got_lse = lse.to_host_as<float>();
  int64_t got_correct = -1;
  correct.download(&got_correct, 8);
  EXPECT_EQ(got_correct, expected_correct);
  float got_entropy = 0.0f;
  entropy.download(&got_entropy, 4);
  EXPECT_TRUE(std::isfinite(got_entropy) && got_entropy > 0.0f) << got_entropy;

  int64_t bad_rows = 0;
  for (int64_t i = 0; i < kRows; ++i) {
    const bool ok = target[i] == -100 ? got_loss[i] == 0.0f && got_lse[i] == 0.0f
                                      : std::isfinite(got_loss[i]) && got_loss[i] >= 0.0f && got_lse[i] >= 12.0f;
    if (!ok && bad_rows++ < 5) {
      ADD_FAILURE() << "row " << i << " (target " << target[i] << "): loss " << got_loss[i] << ", lse " << got_lse[i];
    }
  }
  EXPECT_EQ(bad_rows, 0);

  // A few rows against the reference: both ends, and both sides of element 2^31.
  Problem row;
  row.dtype = DType::kBFloat16;
  row.rows = 1;
  row.vocab = kVocab;
  row.row_stride = kVocab;
  row.logits.resize(kVocab * 2);
  row.target.resize(1);
  const Tolerance tol = tolerance(DType::kBFloat16, Quantity::kLoss);
  for (int64_t i : {int64_t(0), int64_t(1), int64_t(4096), int64_t(8191), int64_t(8192)}) {
    SCOPED_TRACE("row " + std::to_string(i));
    logits.download(row.logits.data(), kVocab * 2, static_cast<size_t>(i * kVocab) * 2);
    row.target[0] = target[i];
    const Reference ref(row, o);
    if (row.ignored(0)) {
      EXPECT_EQ(got_loss[i], 0.0f);
      continue;
    }
    double bound = 0.0;
    EXPECT_TRUE(within(got_loss[i], ref.row(0).loss, ref.row(0).loss_scale, tol, &bound))
        << "loss " << got_loss[i] << " vs reference " << ref.row(0).loss << " (allowed " << bound << ")";
    EXPECT_TRUE(within(got_lse[i], ref.row(0).lse, std::fabs(ref.row(0).lse) + 1.0, tol, &bound))
        << "lse " << got_lse[i] << " vs reference " << ref.row(0).lse << " (allowed " << bound << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Long, LargeBatch, ::testing::ValuesIn(all_backends()),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return std::string(backend_name(info.param));
                         });

}  // namespace
}  // namespace fusedce_test
