// Scalar pieces of the per-token log-probabilities and entropy (fusedce/logprobs.h), shared by
// host and device code: the running row state, its merge, the finish into lse / logprob /
// entropy, and the gradient of one logit.
//
// Why a state of its own (and not the loss's (max, sum of exps)): in float32, z_t - lse rounds
// to 0 once the target's margin passes ~16.6 nats (the sum of exps is 1 + something below
// float32's epsilon), and so does 1 - p_t in the gradient. The state here keeps the sum of the
// exps of every entry *except one instance of the running max* (`r`), so the sum of exps is
// 1 + r with r held to float32's relative precision however small it is:
//   lse          = m + log1p(r)
//   logprob_t    = (z_t - m) - log1p(r)        (exact when t is the max: -log1p(r))
//   entropy      = log1p(r) - u / (1 + r),     u = sum_j exp(z_j - m) (z_j - m)
//   1 - p_t      = -expm1(logprob_t)
// A collapsed row (p_t -> 1) has its target at the max, so no other bookkeeping is needed; a
// target below the max has |logprob_t| >= m - z_t and no cancellation.
#pragma once

#include <cmath>

#include "common/numeric.h"

namespace fusedce {
namespace detail {

FUSEDCE_HD float lp_exp(float x) { return expf(x); }
FUSEDCE_HD double lp_exp(double x) { return exp(x); }
FUSEDCE_HD float lp_log1p(float x) { return log1pf(x); }
FUSEDCE_HD double lp_log1p(double x) { return log1p(x); }

/// Running statistics of a set of z values. `m == -inf`: no finite value so far (r, u are 0,
/// or NaN once a NaN was seen). -inf entries add nothing; a NaN entry makes r and u NaN.
/// A is float (kernels' lanes and one row's chunks) or double (host folds of many partials).
template <typename A>
struct LpState {
  float m;
  A r;  // sum over the entries but one instance of m of exp(z - m)
  A u;  // sum over all entries of exp(z - m) * (z - m)
  A q;  // sum over the entries but one instance of m of exp(2 (z - m)): sum p^2 = (1 + q) / (1 + r)^2
};

template <typename A>
FUSEDCE_HD LpState<A> lp_empty() {
  return LpState<A>{-INFINITY, A(0), A(0), A(0)};
}

/// Add one z to a state.
template <typename A>
FUSEDCE_HD void lp_push(LpState<A>& s, float z) {
  if (z != z) {
    s.r = s.u = s.q = A(NAN);
    return;
  }
  if (z == -INFINITY) return;
  if (s.m == -INFINITY) {
    s.m = z;  // r, u, q stay 0 (or NaN)
    return;
  }
  if (z > s.m) {
    const A d = A(s.m) - A(z);
    const A f = lp_exp(d);
    s.u = (s.u + (A(1) + s.r) * d) * f;
    s.r = (s.r + A(1)) * f;
    s.q = (s.q + A(1)) * f * f;
    s.m = z;
  } else {
    const A d = A(z) - A(s.m);
    const A e = lp_exp(d);
    s.r += e;
    s.u += e * d;
    s.q += e * e;
  }
}

/// Merge two states; the same function merges lanes, chunks and ranks. Associative up to
/// rounding; ties of the max keep one instance out of r and count the other in it.
template <typename A, typename B>
FUSEDCE_HD LpState<A> lp_merge(const LpState<A>& a, const LpState<B>& b) {
  if (b.m == -INFINITY) return LpState<A>{a.m, a.r + A(b.r), a.u + A(b.u), a.q + A(b.q)};
  if (a.m == -INFINITY) return LpState<A>{b.m, A(b.r) + a.r, A(b.u) + a.u, A(b.q) + a.q};
  if (a.m >= b.m) {
    const A d = A(b.m) - A(a.m);
    const A f = lp_exp(d);
    return LpState<A>{a.m, a.r + (A(1) + A(b.r)) * f, a.u + (A(b.u) + (A(1) + A(b.r)) * d) * f,
                      a.q + (A(1) + A(b.q)) * f * f};
  }
  const A d = A(a.m) - A(b.m);
  const A f = lp_exp(d);
  return LpState<A>{b.m, A(b.r) + (A(1) + a.r) * f, A(b.u) + (a.u + (A(1) + a.r) * d) * f,
                    A(b.q) + (A(1) + a.q) * f * f};
}

/// A row's results from its merged state and its target's z.
struct LpResult {
  float lse, logprob, entropy;
};

template <typename A>
FUSEDCE_HD LpResult lp_finish(const LpState<A>& s, float z_t) {
  if (s.m == -INFINITY) {
    // No finite z (every entry -inf): torch's log_softmax gives NaN throughout.
    return LpResult{-INFINITY, NAN, NAN};
  }
  const A l1 = lp_log1p(s.r);
  const float lse = static_cast<float>(A(s.m) + l1);
  const float lp = static_cast<float>((A(z_t) - A(s.m)) - l1);
  const float h = static_cast<float>(l1 - s.u / (A(1) + s.r));
  return LpResult{lse, lp, h};
}

/// A row's distribution statistics (fusedce/logprobs.h, DistributionStats) from its merged
/// state (with q), the sum of its z, the max of z before its target's index and the target's z.
/// No finite z: log_sum_sq_probs NaN (log 0 - 2 log 0, as a direct evaluation gives).
struct LpDist {
  float log_sum_sq_probs, mean_logit, is_top1;
};

template <typename A>
FUSEDCE_HD LpDist lp_dist_finish(const LpState<A>& s, double z_sum, float max_before, float z_t, int64_t vocab) {
  const float lss = s.m == -INFINITY ? NAN : static_cast<float>(lp_log1p(s.q) - A(2) * lp_log1p(s.r));
  const bool top1 = z_t >= s.m && z_t > max_before;  // false for a NaN z_t
  return LpDist{lss, static_cast<float>(z_sum / static_cast<double>(vocab)), top1 ? 1.0f : 0.0f};
}

/// Per-row constants of the gradient: dz_j = g_lp (delta_jt - p_j) - g_H p_j (z_j - lse + H).
struct LpRowGrad {
  float lse, logprob, entropy, g_lp, g_h;
};

/// d/dz_j of g_lp * logprob_t + g_h * entropy, for j != t from z_j, for j == t from the
/// forward's logprob (1 - p_t as -expm1: exact in collapse).
FUSEDCE_HD float lp_grad(const LpRowGrad& g, float z, bool is_target) {
  if (is_target) {
    const float lp = g.logprob;
    return -g.g_lp * expm1f(lp) - g.g_h * expf(lp) * (lp + g.entropy);
  }
  const float d = z - g.lse;
  const float p = expf(d);
  if (p == 0.0f) return 0.0f;  // also for z = -inf, where d + H is -inf
  return -p * (g.g_lp + g.g_h * (d + g.entropy));
}

}  // namespace detail
}  // namespace fusedce
