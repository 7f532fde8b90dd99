// Running fusedce on a test backend and judging the results: uploads a Problem, calls one entry
// point with outputs laid out as asked (strides, offsets, guard bytes), downloads everything,
// checks that nothing outside the output tensors was written, and compares with the float64
// reference under the one per-dtype tolerance helper.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"
#include "fusedce/cross_entropy.h"
#include "problem.h"
#include "reference.h"

namespace fusedce_test {

// ---- tolerances ------------------------------------------------------------------------------

enum class Quantity { kLoss, kGradient };

/// |got - ref| <= rtol * |ref| + atol * scale + floor, where `scale` is the magnitude of the
/// terms that were summed or cancelled to form the value (RefRow::loss_scale, the gradient
/// scale of ref_grad). NaN must meet NaN and an infinity the same infinity.
struct Tolerance {
  double rtol;
  double atol;
  double floor;
};

/// The one tolerance helper: every comparison takes its tolerance from here, per dtype. Losses, lse
/// and metrics are formed in float32 from inputs the reference sees exactly, in every dtype: 1e-5
/// relative, plus 2e-6 (about 16 float32 ulps) of the magnitude of the cancelling terms. Gradients
/// are formed in float32 and rounded to the output dtype: 2e-6 of the row's term magnitude, plus
/// 1e-5 relative for float32, or one ulp of the dtype relative for bfloat16 and float16 (2^-7 and
/// 2^-10, i.e. 8e-3 and 1e-3), and for float16 one step of its subnormal grid (2^-24) for the tiny
/// probabilities that land there.
Tolerance tolerance(fusedce::DType dtype, Quantity quantity);

/// Whether `got` matches `ref` (NaN / inf masks included); *bound receives the allowed error.
bool within(double got, double ref, double scale, const Tolerance& tol, double* bound = nullptr);

/// Collects mismatches of one quantity and reports them as one failure listing the first few.
class Mismatches {
 public:
  explicit Mismatches(std::string what) : what_(std::move(what)) {}
  /// Compares and records; `where` describes the element (row, column).
  void check(double got, double ref, double scale, const Tolerance& tol, int64_t row, int64_t col = -1);
  /// Records a mismatch found by other means.
  void add(const std::string& message);
  int64_t count() const { return count_; }
  int64_t checked() const { return checked_; }
  /// The largest |got - ref| / allowed error seen among finite values (how close to failing).
  double worst_ratio() const { return worst_ratio_; }
  /// Adds one gtest failure if anything mismatched, and records worst_ratio() as a test
  /// property (visible with --gtest_output=xml).
  void report() const;

 private:
  std::string what_;
  int64_t count_ = 0;
  int64_t checked_ = 0;
  double worst_ratio_ = 0.0;
  std::vector<std::string> first_;
};

// ---- running ---------------------------------------------------------------------------------

/// How one call is made: its options and how its outputs are laid out in device memory.
struct RunSpec {
  fusedce::Options options;  ///< class_weight is filled in from the Problem
  bool lse = true;           ///< ask for the per-row lse
  int64_t loss_stride = 1;   ///< (kNone) element stride of the loss vector
  int64_t lse_stride = 1;

  bool gradient = false;       ///< forward_backward instead of forward
  std::vector<float> grad_loss;  ///< empty: no upstream gradient
  int64_t grad_loss_stride = 1;
  int64_t dlogits_pad = 0;     ///< dlogits row_stride = V + pad
  int64_t dlogits_offset = 0;  ///< elements before dlogits row 0 (unaligned views)
  bool inplace = false;        ///< dlogits is the logits buffer (options.inplace_backward is set)

  int num_threads = 0;         ///< CPU backend: Device::num_threads (0 = all)
};

/// A gradient downloaded from the device, in its device layout.
struct GradMatrix {
  fusedce::DType dtype = fusedce::DType::kFloat32;
  int64_t rows = 0, vocab = 0, stride = 0, offset = 0;
  std::vector<uint8_t> bytes;

  double at(int64_t i, int64_t j) const { return load_value(bytes.data(), dtype, offset + i * stride + j); }
  void load_row(int64_t i, double* out) const { load_values(bytes.data(), dtype, offset + i * stride, out, vocab); }
  /// Whether both hold the same bits in every element of the (rows x vocab) matrix.
  bool same_bits(const GradMatrix& other, std::string* first_difference = nullptr) const;
  bool row_same_bits(const GradMatrix& other, int64_t i) const;
};

struct Outputs {
  fusedce::Status status;
  std::vector<float> loss;  ///< N for kNone, else 1
  std::vector<float> lse;   ///< N, when asked
  int64_t num_correct = -1;
  float entropy_sum = 0.0f;
  GradMatrix grad;          ///< forward_backward / backward
};

/// forward (spec.gradient false) or forward_backward (true).
Outputs run_forward(Backend& backend, const Problem& problem, const RunSpec& spec);

/// cross_entropy_backward from a forward's lse and an upstream gradient. `inplace` passes the
/// logits buffer as dlogits (allowed for the backward); lse and grad_loss are laid out with the
/// given element strides (NaN in the gaps).
Outputs run_backward(Backend& backend, const Problem& problem, const fusedce::Options& options,
                     const std::vector<float>& lse, const std::vector<float>& grad_loss,
                     int64_t dlogits_pad = 0, bool inplace = false, int64_t lse_stride = 1,
                     int64_t grad_loss_stride = 1);

/// cross_entropy_rescale_grad on an uploaded copy of `grad`; on success `grad` holds the result.
fusedce::Status run_rescale(Backend& backend, GradMatrix* grad, const std::vector<float>& grad_loss,
                            int64_t grad_loss_stride = 1);

// ---- judging ---------------------------------------------------------------------------------

/// Loss (per row or reduced), lse (when asked; 0 at ignored rows) and, with return_metrics,
/// num_correct (exact) and entropy_sum.
void expect_forward_matches(const Outputs& out, const Problem& problem, const Reference& ref,
                            const RunSpec& spec);

/// Every element of the gradient: exactly 0 on ignored rows, else within tolerance of the
/// reference for the upstream gradient grad_loss (the reduction's chain factor included).
void expect_grad_matches(const GradMatrix& grad, const Problem& problem, const Reference& ref,
                         const std::vector<float>& grad_loss);

/// Short readable names for generated test names.
const char* dtype_tag(fusedce::DType dtype);

/// All three logits dtypes.
std::vector<fusedce::DType> float_dtypes();

}  // namespace fusedce_test
