// The CUDA test backend: buffers in device memory (cudaMalloc), copies through cudaMemcpy, and
// the entry points called on a stream of its own, so the tests also see that the backend works
// on a non-default stream.
#include <cuda_runtime.h>

#include <new>
#include <stdexcept>
#include <string>

#include "backend.h"

namespace fusedce_test {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() { check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  BackendKind kind() const override { return BackendKind::kCuda; }
  fusedce::Device device() const override { return fusedce::Device::cuda(0, stream_); }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    // Round up like the CPU backend; the tests offset into buffers for unaligned views.
    check(cudaMalloc(&p, ((bytes == 0 ? 1 : bytes) + 63) / 64 * 64), "cudaMalloc");
    return p;
  }
  void release(void* ptr) override { cudaFree(ptr); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace

Backend* cuda_test_backend(std::string* why_not) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why_not = "no CUDA device on this machine";
    return nullptr;
  }
  static CudaBackend backend;
  return &backend;
}

}  // namespace fusedce_test
