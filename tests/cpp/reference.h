// An independent float64 reference of docs/contract.md, written from the contract and not from the
// library: z, lse, the per-row loss with label smoothing, class weights (weighted as PyTorch
// weights them) and z-loss, the reductions, the metrics, and dL/dx. Inputs are the already rounded
// values the library sees, widened to double.
#pragma once

#include <cstdint>
#include <vector>

#include "fusedce/types.h"
#include "problem.h"

namespace fusedce_test {

/// The option values of one call, in double.
struct RefParams {
  int64_t vocab = 0;
  double eps = 0.0;          // label_smoothing
  double logit_scale = 1.0;
  double softcap = 0.0;      // 0 = off
  double z_loss = 0.0;
  std::vector<double> weight;  // (V,) or empty
  fusedce::Reduction reduction = fusedce::Reduction::kMean;
  int64_t ignore_index = -100;
  bool metrics = false;  // compute the entropy (an extra exp per element)

  static RefParams from(const fusedce::Options& o, int64_t vocab, const std::vector<float>& class_weight);
  double w(int64_t j) const { return weight.empty() ? 1.0 : weight[j]; }
  double weight_sum() const;
  double weight_max() const;
};

/// One row's reference values (for a non-ignored row).
struct RefRow {
  bool ignored = true;
  int64_t target = 0;
  double w_t = 0.0;
  /// log-sum-exp of z as log_softmax forms it: NaN once the row holds a NaN or a +inf z
  /// (inf - inf), -inf for a row of -inf only, else max + log(sum exp(z - max)).
  double lse = 0.0;
  double loss = 0.0;
  /// Sum of the magnitudes of the loss's terms before they cancel (|lse| + 1, |z_t|, |z_j|, and
  /// 2 |lse| (|lse| + 1) for z-loss, with their factors): the scale float32 rounding of the loss
  /// is relative to.
  double loss_scale = 0.0;
  double entropy = 0.0;        // lse - sum_j p_j z_j (terms with p_j = 0 count 0); metrics only
  double entropy_scale = 0.0;  // |lse| + 1 + sum_j p_j |z_j|
  int64_t argmax = 0;          // torch.argmax over z: first NaN, else lowest index of the max
};

/// z_j from x_j for one row.
void ref_z(const RefParams& p, const double* x, double* z);
/// The row's reference values from its z.
RefRow ref_row(const RefParams& p, const double* z, int64_t target);
/// dL/dx_j of one row (from its z) for upstream gradient g (the reduction's chain factor included);
/// *scale receives |g| (|a| + (1-eps) w_t + (eps/V) max w) max|dz/dx|, the magnitude the
/// terms have before they cancel.
void ref_grad(const RefParams& p, const double* z, const RefRow& row, double g,
              double* grad, double* scale);

/// The reference of a whole Problem under one set of options.
class Reference {
 public:
  Reference(const Problem& problem, const fusedce::Options& options);

  const RefParams& params() const { return params_; }
  const RefRow& row(int64_t i) const { return rows_[i]; }
  int64_t rows() const { return static_cast<int64_t>(rows_.size()); }
  /// Mean's denominator: non-ignored rows, or the sum of their target weights.
  double denominator() const { return denominator_; }
  /// The loss as the reduction gives it (kSum / kMean), and its rounding scale.
  double reduced_loss() const { return reduced_loss_; }
  double reduced_loss_scale() const { return reduced_loss_scale_; }
  int64_t num_correct() const { return num_correct_; }
  double entropy_sum() const { return entropy_sum_; }
  double entropy_scale() const { return entropy_scale_; }
  /// Upstream gradient of row i: grad_loss (1 when empty; its element i for kNone, element 0
  /// otherwise) times the reduction's chain factor (1 / denominator for kMean).
  double upstream(int64_t i, const std::vector<float>& grad_loss) const;
  /// Reference dL/dx of row i (V values) and its tolerance scale.
  void grad_row(int64_t i, double g, std::vector<double>* grad, double* scale) const;

 private:
  const Problem& problem_;
  RefParams params_;
  std::vector<RefRow> rows_;
  double denominator_ = 0.0;
  double reduced_loss_ = 0.0;
  double reduced_loss_scale_ = 0.0;
  int64_t num_correct_ = 0;
  double entropy_sum_ = 0.0;
  double entropy_scale_ = 0.0;
};

/// The reduced reference loss of double logits x (N x V, contiguous); for kNone the per-row
/// losses weighted by grad_loss (so its gradient is the backward's). For finite differences.
double reference_objective(const RefParams& p, const std::vector<double>& x, int64_t rows,
                           const std::vector<int64_t>& target, const std::vector<float>& grad_loss);

}  // namespace fusedce_test
