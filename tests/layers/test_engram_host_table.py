"""Engram host tables on 2 MiB pages (kv_cache/host_memory.py huge_page_empty, layers/engram.py
HostTable): the mapping is 2 MiB-aligned and advised where THP allows; where it does not
(THP "never", a table under one huge page) the table is ordinary memory with one log line;
either way the contents and every gather are the same."""
from __future__ import annotations

import logging

import pytest
import torch

from wideserve.kv_cache import host_memory
from wideserve.layers.engram import HostTable
from wideserve.layers.quant import quantize_fp8_block

ROWS, DIM = 32768, 128         # 16 MiB of fp32, 4 MiB of fp8: whole huge pages


def _thp_file(tmp_path, text: str) -> str:
    path = tmp_path / "enabled"
    path.write_text(text + "\n")
    return str(path)


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    assert host_memory.thp_mode(_thp_file(tmp_path, "always [madvise] never")) == "madvise"
    assert host_memory.thp_mode(_thp_file(tmp_path, "[always] madvise never")) == "always"
    assert host_memory.thp_mode(str(tmp_path / "missing")) is None


def test_huge_page_table_is_aligned_and_advised(tmp_path):
    path = _thp_file(tmp_path, "always [madvise] never")
    t, huge = host_memory.huge_page_empty((ROWS, DIM), torch.float32, thp_path=path)
    assert huge and t.shape == (ROWS, DIM) and t.dtype == torch.float32
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert torch.count_nonzero(t) == 0                       # zeroed, like torch.zeros


def test_fallback_logs_once_and_gives_ordinary_memory(tmp_path, caplog):
    host_memory._note_small_pages.cache_clear()
    never = _thp_file(tmp_path, "always madvise [never]")
    with caplog.at_level(logging.INFO, logger=host_memory.__name__):
        a, huge_a = host_memory.huge_page_empty((ROWS, DIM), torch.float32, "t", never)
        b, huge_b = host_memory.huge_page_empty((ROWS, DIM), torch.float32, "t", never)
        small, huge_s = host_memory.huge_page_empty((4, DIM), torch.float32, "t")
    assert not (huge_a or huge_b or huge_s)
    assert a.shape == (ROWS, DIM) and torch.count_nonzero(a) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["t: 2 MiB pages not available (transparent huge pages are off (THP mode "
                     "'never')); on 4 KiB pages",
                     "t: 2 MiB pages not available (smaller than one huge page); on 4 KiB pages"]


def _tables(fp8: bool) -> tuple[HostTable, HostTable]:
    g = torch.Generator().manual_seed(0)
    data = torch.randn(ROWS, DIM, generator=g)
    out = []
    for huge in (True, False):
        table = HostTable(ROWS, DIM)
        table.huge_pages = huge
        if fp8:
            codes, scale = quantize_fp8_block(data, (1, 32))
            table.load_fp8(codes, scale)
        else:
            home = table.allocate_host((ROWS, DIM), torch.float32)
            table.weight = torch.nn.Parameter(home.copy_(data), requires_grad=False)
        out.append(table)
    return out[0], out[1]


@pytest.mark.parametrize("fp8", [False, True])
def test_gathers_are_the_same_on_either_pages(fp8):
    huge, small = _tables(fp8)
    mode = host_memory.thp_mode()
    if mode in ("always", "madvise"):      # this machine allows it: the table is on the mapping
        assert huge.weight.data_ptr() % host_memory.HUGE_PAGE == 0
    assert torch.equal(huge.weight.view(torch.uint8), small.weight.view(torch.uint8))
    ids = torch.randint(0, ROWS, (37, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(huge.gather(ids), small.gather(ids))
    assert huge.gather(ids).shape == (37, 24, DIM)


def test_the_loader_allocates_engram_tables_through_the_table(monkeypatch):
    """worker/model_loader.py asks a HostResident module for its host memory."""
    from wideserve.worker import model_loader
    seen = []
    real = HostTable.allocate_host
    monkeypatch.setattr(HostTable, "allocate_host",
                        lambda self, shape, dtype: seen.append(tuple(shape)) or
                        real(self, shape, dtype))

    class Tiny(torch.nn.Module):
        keep_in_fp32 = ()

        def __init__(self, config=None):
            super().__init__()
            self.table = HostTable(ROWS, DIM)
            self.proj = torch.nn.Linear(4, 4)

    model = model_loader.build_model(Tiny, None, torch.float32, torch.device("cpu"))
    assert seen == [(ROWS, DIM)]
    assert model.table.weight.shape == (ROWS, DIM) and model.proj.weight.shape == (4, 4)
