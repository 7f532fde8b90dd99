// Scalar pieces of the distillation loss (fusedce/distill.h), shared by host and device code:
// a head's transform of one logit and its derivative, and one entry's divergence term and its
// derivative with respect to the student's log-probability.
//
// Every divergence here is a sum over entries j of f(s_j, t_j), s and t the student's and the
// teacher's log-probabilities (over the vocabulary, or the top-k form's sparse entries):
//   forward KL (beta 0):   f = e^t (t - s)                              df/ds = -e^t
//   reverse KL (beta 1):   f = e^s (s - t)                              df/ds = e^s (s - t + 1)
//   generalized JSD:       f = beta e^t (t - l) + (1 - beta) e^s (s - l),
//                          l = log((1 - beta) e^s + beta e^t)           df/ds = (1 - beta) e^s (s - l)
// (in the JSD the terms of dl/ds cancel: beta e^t + (1 - beta) e^s = e^l). Over a whole
// vocabulary s_j = z_j - lse, and the chain through the softmax gives the per-logit gradients
// of the header (distill_logit_grad).
#pragma once

#include <cmath>

#include "common/numeric.h"

namespace fusedce {
namespace detail {

enum class DivergenceKind : int { kForwardKl = 0, kReverseKl = 1, kJsd = 2 };

FUSEDCE_HD DivergenceKind divergence_kind(float beta) {
  return beta == 0.0f ? DivergenceKind::kForwardKl : beta == 1.0f ? DivergenceKind::kReverseKl : DivergenceKind::kJsd;
}

/// A head's transform y of a logit x: s x, or c tanh(s x / c) with a softcap c > 0.
struct Transform {
  float scale;
  float softcap;  // 0: off
};

FUSEDCE_HD float transform_y(const Transform& h, float x) {
  const float y = h.scale * x;
  return h.softcap > 0.0f ? h.softcap * tanhf(y / h.softcap) : y;
}

/// dy/dx from y itself: s, or s (1 - (y / c)^2) with a softcap (y / c is the tanh).
FUSEDCE_HD float transform_dy_of_y(const Transform& h, float y) {
  if (h.softcap <= 0.0f) return h.scale;
  const float th = y / h.softcap;
  return h.scale * (1.0f - th * th);
}

/// log((1 - beta) e^s + beta e^t), without overflow (s, t <= 0 for log-probabilities, but the
/// sparse entries of the top-k form need not be).
FUSEDCE_HD float mixture_log(float s, float t, float log_1mb, float log_b) {
  const float a = s + log_1mb, b = t + log_b;
  const float top = a > b ? a : b;
  if (top == -INFINITY) return -INFINITY;
  return top + logf(expf(a - top) + expf(b - top));
}

/// One entry's divergence term f(s, t) (see the top of this file). An entry whose weight e^t or
/// e^s is 0 adds exactly 0 (not 0 * inf).
FUSEDCE_HD float divergence_term(DivergenceKind k, float s, float t, float beta, float log_1mb, float log_b) {
  const float ps = expf(s), pt = expf(t);
  if (k == DivergenceKind::kForwardKl) return pt == 0.0f ? 0.0f : pt * (t - s);
  if (k == DivergenceKind::kReverseKl) return ps == 0.0f ? 0.0f : ps * (s - t);
  const float l = mixture_log(s, t, log_1mb, log_b);
  const float ft = pt == 0.0f ? 0.0f : beta * pt * (t - l);
  const float fs = ps == 0.0f ? 0.0f : (1.0f - beta) * ps * (s - l);
  return ft + fs;
}

/// df/ds of one entry.
FUSEDCE_HD float divergence_dterm(DivergenceKind k, float s, float t, float log_1mb, float log_b, float one_mb) {
  const float ps = expf(s);
  if (k == DivergenceKind::kForwardKl) return -expf(t);
  if (ps == 0.0f) return 0.0f;
  if (k == DivergenceKind::kReverseKl) return ps * (s - t + 1.0f);
  return one_mb * ps * (s - mixture_log(s, t, log_1mb, log_b));
}

/// The gradient with respect to z_j of a whole-vocabulary divergence, s_j = z_j - lse_s and
/// t_j = z_t,j - lse_t: forward KL p_s - p_t; reverse KL p_s (s - t - D); JSD
/// (1 - beta) p_s (s - l - KL(p_s || m)). `aux` is D (reverse) or KL(p_s || m) (JSD).
FUSEDCE_HD float distill_logit_grad(DivergenceKind k, float s, float t, float aux, float log_1mb, float log_b,
                                    float one_mb) {
  const float ps = expf(s);
  if (k == DivergenceKind::kForwardKl) return ps - expf(t);
  if (ps == 0.0f) return 0.0f;
  if (k == DivergenceKind::kReverseKl) return ps * (s - t - aux);
  return one_mb * ps * (s - mixture_log(s, t, log_1mb, log_b) - aux);
}

}  // namespace detail
}  // namespace fusedce
