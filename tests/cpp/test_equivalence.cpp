// Paths that must agree: the in-place gradient with the out-of-place one, results with metrics
// on and off, the backward (from the forward's lse) with the forward-with-gradient, and the
// rescaled gradient with the reference for the rescaled upstream gradient.
#include <cmath>
#include <cstring>
#include <vector>

#include "fixture.h"
#include "harness.h"
#include "option_sets.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

void expect_same_forward_bits(const Outputs& a, const Outputs& b) {
  ASSERT_EQ(a.loss.size(), b.loss.size());
  EXPECT_EQ(std::memcmp(a.loss.data(), b.loss.data(), a.loss.size() * 4), 0) << "loss differs";
  ASSERT_EQ(a.lse.size(), b.lse.size());
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4), 0) << "lse differs";
}

Problem make(const Case& c, OptionSet set, int64_t rows, int64_t vocab, int64_t row_pad, std::mt19937_64& rng) {
  GenSpec gen;
  gen.dtype = c.dtype;
  gen.rows = rows;
  gen.vocab = vocab;
  gen.row_pad = row_pad;
  gen.class_weight = uses_class_weight(set);
  return make_problem(gen, rng);
}

const std::vector<OptionSet> kSets = {OptionSet::kPlain, OptionSet::kAll, OptionSet::kAllReduceNone};

class Equivalence : public BackendTest<Case> {
 protected:
  OptionSet set() const { return static_cast<OptionSet>(GetParam().variant); }
};

// options.inplace_backward with dlogits = logits (strided rows): the same bits as a separate buffer,
// for the gradient and for every forward output.
TEST_P(Equivalence, InplaceGradientEqualsOutOfPlace) {
  std::mt19937_64 rng = test_rng();
  const Problem p = make(GetParam(), set(), 17, 3001, 5, rng);
  RunSpec spec;
  spec.options = make_options(set());
  spec.gradient = true;
  const Outputs out_of_place = run_forward(backend(), p, spec);
  ASSERT_TRUE(out_of_place.status.ok()) << out_of_place.status.message();
  const Reference ref(p, spec.options);
  expect_grad_matches(out_of_place.grad, p, ref, {});
  spec.inplace = true;
  const Outputs inplace = run_forward(backend(), p, spec);
  ASSERT_TRUE(inplace.status.ok()) << inplace.status.message();
  expect_same_forward_bits(out_of_place, inplace);
  EXPECT_EQ(out_of_place.num_correct, inplace.num_correct);
  EXPECT_EQ(std::memcmp(&out_of_place.entropy_sum, &inplace.entropy_sum, 4), 0);
  std::string diff;
  EXPECT_TRUE(out_of_place.grad.same_bits(inplace.grad, &diff)) << diff;
}

