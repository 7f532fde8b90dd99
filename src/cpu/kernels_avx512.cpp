// The CPU row kernels built for AVX-512 (F, BW, DQ, VL) + FMA + F16C with 16-lane vectors (chosen
// at run time when the CPU has them). Their sums run over 16 lanes, so their results may differ
// from the 8-lane builds' in the last bits; on one machine they are the same run to run.
#define FUSEDCE_CPU_ISA avx512
#define FUSEDCE_CPU_LANES 16
#include "cpu/kernels_impl.h"
