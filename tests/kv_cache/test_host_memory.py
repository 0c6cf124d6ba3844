"""KV cache slabs on the CPU: zeroed, committed as they are first written, huge-page backed
where Linux offers it and it is asked for (host_memory.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from wideserve.kv_cache import host_memory


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_zeros_are_zero_and_sized() -> None:
    for n in (0, 1, 4097, (2 << 20) + 3, 6 << 20):
        buf = host_memory.zeros(n, torch.device("cpu"))
        assert buf.dtype == torch.uint8 and buf.numel() == n
        assert not buf.any()


def test_large_buffer_is_advised_for_huge_pages_where_thp_exists() -> None:
    """The pool's interior is marked MADV_HUGEPAGE ("hg" in its VmFlags). Whether the kernel
    then backs it with huge pages depends on free, unfragmented memory at that moment (a
    test that counted AnonHugePages failed in a full suite run), so that is not asserted."""
    buf = host_memory.zeros(64 << 20, torch.device("cpu"), huge_pages=True)
    assert not buf.any() and buf.numel() == 64 << 20
    if not (sys.platform.startswith("linux")
            and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")):
        return          # no THP in this kernel: plain memory, checked above
    interior = -(-buf.data_ptr() // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE
    assert "hg" in _vm_flags(interior + (4 << 20))
    assert host_memory.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))


def test_switch_off_gives_plain_zeros() -> None:
    assert not host_memory.zeros(4 << 20, torch.device("cpu"), huge_pages=False).any()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_large_buffer_is_committed_only_where_written() -> None:
    """Allocating the pool costs no memory (nor the time to zero it) until it is written; the
    buffer stays valid and zeroed elsewhere however it is viewed."""
    if not sys.platform.startswith("linux"):
        return          # elsewhere: torch.zeros, checked by test_zeros_are_zero_and_sized
    before = _rss_bytes()
    buf = host_memory.zeros(512 << 20, torch.device("cpu"))
    assert _rss_bytes() - before < 64 << 20
    view = buf.view(torch.bfloat16).view(1024, 64, -1)
    view[3].fill_(1.5)
    del buf
    assert (view[3] == 1.5).all() and not view[4].any()
    assert _rss_bytes() - before < 128 << 20



def test_pool_larger_than_available_memory_is_refused_at_startup(monkeypatch) -> None:
    """A lazily committed pool the machine cannot back fails when the engine starts, with an
    error naming the flag, not by the kernel killing the process mid-run."""
    from wideserve import LLM
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        LLM(None, dtype="float32", block_size=64, kv_cache_memory=1 << 26)
    host_memory.check_pool_fits(1 << 26, torch.device("meta"))       # not host memory
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    host_memory.check_pool_fits(1 << 40, torch.device("cpu"))        # unknown: no refusal


def test_available_bytes_reads_meminfo() -> None:
    free = host_memory.available_bytes()
    if sys.platform.startswith("linux"):
        assert free is not None and 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES")


def _thp() -> bool:
    return sys.platform.startswith("linux") and os.path.exists(host_memory.THP_ENABLED) \
        and host_memory.thp_mode() not in (None, "never")


def test_a_large_tensor_is_copied_onto_advised_memory() -> None:
    """on_huge_pages: the same values in a mapping advised for huge pages (whether the kernel
    then backs it with them is not asserted: see the test above)."""
    t = torch.randn(3 << 20, dtype=torch.float32).to(torch.bfloat16)     # 6 MiB
    out = host_memory.on_huge_pages(t, "test weights")
    assert torch.equal(out, t) and out.shape == t.shape and out.dtype == t.dtype
    if not _thp():
        assert out is t
        return
    assert out.data_ptr() != t.data_ptr() and out.data_ptr() % host_memory.HUGE_PAGE == 0
    assert "hg" in _vm_flags(out.data_ptr())


def test_small_or_unavailable_stays_where_it_is(monkeypatch) -> None:
    small = torch.ones(1 << 10)
    assert host_memory.on_huge_pages(small, "test weights") is small
    big = torch.ones(1 << 20)                                             # 4 MiB fp32
    monkeypatch.setattr(host_memory, "thp_mode", lambda path=None: "never")     # THP off
    assert host_memory.on_huge_pages(big, "test weights") is big
    monkeypatch.setattr(host_memory, "_huge_page_buffer", lambda nbytes, what, path: None)
    assert host_memory.on_huge_pages(big, "test weights") is big
