// One validated call of a distillation entry point (fusedce/distill.h), as the backends receive
// it.
#pragma once

#include "fusedce/distill.h"

namespace fusedce {
namespace detail {

struct DistillCall {
  bool backward;  // false: the forward
  Device device;
  MatrixView hidden, weight;  // the student's head
  VectorView bias;            // or empty
  DistillTeacher teacher;
  VectorView labels;  // (N,) or empty (every row counts, no hard term)
  DistillOptions options;
  size_t chunk_budget_bytes = 0;  // 0 = kDistillDefaultBudget
  DistillOutputs out;             // forward
  MatrixView stats;               // backward: the forward's out.stats
  VectorView grad_loss;           // backward
  LinearGrads grads;              // backward

  int64_t rows() const { return hidden.rows; }
  int64_t vocab() const { return weight.rows; }
};

Status validate_distill_call(const DistillCall& call);

}  // namespace detail

namespace cpu {
Status run_distill(const detail::DistillCall& call);
}  // namespace cpu

namespace cuda {
/// Present in every build; without the CUDA backend it returns kUnsupported.
Status run_distill(const detail::DistillCall& call);
}  // namespace cuda

}  // namespace fusedce
