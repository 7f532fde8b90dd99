// The "backend under test": where the tests' buffers live and which fusedce::Device the entry
// points are called with. Every test that runs fusedce goes through this interface, so the same
// test body runs on the CPU (host memory) and, once a CUDA test backend is compiled in
// (backend_cuda.cu defining cuda_test_backend(), picked by CMakeLists.txt), on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fusedce/types.h"

namespace fusedce_test {

enum class BackendKind { kCpu, kCuda };

/// Short readable name for generated test names ("cpu", "cuda").
const char* backend_name(BackendKind kind);

/// Every backend kind the parameterised suites are instantiated for. Kinds whose backend is not
/// available in this build or on this machine are still instantiated and skip at run time.
std::vector<BackendKind> all_backends();

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  /// The handle the entry points are called with.
  virtual fusedce::Device device() const = 0;
  /// Memory on the backend's device; never null (at least one byte is allocated).
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* ptr) = 0;
  virtual void copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  /// Waits until work enqueued on device() is finished.
  virtual void synchronize() = 0;
  /// CUDA graph capture of what the entry points enqueue on device(): capture_begin starts a
  /// global-mode capture (torch.cuda.graph's default), capture_end instantiates the graph
  /// (*nodes: its top-level node count), replay launches it and waits. false, with the reason,
  /// where the backend has no graphs or a step fails. Buffers must not be touched in between.
  virtual bool capture_begin(std::string* why) {
    *why = "no graph capture on this backend";
    return false;
  }
  virtual bool capture_end(size_t* nodes, std::string* why) {
    (void)nodes;
    *why = "no graph capture on this backend";
    return false;
  }
  virtual bool replay(std::string* why) {
    *why = "no graph capture on this backend";
    return false;
  }
};

/// The backend of `kind`, or nullptr with the reason in *why_not (not built with that backend,
/// or no device on this machine).
Backend* find_backend(BackendKind kind, std::string* why_not);

/// Defined by backend_cpu.cpp.
Backend* cpu_test_backend();
/// Defined by backend_no_cuda.cpp (returns nullptr) or, in CUDA builds, by the CUDA test backend.
Backend* cuda_test_backend(std::string* why_not);

/// Owned memory on a backend's device, with host <-> device copies at byte offsets.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& backend, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// A buffer holding a copy of host bytes.
  static DeviceBuffer from_host(Backend& backend, const void* src, size_t bytes);
  template <typename T>
  static DeviceBuffer from_vector(Backend& backend, const std::vector<T>& v) {
    return from_host(backend, v.data(), v.size() * sizeof(T));
  }

  void* data() const { return ptr_; }
  /// Pointer `bytes` into the buffer.
  void* at(size_t bytes) const { return static_cast<char*>(ptr_) + bytes; }
  size_t bytes() const { return bytes_; }

  void upload(const void* src, size_t bytes, size_t offset = 0);
  void download(void* dst, size_t bytes, size_t offset = 0) const;
  /// Sets every byte to `value` (through copies from a small host block, so a backend needs no
  /// memset of its own and large buffers need no host copy).
  void fill(uint8_t value);
  std::vector<uint8_t> to_host() const;
  template <typename T>
  std::vector<T> to_host_as() const {
    std::vector<T> v(bytes_ / sizeof(T));
    download(v.data(), v.size() * sizeof(T));
    return v;
  }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace fusedce_test
