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
  constexpr size_t kMinBytes = size_t(32) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  // Only buffers of kMinBytes or more: glibc's malloc gives each its own fresh mapping (32 MiB
  // is its largest mmap threshold), where 2 MiB pages measured 3x faster to fault in. Smaller
  // blocks come from the heap, reused or at its moving top, where the advice splits the heap's
  // mapping and measured slower (cross-entropy at 128 x 32000, 16 MiB of dlogits).
  if (data == nullptr || bytes < kMinBytes || end <= begin) return;
  // Only fresh memory: a buffer whose first page is already present was reused (a caching
  // allocator) and has no faults left to save.
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(begin), 4096, &resident) != 0 || (resident & 1) != 0) return;
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
