// Asking the OS for a memory-mapped store's pages before they are read. A page fault in
// a mapped file reads a window around the fault (the device's read-ahead, 8 MB on this
// VM) and waits for it; the next fault outside it does the same. A routed expert's block
// (9.4 MB at Qwen3-30B-A3B) then comes in a few waits one after another, and the window
// reads bytes of neighbouring experts that nothing asked for (148 MB from disk a decoded
// token where 42 MB of experts were copied: docs/lab/runs/2026-12-06-disk).
// madvise(MADV_WILLNEED) over the block queues all of its reads at once and returns.
#pragma once

#include <cstdint>

#include <sys/mman.h>
#include <unistd.h>

namespace moejax {

constexpr uintptr_t kProbeStride = uintptr_t{1} << 20;

inline uintptr_t page_size() {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// Whether [p, p + bytes) looks cached: one page every kProbeStride and the last resident
// (mincore). A block is read whole, so its pages mostly come and go together; probing
// costs a few microseconds where asking for a cached 9.4 MB block cost 115 (the kernel
// looks up each of its pages).
inline bool looks_cached(const void* p, int64_t bytes) {
  const uintptr_t page = page_size(), at = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = at & ~(page - 1), last = (at + bytes - 1) & ~(page - 1);
  unsigned char v = 0;
  for (uintptr_t a = first;; a += kProbeStride) {
    a = a > last ? last : a;
    if (mincore(reinterpret_cast<void*>(a), page, &v) != 0 || !(v & 1)) return false;
    if (a == last) return true;
  }
}

// A hint that [p, p + bytes) will be read soon: unless it looks cached, its pages not in
// the page cache are read in, exactly those, without waiting. In anonymous memory (a
// store in RAM) the pages are resident and nothing is asked; a failed call is ignored.
inline void will_need(const void* p, int64_t bytes) {
  if (bytes <= 0 || looks_cached(p, bytes)) return;
  const uintptr_t from = reinterpret_cast<uintptr_t>(p), start = from & ~(page_size() - 1);
  madvise(reinterpret_cast<void*>(start), from + static_cast<uintptr_t>(bytes) - start,
          MADV_WILLNEED);
}

}  // namespace moejax
