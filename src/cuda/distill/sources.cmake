# The CUDA distillation (kernels and the cuBLASLt products): the CUDA build only; elsewhere
# src/cuda/distill_none.cpp.
set(FUSEDCE_CUDA_DISTILL_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/distill_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/distill_cuda.cpp)
