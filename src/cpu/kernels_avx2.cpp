// The CPU row kernels built for AVX2 + FMA + F16C (chosen at run time when the CPU has them).
#define FUSEDCE_CPU_ISA avx2
#include "cpu/kernels_impl.h"
