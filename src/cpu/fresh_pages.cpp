#include "cpu/fresh_pages.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fusedce {
namespace cpu {

void prefer_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  // Two whole huge pages at least: a smaller range gains little and splits the mapping.
  if (data == nullptr || end < begin + 2 * kHuge) return;
  // The advice is best effort: where it is refused (no transparent huge pages, a mapping that
  // cannot take it), the buffer keeps its 4 KiB pages and nothing else changes.
  (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

ScratchFloats::ScratchFloats(size_t n) : data_(n > 0 ? new float[n] : nullptr) {
  prefer_huge_pages(data_.get(), n * sizeof(float));
}

}  // namespace cpu
}  // namespace fusedce
