// Host-side helpers shared by the GPU launchers (launch.cu, linear_cuda.cpp, shard_kernels.cu).
// Include it after the platform's runtime header: cuda/port.h in the .cu files (which also maps
// these names to HIP's), <cuda_runtime.h> in host-only .cpp files.
#pragma once

#include <cstddef>
#include <sstream>

#include "cuda/sizes.h"  // align_up
#include "fusedce/types.h"

namespace fusedce {
namespace cuda {

/// A runtime error as the entry points report it, naming what failed.
inline Status device_error(cudaError_t e, const char* what) {
  std::ostringstream os;
  os << "CUDA error in " << what << ": " << cudaGetErrorString(e);
  return Status(StatusCode::kDeviceError, os.str());
}

/// The error a launch left behind, if any.
inline Status last_error(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : device_error(e, what);
}

/// Runs body(workspace) on `bytes` of stream-ordered device memory (cudaMallocAsync), freed
/// after it on the same stream; body returns a Status, which is the result unless the free
/// fails after a success.
template <class Body>
Status with_workspace(size_t bytes, cudaStream_t stream, Body&& body) {
  void* scratch = nullptr;
  cudaError_t e = cudaMallocAsync(&scratch, bytes > 0 ? bytes : 1, stream);
  if (e != cudaSuccess) return device_error(e, "allocating the call's workspace (cudaMallocAsync)");
  const Status s = body(static_cast<char*>(scratch));
  e = cudaFreeAsync(scratch, stream);
  if (s.ok() && e != cudaSuccess) return device_error(e, "freeing the call's workspace (cudaFreeAsync)");
  return s;
}

/// Runs body(workspace) on the caller's workspace `given` when it has one, else on
/// stream-ordered scratch (with_workspace). A given workspace under `bytes` is
/// kWorkspaceTooSmall, naming the size to ask for and `size_fn`, the function that reports it.
template <class Body>
Status with_call_workspace(const Workspace& given, size_t bytes, const char* size_fn, cudaStream_t stream,
                           Body&& body) {
  char* ws = static_cast<char*>(given.data);
  if (ws == nullptr) return with_workspace(bytes, stream, body);
  if (given.bytes < bytes) {
    std::ostringstream os;
    os << "workspace has " << given.bytes << " bytes, this call needs " << bytes << " (ask " << size_fn << ")";
    return Status(StatusCode::kWorkspaceTooSmall, os.str());
  }
  return body(ws);
}

/// Makes device.index current for the call and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    (void)cudaGetDevice(&previous_);
    if (previous_ != index) (void)cudaSetDevice(index);
  }
  ~DeviceGuard() {
    int now = -1;
    (void)cudaGetDevice(&now);
    if (now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace cuda
}  // namespace fusedce
