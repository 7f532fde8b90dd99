// The CPU row kernels built for the baseline instruction set of the target.
#define FUSEDCE_CPU_ISA generic
#include "cpu/kernels_impl.h"
