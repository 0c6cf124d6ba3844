"""Zeroed host buffers for the KV pool: committed as they are first written, on transparent
huge pages where Linux offers them and they are asked for.

A large CPU buffer is a fresh anonymous mapping (`mmap`), which the kernel zero-fills page by
page at first touch: allocating the pool (1 GiB by default) costs no time and no memory until
blocks are written, where `torch.zeros` wrote every page at startup (0.3-1 s for 1 GiB on
this VM, BENCHMARKS.md "KV write in the op, lazy KV pool"). The pool's size is still the
budget: the scheduler never hands out more blocks than it holds, so what is committed grows
with the blocks in use and stops at the budget (the memory must be there when it is reached,
as before, only the moment it is taken moves from startup to first use).

The paged KV cache is read block by block from scattered places in the pool. With 4 KiB pages
each 32 KiB block spans 8 pages, and the TLB covers only a few MB: reading the cache from DRAM
then runs at ~9 GB/s on one Zen 4 core against ~15 GB/s with 2 MiB pages (docs/cpu_kernels.md,
"Paged attention"). Linux distributions mostly set THP to "madvise" (this machine too), so the
pool can ask for huge pages itself (madvise(MADV_HUGEPAGE) on the untouched mapping; each
2 MiB page is then faulted in, zeroed, at its first write). Where that is unavailable (not
Linux, THP off, a failing call, no free contiguous memory) the buffer is ordinary memory:
huge pages change speed, never contents.

Huge pages are asked for by `CacheConfig.kv_huge_pages` (passed down as `zeros(...,
huge_pages=)`); it is off by default, for the reason given at `zeros`.

Host tables (V4.1's Engram tables, `layers/engram.py`'s HostTable: hundreds of GB read a few
rows at a time at random) are allocated by `huge_page_empty`: a mapping aligned to 2 MiB and
advised for transparent huge pages, so a gathered row costs one TLB entry per 2 MiB instead of
per 4 KiB. Where THP is off ("never" in /sys/kernel/mm/transparent_hugepage/enabled), not
Linux, or the advice fails, the table is ordinary memory and one log line says why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
LAZY_MIN_BYTES = 1 << 20          # smaller buffers: torch.zeros (a mapping each is not worth it)
MADV_HUGEPAGE = 14                # <sys/mman.h> on Linux


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


def available_bytes() -> int | None:
    """The memory Linux can hand out now without swapping (MemAvailable), or None where that
    is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_pool_fits(nbytes: int, device: torch.device) -> None:
    """Refuse, at startup, a CPU KV pool larger than the memory available now. The pool is
    committed lazily (`zeros`), so without this check a budget the machine cannot back would
    be found out mid-run, when the kernel kills the process as the pages fill up."""
    if device.type != "cpu":
        return
    free = available_bytes()
    if free is not None and nbytes > free:
        gib = 1 << 30
        raise ValueError(f"the CPU KV cache needs {nbytes / gib:.2f} GiB but only "
                         f"{free / gib:.2f} GiB of memory is available; lower --kv-cache-memory "
                         f"(CacheConfig.kv_cache_memory)")


def zeros(nbytes: int, device: torch.device, huge_pages: bool = False) -> torch.Tensor:
    """A zeroed uint8 buffer of `nbytes` on `device`. On Linux CPUs a large one is a fresh
    anonymous mapping, committed page by page as it is first written (module docstring), and
    advised for huge pages when `huge_pages` (CacheConfig.kv_huge_pages). Off by default: with
    the lazy pool they no longer cost startup, but a quiet in-engine A/B (11M decode, 1 and 2
    threads) showed no throughput gain again, and the first write into each 2 MiB page took
    0.2-6 ms (compaction) against ~0.02 ms for a 4 KiB page: a stall in whichever step first
    fills it (BENCHMARKS.md "KV write in the op, lazy KV pool")."""
    if device.type != "cpu" or nbytes < LAZY_MIN_BYTES or not sys.platform.startswith("linux"):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    # The kernel zero-fills anonymous pages at their first touch; the tensor holds a reference
    # to the mapping, which lives as long as the tensor's storage.
    buf = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                           dtype=torch.uint8)
    if huge_pages:
        advise_huge_pages(buf)
    return buf


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The transparent-huge-page mode Linux runs in ("always", "madvise", "never"; the word
    in brackets of `path`), or None where that file is not there (not Linux, no THP)."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in words if w.startswith("[")]
    return chosen[0] if chosen else None


@functools.cache             # once per table kind and reason, not once per tensor
def _note_small_pages(what: str, reason: str) -> None:
    logger.info("%s: 2 MiB pages not available (%s); on 4 KiB pages", what, reason)


def on_huge_pages(t: torch.Tensor, what: str) -> torch.Tensor:
    """A copy of CPU tensor `t` on 2 MiB transparent huge pages, or `t` itself where it is
    not on the CPU, smaller than one, or they cannot be had (nothing is allocated then). For weights a decode
    step streams whole: with 4 KiB pages every 4 KiB of a gigabyte of packed experts is a TLB
    miss, and the fused experts op read them 15-18% slower at decode sizes (BENCHMARKS.md,
    "Packed experts on huge pages")."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE:      # silently: tiny models' packs
        return t
    buf = _huge_page_buffer(nbytes, what, THP_ENABLED)
    return t if buf is None else buf.view(t.dtype).view(t.shape).copy_(t)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype, what: str = "host table",
                    thp_path: str = THP_ENABLED) -> tuple[torch.Tensor, bool]:
    """A zeroed CPU tensor for a large host table, on 2 MiB transparent huge pages where the OS
    allows (module docstring). Returns (tensor, whether huge pages were asked for and
    accepted). The mapping starts on a 2 MiB boundary and is a whole number of huge pages, so
    every row of the table lies in a huge page; the kernel backs each as it is first written.
    Falling back logs one line per reason (`what` names the table)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = _huge_page_buffer(nbytes, what, thp_path)
    if buf is None:
        return torch.zeros(shape, dtype=dtype), False
    return buf.view(dtype).view(shape), True


def _huge_page_buffer(nbytes: int, what: str, thp_path: str) -> torch.Tensor | None:
    """`nbytes` of zeroed uint8 memory from a 2 MiB-aligned mapping advised for huge pages,
    or None (after one log line per reason) where they cannot be had."""
    mode = thp_mode(thp_path) if sys.platform.startswith("linux") else None
    reason = ("not Linux" if not sys.platform.startswith("linux") else
              "no transparent huge pages in this kernel" if mode is None else
              "transparent huge pages are off (THP mode 'never')" if mode == "never" else
              "smaller than one huge page" if nbytes < HUGE_PAGE else None)
    if reason is None:
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        raw = torch.frombuffer(mmap.mmap(-1, span + HUGE_PAGE,
                                         flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                               dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        buf = raw[start:start + span]            # a view: it keeps the mapping alive
        if advise_huge_pages(buf):
            return buf[:nbytes]
        reason = "madvise(MADV_HUGEPAGE) failed"
    _note_small_pages(what, reason)
    return None


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding `t`'s memory that are on transparent huge pages now
    (AnonHugePages of that VMA in /proc/self/smaps; 0 where it cannot be read)."""
    addr, found = t.data_ptr(), False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    found = lo <= addr < hi
                elif found and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
