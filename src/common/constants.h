// Per-call constants of the loss, computed on the host from the options.
#pragma once

#include "common/numeric.h"
#include "fusedce/types.h"

namespace fusedce {
namespace detail {

/// weight_sum: sum of the class weights, or V when there are none.
inline LossConstants make_loss_constants(const Options& o, int64_t vocab, float weight_sum) {
  LossConstants c;
  c.eps = o.label_smoothing;
  c.one_minus_eps = 1.0f - o.label_smoothing;
  c.eps_over_v = static_cast<float>(static_cast<double>(o.label_smoothing) / static_cast<double>(vocab));
  c.inv_v = static_cast<float>(1.0 / static_cast<double>(vocab));
  c.z_loss = o.z_loss;
  c.logit_scale = o.logit_scale;
  c.softcap = o.softcap;
  c.inv_softcap = o.softcap > 0.0f ? o.logit_scale / o.softcap : 0.0f;
  c.weight_sum = weight_sum;
  return c;
}

}  // namespace detail
}  // namespace fusedce
