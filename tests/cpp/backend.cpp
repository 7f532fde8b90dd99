// Backend registry and DeviceBuffer: the parts of the test backend shared by every device.
#include "backend.h"

#include <algorithm>
#include <utility>

#include "fusedce/version.h"

namespace fusedce_test {

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCpu: return "cpu";
    case BackendKind::kCuda: return "cuda";
  }
  return "unknown";
}

std::vector<BackendKind> all_backends() { return {BackendKind::kCpu, BackendKind::kCuda}; }

Backend* find_backend(BackendKind kind, std::string* why_not) {
  switch (kind) {
    case BackendKind::kCpu: return cpu_test_backend();
    case BackendKind::kCuda:
      if (!fusedce::built_with_cuda()) {
        *why_not = "this build of fusedce has no CUDA backend (fusedce::built_with_cuda() is false)";
        return nullptr;
      }
      return cuda_test_backend(why_not);
  }
  *why_not = "unknown backend kind";
  return nullptr;
}

DeviceBuffer::DeviceBuffer(Backend& backend, size_t bytes)
    : backend_(&backend), ptr_(backend.allocate(bytes)), bytes_(bytes) {}

DeviceBuffer::~DeviceBuffer() {
  if (backend_ != nullptr && ptr_ != nullptr) backend_->release(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : backend_(std::exchange(other.backend_, nullptr)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (backend_ != nullptr && ptr_ != nullptr) backend_->release(ptr_);
    backend_ = std::exchange(other.backend_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer DeviceBuffer::from_host(Backend& backend, const void* src, size_t bytes) {
  DeviceBuffer b(backend, bytes);
  if (bytes > 0) b.upload(src, bytes);
  return b;
}

void DeviceBuffer::upload(const void* src, size_t bytes, size_t offset) {
  if (bytes > 0) backend_->copy_to_device(at(offset), src, bytes);
}

void DeviceBuffer::download(void* dst, size_t bytes, size_t offset) const {
  if (bytes > 0) backend_->copy_to_host(dst, at(offset), bytes);
}

void DeviceBuffer::fill(uint8_t value) {
  const std::vector<uint8_t> block(std::min<size_t>(bytes_, size_t(1) << 20), value);
  for (size_t b = 0; b < bytes_; b += block.size()) upload(block.data(), std::min(block.size(), bytes_ - b), b);
}

std::vector<uint8_t> DeviceBuffer::to_host() const {
  std::vector<uint8_t> v(bytes_);
  download(v.data(), bytes_);
  return v;
}

}  // namespace fusedce_test
