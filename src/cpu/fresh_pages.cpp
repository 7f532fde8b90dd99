#include "cpu/fresh_pages.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {

namespace {

constexpr uintptr_t kHuge = uintptr_t(2) << 20;
// Only buffers of kMinBytes or more: glibc's malloc gives each its own fresh mapping (32 MiB is
// its largest mmap threshold), where 2 MiB pages measured 3x faster to fault in. Smaller blocks
// come from the heap, reused or at its moving top, where the advice splits the heap's mapping
// and measured slower (cross-entropy at 128 x 32000, 16 MiB of dlogits).
constexpr size_t kMinBytes = size_t(32) << 20;

/// Whether [data, data + bytes) is a large fresh buffer: kMinBytes or more, holding a whole
/// 2 MiB page, whose first such page is not yet present. A buffer whose first page is present
/// was reused (a caching allocator) and has no faults left to save.
bool large_and_fresh(void* data, size_t bytes) {
#if defined(__linux__)
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (data == nullptr || bytes < kMinBytes || end <= begin) return false;
  unsigned char resident = 0;
  return mincore(reinterpret_cast<void*>(begin), 4096, &resident) == 0 && (resident & 1) == 0;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

}  // namespace

void prefer_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (!large_and_fresh(data, bytes)) return;
  // The advice is best effort: where it is refused (no transparent huge pages, a mapping that
  // cannot take it), the buffer keeps its 4 KiB pages and nothing else changes.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

void fault_in_fresh(float* data, int64_t rows, int64_t cols, int64_t ld, int max_threads) {
  if (rows <= 0 || cols <= 0) return;
  const size_t count = size_t(rows - 1) * size_t(ld) + size_t(cols);
  if (!large_and_fresh(data, count * sizeof(float))) return;
  prefer_huge_pages(data, count * sizeof(float));
  if (ld != cols) return;
  constexpr size_t kPage = 4096 / sizeof(float);
  const int64_t pages = static_cast<int64_t>((count + kPage - 1) / kPage);
  parallel_for(pages, 512, max_threads, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) data[k * kPage] = 0.0f;
  });
}

ScratchFloats::ScratchFloats(size_t n) : data_(n > 0 ? new float[n] : nullptr) {
  prefer_huge_pages(data_.get(), n * sizeof(float));
}

}  // namespace cpu
}  // namespace fusedce
