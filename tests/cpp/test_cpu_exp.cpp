// The CPU row kernels' exponential, checked far tighter than the contract's float32 tolerance
// (1e-5 relative), which a polynomial off by 1e-5 would still pass. Rows [0, d] over d in
// [-80, 0] put every residue of the range reduction and every power of two through it:
// - the gradient of d's column, p = exp(d - lse) from 0.5 down to 1e-35, must sit within 4
//   float32 ulps of float64's, beyond what the
//   rounding of its argument d - lse already moves it (half an ulp of that argument);
// - the loss log(1 + e^d) (target 0) must sit within 2 ulps of the loss plus 1.5e-7 (the
//   rounding of the sum 1 + e^d and of the log).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "fusedce/fusedce.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

double ulp_of(float x) {
  const float a = std::fabs(x);
  return static_cast<double>(std::nextafter(a, std::numeric_limits<float>::infinity()) - a);
}

TEST(CpuExp, GradientAndLossWithinAFewUlpsOfFloat64) {
  const int64_t rows = 16384, vocab = 2;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> jitter(0.0, 1.0);
  std::vector<float> logits(rows * vocab), loss(rows), lse(rows), grad(rows * vocab);
  std::vector<int64_t> target(rows, 0);
  for (int64_t i = 0; i < rows; ++i) {
    logits[i * vocab] = 0.0f;
    logits[i * vocab + 1] = static_cast<float>(-80.0 * (i + jitter(rng)) / rows);
  }
  fusedce::Options o;
  o.reduction = fusedce::Reduction::kNone;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::VectorView{loss.data(), DType::kFloat32, rows, 1};
  out.lse = fusedce::VectorView{lse.data(), DType::kFloat32, rows, 1};
  const fusedce::MatrixView x{logits.data(), DType::kFloat32, rows, vocab, vocab};
  const fusedce::VectorView t{target.data(), DType::kInt64, rows, 1};
  const fusedce::MatrixView dx{grad.data(), DType::kFloat32, rows, vocab, vocab};
  const fusedce::Status st =
      fusedce::cross_entropy_forward_backward(fusedce::Device::cpu(), x, t, o, out, {}, dx);
  ASSERT_TRUE(st.ok()) << st.message();

  int bad_p = 0, bad_loss = 0;
  double worst_p = 0.0, worst_loss = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const double d = logits[i * vocab + 1];
    const double lse64 = std::log1p(std::exp(d));
    // Column 1 is off the target: its gradient is p itself, down to 1e-35, with no 1 beside it.
    const double p_ref = std::exp(d - lse64);
    const float arg = static_cast<float>(d) - lse[i];
    const double p_bound = 4.0 * ulp_of(static_cast<float>(p_ref)) + p_ref * 0.5 * ulp_of(arg);
    const double p_err = std::fabs(grad[i * vocab + 1] - p_ref);
    worst_p = std::max(worst_p, p_err / p_bound);
    if (p_err > p_bound && ++bad_p <= 5) {
      ADD_FAILURE() << "row " << i << " d=" << d << ": p " << grad[i * vocab + 1] << ", float64 " << p_ref
                    << " (error " << p_err << ", allowed " << p_bound << ")";
    }
    const double loss_ref = lse64;  // the target's logit is 0
    const double loss_bound = 1.5e-7 + 2.0 * ulp_of(static_cast<float>(loss_ref));
    const double loss_err = std::fabs(loss[i] - loss_ref);
    worst_loss = std::max(worst_loss, loss_err / loss_bound);
    if (loss_err > loss_bound && ++bad_loss <= 5) {
      ADD_FAILURE() << "row " << i << " d=" << d << ": loss " << loss[i] << ", float64 " << loss_ref << " (error "
                    << loss_err << ", allowed " << loss_bound << ")";
    }
  }
  EXPECT_EQ(bad_p, 0);
  EXPECT_EQ(bad_loss, 0);
  RecordProperty("worst_p_ratio", std::to_string(worst_p));
  RecordProperty("worst_loss_ratio", std::to_string(worst_loss));
  std::printf("worst error / allowed: p %.3f, loss %.3f\n", worst_p, worst_loss);
}

}  // namespace
}  // namespace fusedce_test
