// fusedce: fused cross-entropy kernels. The umbrella header.
#pragma once

#include "fusedce/cpu_threads.h"
#include "fusedce/cross_entropy.h"
#include "fusedce/distill.h"
#include "fusedce/linear_cross_entropy.h"
#include "fusedce/logprobs.h"
#include "fusedce/types.h"
#include "fusedce/vocab_parallel.h"
#include "fusedce/version.h"
