// The CUDA test backend in a build without it. A CUDA build adds backend_cuda.cu instead of
// this file (see CMakeLists.txt): a Backend with cudaMalloc / cudaMemcpy / cudaStreamSynchronize
// whose cuda_test_backend() returns nullptr, with the reason, when no device is present.
#include "backend.h"

namespace fusedce_test {

Backend* cuda_test_backend(std::string* why_not) {
  *why_not = "the tests were built without the CUDA test backend (tests/cpp/backend_cuda.cu)";
  return nullptr;
}

}  // namespace fusedce_test
