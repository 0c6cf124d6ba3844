"""Zeroed host buffers backed by transparent huge pages where Linux offers them.

The paged KV cache is read block by block from scattered places in a pool of hundreds of MB.
With 4 KiB pages each 32 KiB block spans 8 pages, and the TLB covers only a few MB: reading
the cache from DRAM then runs at ~9 GB/s on one Zen 4 core against ~15 GB/s with 2 MiB pages
(docs/cpu_kernels.md, "Paged attention"). Linux distributions mostly set THP to "madvise"
(this machine too), so the pool can ask for huge pages itself (madvise(MADV_HUGEPAGE) on the
untouched buffer, then zeroing it faults them in). Where that is unavailable (not Linux, THP
off, a failing call) the buffer is ordinary memory: huge pages change speed, never contents.

Off by default (`USE_HUGE_PAGES`): in the engine the 11M Qwen3-MoE decode read no faster on
them (its per-step KV is small and partly cached) while zeroing a huge-page pool added 0.6-2 s
to startup (BENCHMARKS.md, "Paged attention decode near the read roofline"); the gain in
the random-block read test above is for pools whose reads miss the TLB far more often.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14                # <sys/mman.h> on Linux
USE_HUGE_PAGES = False            # off: no gain measured in the engine, +0.6-2 s startup
                                  # (BENCHMARKS.md "Paged attention decode near the read roofline")


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MiB-aligned interior of `t`'s memory (a CPU tensor not
    yet written: pages already touched stay small). Returns whether the kernel accepted."""
    madvise = _madvise()
    if madvise is None:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    return end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0


def zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 buffer of `nbytes` on `device`; on the CPU backed by huge pages where
    possible (module docstring)."""
    if device.type != "cpu" or not USE_HUGE_PAGES or nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(buf)
    return buf.zero_()
