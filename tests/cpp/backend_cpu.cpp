// The CPU test backend: "device" memory is host memory, copies are memcpy, nothing to wait for.
#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

#include "backend.h"

namespace fusedce_test {
namespace {

class CpuBackend final : public Backend {
 public:
  BackendKind kind() const override { return BackendKind::kCpu; }
  fusedce::Device device() const override { return fusedce::Device::cpu(); }
  void* allocate(size_t bytes) override {
    // 64-byte aligned like a device allocation; the tests offset into it for unaligned views.
    // Large buffers are 2 MB aligned and asked to use huge pages: first-touch page faults of the
    // 4.3 GB case otherwise cost more than the work itself on some virtual machines.
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t align = bytes >= 4 * kHuge ? kHuge : 64;
    const size_t rounded = ((bytes == 0 ? 1 : bytes) + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
    if (align == kHuge) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    return p;
  }
  void release(void* ptr) override { std::free(ptr); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void synchronize() override {}
};

}  // namespace

Backend* cpu_test_backend() {
  static CpuBackend backend;
  return &backend;
}

}  // namespace fusedce_test
