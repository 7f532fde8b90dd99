set(FUSEDCE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/ce/launch.cu
  ${CMAKE_CURRENT_LIST_DIR}/ce/batch_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/ce/row_f32.cu
  ${CMAKE_CURRENT_LIST_DIR}/ce/row_bf16.cu
  ${CMAKE_CURRENT_LIST_DIR}/ce/row_f16.cu
  ${CMAKE_CURRENT_LIST_DIR}/shard/shard_kernels.cu)

# The linear cross-entropy's CUDA part (cuBLASLt): the CUDA build only; elsewhere linear/linear_none.cpp.
set(FUSEDCE_CUDA_LINEAR_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/linear/linear_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/linear/window_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/linear/linear_cuda.cpp
  ${CMAKE_CURRENT_LIST_DIR}/linear/linear_shard_cuda.cpp
  ${CMAKE_CURRENT_LIST_DIR}/linear/gemm.cpp)
