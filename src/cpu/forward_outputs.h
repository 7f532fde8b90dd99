// The forward outputs of a CPU linear call, written from the statistics of the rows it computed.
// Both linear paths (chunked logits and vocabulary tiles) compute only the rows whose target is
// not ignored, in row order, and report over all N rows of the call.
#pragma once

#include <cstdint>
#include <vector>

#include "fusedce/cross_entropy.h"
#include "fusedce/types.h"

namespace fusedce {
namespace cpu {

/// What a call computed for each row whose target is not ignored, in row order.
struct ComputedRows {
  const std::vector<int64_t>& rows;   // each computed row's index among the call's rows
  const std::vector<float>& loss;     // per computed row
  const std::vector<float>& lse;      // per computed row
  const std::vector<uint8_t>& correct;  // per computed row; read only with return_metrics
  const std::vector<float>& entropy;    // per computed row; read only with return_metrics
};

/// Writes `out` for a call over n_rows rows: per-row loss and lse (0 at rows not computed),
/// the sum or the mean (over `denominator`) of the losses, and the metrics. Every sum is taken
/// in double and in row order, so a call's outputs do not depend on how its rows were split.
inline void write_forward_outputs(const ForwardOutputs& out, const Options& o, double denominator,
                                  int64_t n_rows, const ComputedRows& r) {
  const int64_t m = static_cast<int64_t>(r.rows.size());
  auto put = [](const VectorView& v, int64_t i, float x) { static_cast<float*>(v.data)[i * v.stride] = x; };
  if (o.reduction == Reduction::kNone) {
    for (int64_t i = 0; i < n_rows; ++i) put(out.loss, i, 0.0f);
    for (int64_t i = 0; i < m; ++i) put(out.loss, r.rows[i], r.loss[i]);
  } else {
    double total = 0.0;
    for (int64_t i = 0; i < m; ++i) total += r.loss[i];
    put(out.loss, 0, static_cast<float>(o.reduction == Reduction::kMean ? total / denominator : total));
  }
  if (!out.lse.empty()) {
    for (int64_t i = 0; i < n_rows; ++i) put(out.lse, i, 0.0f);
    for (int64_t i = 0; i < m; ++i) put(out.lse, r.rows[i], r.lse[i]);
  }
  if (o.return_metrics) {
    int64_t nc = 0;
    double ent = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      nc += r.correct[i];
      ent += r.entropy[i];
    }
    static_cast<int64_t*>(out.num_correct.data)[0] = nc;
    put(out.entropy_sum, 0, static_cast<float>(ent));
  }
}

}  // namespace cpu
}  // namespace fusedce
