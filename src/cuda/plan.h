// The cross-entropy launcher's steering for tests and benchmarks. Every field at its default
// gives the production plan; nothing here is read from the environment: a test or benchmark
// that wants a variant passes one of these to cuda::run explicitly, for that call only.
#pragma once

#include <cstdint>

#include "common/call.h"

namespace fusedce {
namespace cuda {

struct PlanChoices {
  enum class Force : int8_t { kAuto, kOn, kOff };
  /// kOff: the row kernel for forward jobs on sm_90 too (the path of GPUs before Hopper).
  Force stream = Force::kAuto;
  /// kOn: rows halved over 2-block clusters whenever the plan allows them (forward + gradient,
  /// whole rows of at least two chunks); kOff: never.
  Force halves = Force::kAuto;
  /// 1 or 2: that many consumer groups over whole rows (the plan's choice otherwise).
  int groups = 0;
  /// false: the stream kernel's synchronous row reduction for forward jobs over whole rows (the
  /// results are the same bits; racecheck can follow its barriers, not the asynchronous handoff).
  bool async_reduce = true;
  /// false: the prepare, split-merge and finalize passes around the stream kernel instead of its
  /// own finish.
  bool stream_finish = true;
  /// > 0: chunks per split for few rows (clamped to what the workspace allows).
  int split_chunks = 0;
};

/// One call of the GPU backend under explicit choices (the entry points pass the defaults).
Status run(const detail::CeCall& call, const PlanChoices& choices);

}  // namespace cuda
}  // namespace fusedce
