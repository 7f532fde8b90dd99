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
  // Copies go through the backend's own stream and wait for it. (A plain cudaMemcpy runs on the
  // legacy default stream, which a non-blocking stream does not wait for, and a host-to-device
  // copy from pageable memory may return before its DMA lands: a later kernel on stream_ could
  // then be overtaken by it, e.g. a poison fill landing on top of freshly written dlogits.)
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync H2D");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync D2H");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  bool capture_begin(std::string* why) override {
    drop_graph();
    return ok(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture", why);
  }
  bool capture_end(size_t* nodes, std::string* why) override {
    cudaGraph_t g = nullptr;
    if (!ok(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture", why)) return false;
    graph_ = g;
    *nodes = 0;
    if (!ok(cudaGraphGetNodes(graph_, nullptr, nodes), "cudaGraphGetNodes", why)) return false;
    return ok(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate", why);
  }
  bool replay(std::string* why) override {
    if (exec_ == nullptr) {
      *why = "no instantiated graph";
      return false;
    }
    return ok(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch", why) &&
           ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after the replay", why);
  }

 private:
  static bool ok(cudaError_t e, const char* what, std::string* why) {
    if (e == cudaSuccess) return true;
    *why = std::string(what) + ": " + cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  void drop_graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
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
