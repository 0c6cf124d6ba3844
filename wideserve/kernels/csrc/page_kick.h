// Page kicks (docs/cpu_kernels.md, "Page kicks"): a weight stream read from memory is bound,
// per core, by the L1 fill buffers its misses and software prefetches hold (~16 lines in flight
// at DRAM latency). The L2 streamer fetches ahead without them, but only within a 4 KiB page,
// and it starts on a page only after the first misses there. Asking for the first lines of each
// page a little ahead of the reads (into L2) starts it early, at two prefetches a page instead
// of sixty-four.
#pragma once

#include <cstdint>

namespace wideserve_kick {

constexpr int64_t kPageBytes = 4096, kLineBytes = 64;
constexpr int kLines = 2;   // lines asked for at each page start (1-4 measured alike)

// Asks for the first kLines lines of every page that starts in [from, from + bytes) into L2.
inline void pages(const void* from, int64_t bytes) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(from), hi = lo + bytes;
  for (uintptr_t page = (lo + kPageBytes - 1) & ~uintptr_t(kPageBytes - 1); page < hi;
       page += kPageBytes)
    for (int l = 0; l < kLines; ++l)
      __builtin_prefetch(reinterpret_cast<const void*>(page + kLineBytes * l), 0, 2);
}

}  // namespace wideserve_kick
