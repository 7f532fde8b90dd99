# The CUDA log-probabilities (kernels and the cuBLASLt linear form): the CUDA build only;
# elsewhere src/cuda/logprobs_none.cpp.
set(FUSEDCE_CUDA_LOGPROBS_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/logprobs_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/logprobs_cuda.cpp)