// return_metrics leaves loss, lse and gradient bit-identical (docs/contract.md, "Metrics").
TEST_P(Equivalence, MetricsLeaveResultsBitIdentical) {
  std::mt19937_64 rng = test_rng();
  const Problem p = make(GetParam(), set(), 23, 2500, 0, rng);
  for (bool gradient : {false, true}) {
    SCOPED_TRACE(gradient ? "forward_backward" : "forward");
    RunSpec spec;
    spec.options = make_options(set());
    spec.gradient = gradient;
    spec.options.return_metrics = false;
    const Outputs off = run_forward(backend(), p, spec);
    spec.options.return_metrics = true;
    const Outputs on = run_forward(backend(), p, spec);
    ASSERT_TRUE(off.status.ok()) << off.status.message();
    ASSERT_TRUE(on.status.ok()) << on.status.message();
    expect_forward_matches(on, p, Reference(p, spec.options), spec);
    expect_same_forward_bits(off, on);
    if (gradient) {
      std::string diff;
      EXPECT_TRUE(off.grad.same_bits(on.grad, &diff)) << diff;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Equivalence, ::testing::ValuesIn(make_option_cases(float_dtypes(), kSets)), CaseName());

class Backward : public BackendTest<Case> {};

// The backward from the forward-with-gradient's lse and an upstream gradient that is not 1
// (a scalar for sum / mean, one per row, some negative, for none) gives the same bits as the
// forward-with-gradient given the same grad_loss, out of place and in place; from a
// forward-only call's lse it matches the reference for that upstream gradient.
TEST_P(Backward, EqualsForwardBackwardWithTheSameGradLoss) {
  const Case& c = GetParam();
  const Reduction reduction = static_cast<Reduction>(c.variant % 3);
  const OptionSet set = c.variant / 3 == 0 ? OptionSet::kPlain : OptionSet::kAll;
  std::mt19937_64 rng = test_rng();
  const Problem p = make(c, set, 31, 1999, 0, rng);
  fusedce::Options o = make_options(set);
  o.reduction = reduction;
  std::vector<float> grad_loss(reduction == Reduction::kNone ? p.rows : 1);
  std::uniform_real_distribution<float> g(0.25f, 2.0f);
  for (size_t k = 0; k < grad_loss.size(); ++k) grad_loss[k] = (k % 3 == 1 ? -1.0f : 1.0f) * g(rng);
  if (reduction != Reduction::kNone) grad_loss[0] = -0.37f;

  RunSpec spec;
  spec.options = o;
  const Outputs fwd = run_forward(backend(), p, spec);
  ASSERT_TRUE(fwd.status.ok()) << fwd.status.message();
  spec.gradient = true;
  spec.grad_loss = grad_loss;
  const Outputs fb = run_forward(backend(), p, spec);
  ASSERT_TRUE(fb.status.ok()) << fb.status.message();
  const Reference ref(p, o);
  expect_forward_matches(fb, p, ref, spec);
  expect_grad_matches(fb.grad, p, ref, grad_loss);

  // From the lse the forward-with-gradient used: the same bits.
  const Outputs bw = run_backward(backend(), p, o, fb.lse, grad_loss, 7);
  ASSERT_TRUE(bw.status.ok()) << bw.status.message();
  expect_grad_matches(bw.grad, p, ref, grad_loss);
  std::string diff;
  EXPECT_TRUE(fb.grad.same_bits(bw.grad, &diff)) << "backward vs forward_backward: " << diff;

  // In place (dlogits = logits is allowed for the backward): the same bits again.
  const Outputs bw_inplace = run_backward(backend(), p, o, fb.lse, grad_loss, 0, true);
  ASSERT_TRUE(bw_inplace.status.ok()) << bw_inplace.status.message();
  EXPECT_TRUE(bw.grad.same_bits(bw_inplace.grad, &diff)) << "in-place backward: " << diff;

  // The usual pipeline: the lse saved by a forward-only call, with strided lse and grad_loss.
  const Outputs bw_fwd = run_backward(backend(), p, o, fwd.lse, grad_loss, 0, false, 2, 3);
  ASSERT_TRUE(bw_fwd.status.ok()) << bw_fwd.status.message();
  expect_grad_matches(bw_fwd.grad, p, ref, grad_loss);
}

std::vector<Case> backward_cases() {
  return make_cases(float_dtypes(), {{0, "none_plain"}, {1, "sum_plain"}, {2, "mean_plain"},
                                     {3, "none_all"}, {4, "sum_all"}, {5, "mean_all"}});
}

INSTANTIATE_TEST_SUITE_P(Backward, Backward, ::testing::ValuesIn(backward_cases()), CaseName());

class Rescale : public BackendTest<Case> {};

// A gradient formed with upstream gradient 1, then rescaled by a scalar (mean: the rescaled
// chain factor) and, with reduction none, by per-row factors (strided, some negative, a third
// exactly 1): rows with factor 1 keep their bits, the others match the reference for the
// rescaled upstream gradient.
TEST_P(Rescale, ScalarAndPerRowFactors) {
  std::mt19937_64 rng = test_rng();
  const Problem p = make(GetParam(), OptionSet::kAll, 37, 1500, 3, rng);
  {
    SCOPED_TRACE("scalar");
    RunSpec spec;
    spec.options = make_options(OptionSet::kAll);
    spec.gradient = true;
    spec.dlogits_pad = 4;
    Outputs out = run_forward(backend(), p, spec);
    ASSERT_TRUE(out.status.ok()) << out.status.message();
    const std::vector<float> factor = {0.3f};
    const fusedce::Status s = run_rescale(backend(), &out.grad, factor);
    ASSERT_TRUE(s.ok()) << s.message();
    expect_grad_matches(out.grad, p, Reference(p, spec.options), factor);
  }
  {
    SCOPED_TRACE("per row");
    RunSpec spec;
    spec.options = make_options(OptionSet::kAllReduceNone);
    spec.gradient = true;
    Outputs out = run_forward(backend(), p, spec);
    ASSERT_TRUE(out.status.ok()) << out.status.message();
    const GradMatrix before = out.grad;
    std::vector<float> factor(p.rows);
    std::uniform_real_distribution<float> f(-3.0f, 3.0f);
    for (int64_t i = 0; i < p.rows; ++i) factor[i] = i % 3 == 0 ? 1.0f : f(rng);
    const fusedce::Status s = run_rescale(backend(), &out.grad, factor, 2);
    ASSERT_TRUE(s.ok()) << s.message();
    expect_grad_matches(out.grad, p, Reference(p, spec.options), factor);
    for (int64_t i = 0; i < p.rows; i += 3) EXPECT_TRUE(out.grad.row_same_bits(before, i)) << "row " << i;
  }
}

// Rows whose factor is exactly 1 are not touched at all: rows of signalling-NaN, -0 and
// subnormal bit patterns (which a read-multiply-write would change: NaNs get quieted) keep
// their bits, with a per-row factor and with a scalar factor of 1.
TEST_P(Rescale, FactorOneRowsAreNotTouched) {
  const DType dtype = GetParam().dtype;
  const size_t es = elem_size(dtype);
  GradMatrix g;
  g.dtype = dtype;
  g.rows = 4;
  g.vocab = 300;
  g.stride = 301;
  g.offset = 2;
  g.bytes.resize((g.offset + g.rows * g.stride) * es);
  const std::vector<uint32_t> patterns32 = {0x7f800001u, 0xffa00000u, 0x80000000u, 0x00000001u, 0x3f800000u};
  const std::vector<uint16_t> patterns16 =
      dtype == DType::kBFloat16 ? std::vector<uint16_t>{0x7f81u, 0xff90u, 0x8000u, 0x0001u, 0x3f80u}
                                : std::vector<uint16_t>{0x7c01u, 0xfc10u, 0x8000u, 0x0001u, 0x3c00u};
  for (size_t k = 0; k < g.bytes.size() / es; ++k) {
    if (es == 4) {
      std::memcpy(&g.bytes[k * 4], &patterns32[k % 5], 4);
    } else {
      std::memcpy(&g.bytes[k * 2], &patterns16[k % 5], 2);
    }
  }
  {
    GradMatrix r = g;
    const fusedce::Status s = run_rescale(backend(), &r, {1.0f, 2.5f, 1.0f, 1.0f});
    ASSERT_TRUE(s.ok()) << s.message();
    for (int64_t i : {0, 2, 3}) EXPECT_TRUE(r.row_same_bits(g, i)) << "row " << i << " (factor 1) changed";
    int64_t ones = 0;
    for (int64_t j = 0; j < g.vocab; ++j) {
      if (g.at(1, j) != 1.0) continue;
      ++ones;
      EXPECT_EQ(r.at(1, j), 2.5) << "row 1 (factor 2.5) col " << j;
    }
    EXPECT_EQ(ones, 60);
  }
  {
    GradMatrix r = g;
    const fusedce::Status s = run_rescale(backend(), &r, {1.0f});
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(r.bytes == g.bytes) << "a scalar factor of 1 changed the gradient";
  }
}

INSTANTIATE_TEST_SUITE_P(Rescale, Rescale, ::testing::ValuesIn(make_cases(float_dtypes())), CaseName());

}  // namespace
}  // namespace fusedce_test
