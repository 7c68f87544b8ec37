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

// A hint that [p, p + bytes) will be read soon: its pages not in the page cache are read
// in, exactly those, without waiting. In anonymous memory (a store in RAM, slot buffers)
// it changes nothing; a failed call is ignored.
inline void will_need(const void* p, int64_t bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  if (bytes <= 0) return;
  const uintptr_t from = reinterpret_cast<uintptr_t>(p), start = from & ~(page - 1);
  madvise(reinterpret_cast<void*>(start), from + static_cast<uintptr_t>(bytes) - start,
          MADV_WILLNEED);
}

}  // namespace moejax
