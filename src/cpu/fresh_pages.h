// Large buffers that a call writes in full: their first writes fault in fresh memory page by
// page, and on a VM a 4 KiB page's fault can cost more than writing it (docs/performance.md,
// "CPU memory and threads"). Where the kernel allows it, such buffers are backed by 2 MiB pages
// instead, 512 times fewer faults. A hint only: contents and results are unchanged, and a
// system without transparent huge pages (or not Linux) simply ignores it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace fusedce {
namespace cpu {

/// Asks for 2 MiB pages over the whole 2 MiB pages inside [data, data + bytes) (Linux
/// madvise(MADV_HUGEPAGE)) when the range is 32 MiB or more and its first page is not yet
/// present (fresh memory); nothing otherwise. Call it before the first write: pages already
/// present keep their size.
void prefer_huge_pages(void* data, size_t bytes);

/// For a (rows, cols) float matrix with row stride ld that the caller then overwrites in full:
/// prefer_huge_pages over its span, and when the span is fresh (32 MiB or more, first page not
/// present) its pages faulted in now, one zero written per 4 KiB page on up to max_threads
/// threads. Only a dense matrix (ld == cols) is faulted in: a strided one's gaps between rows are
/// not the caller's to write. The kernel zeroes a fresh page at its first write; taken in a pass
/// of their own, those faults do not stall the products that read and write around them.
/// Contents afterwards: unspecified.
void fault_in_fresh(float* data, int64_t rows, int64_t cols, int64_t ld, int max_threads);

/// A float32 scratch buffer of n elements, left uninitialised (every element is written before
/// it is read), with prefer_huge_pages applied.
class ScratchFloats {
 public:
  ScratchFloats() = default;
  explicit ScratchFloats(size_t n);
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  float& operator[](size_t i) { return data_[i]; }
  const float& operator[](size_t i) const { return data_[i]; }

 private:
  std::unique_ptr<float[]> data_;
};

}  // namespace cpu
}  // namespace fusedce
