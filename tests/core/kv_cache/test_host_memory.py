"""KV cache slabs on the CPU: zeroed, huge-page backed where Linux offers it (host_memory.py)."""
from __future__ import annotations

import sys

import torch

from wideserve.core.kv_cache import host_memory


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return int(f.read().split("AnonHugePages:")[1].split()[0])


def test_zeros_are_zero_and_sized() -> None:
    for n in (0, 1, 4097, (2 << 20) + 3, 6 << 20):
        buf = host_memory.zeros(n, torch.device("cpu"))
        assert buf.dtype == torch.uint8 and buf.numel() == n
        assert not buf.any()


def test_large_buffer_gets_huge_pages_where_thp_is_offered(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "USE_HUGE_PAGES", True)
    if not sys.platform.startswith("linux"):
        assert host_memory.zeros(8 << 20, torch.device("cpu")).numel() == 8 << 20
        return
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().split("[")[1].split("]")[0]
    before = _anon_huge_kb()
    buf = host_memory.zeros(64 << 20, torch.device("cpu"))
    gained = _anon_huge_kb() - before
    if mode == "never":
        assert gained <= 0
    else:   # at least most of the 2 MiB-aligned interior (defrag may leave a few small)
        assert gained >= 32 << 10, (mode, gained)
    assert not buf.any()


def test_switch_off_gives_plain_zeros(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "USE_HUGE_PAGES", False)
    assert not host_memory.zeros(4 << 20, torch.device("cpu")).any()
