"""The C++ paged attention op (wideserve/kernels/csrc/paged_attention.cpp) against the
per-request reference op (layers/attention/paged_attention.py), on random schedules.

Caches start as NaN and the harness poisons entries that left a sliding window, so reading an
unwritten, stale or out-of-window slot shows up as NaN; reading another request's entries as a
mismatch. Each step runs the reference (which writes the step's entries), then the op over the
same cache, in its AVX512 form and its portable form (`portable=True`); a head dim that is not
a multiple of 16 takes the portable loop in both.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from paged_harness import PagedHarness
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.kernels.loader import build
from wideserve.layers.attention import paged_attention_batched as pab
from wideserve.layers.attention.paged_attention import paged_attention

NAME = "attn"
# Worst |difference| to the reference: fp32 throughout, and bf16 q/k/v/cache (outputs are
# rounded to bf16 by both; the reference's softmax also runs on bf16 scores).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    build()      # a build failure is a test failure, never a skip


class _Specs:
    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec

    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {NAME: self.spec}


def make_harness(kv_heads: int, head_dim: int, window: int | None, dtype: torch.dtype,
                 max_reqs: int, max_len: int, block_size: int) -> PagedHarness:
    width = 2 * kv_heads * head_dim
    spec = (KVCacheSpec(CacheKind.FULL, "kv", width, dtype) if window is None else
            KVCacheSpec(CacheKind.SLIDING_WINDOW, "kv", width, dtype, window=window))
    h = PagedHarness(_Specs(spec), max_reqs=max_reqs, max_len=max_len, block_size=block_size)
    h.kv_caches[NAME].fill_(float("nan"))
    return h


def random_schedule(rng: np.random.Generator, reqs: int, steps: int,
                    max_len: int) -> list[list[int]]:
    """Per request, new tokens per step: 0 idle, -1 in the batch with none, 1 a decode,
    2..6 a speculative-verification-like segment, 7+ a prefill chunk."""
    schedule = []
    for _ in range(reqs):
        total, chunks = 0, []
        for _ in range(steps):
            kind = rng.integers(6)
            n = [0, -1, 1, 1, int(rng.integers(2, 7)), int(rng.integers(7, 24))][kind]
            if total == 0 and n < 1:
                n = int(rng.integers(1, 24))
            n = min(n, max_len - total) if n > 0 else n
            chunks.append(n)
            total += max(n, 0)
        schedule.append(chunks)
    return schedule


def step_qkv(t: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             g: torch.Generator, strided: bool) -> tuple[torch.Tensor, ...]:
    """A step's q [T, H, D], k and v [T, Hkv, D]; strided: views into one [T, (H+2Hkv)*D]
    tensor, as the attention layer splits its qkv GEMM output (the op reads them in place)."""
    if not strided:
        return tuple(torch.randn(t, hh, head_dim, generator=g).to(dtype)
                     for hh in (heads, kv_heads, kv_heads))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = torch.split(qkv, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
    return (q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim),
            v.view(t, kv_heads, head_dim))


def run_schedule(schedule: list[list[int]], heads: int, kv_heads: int, head_dim: int,
                 window: int | None, dtype: torch.dtype, block_size: int = 4,
                 seed: int = 0) -> float:
    """Step the reference and the op (both forms) through `schedule`; returns the worst error."""
    max_len = max(sum(max(n, 0) for n in chunks) for chunks in schedule)
    h = make_harness(kv_heads, head_dim, window, dtype, len(schedule), max_len, block_size)
    g = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    worst = 0.0
    for step in range(max(len(c) for c in schedule)):
        slots, new = [], []
        for r, chunks in enumerate(schedule):
            n = chunks[step] if step < len(chunks) else 0
            if n:
                slots.append(r)
                new.append([0] * max(n, 0))
        t = sum(len(x) for x in new)
        q, k, v = step_qkv(t, heads, kv_heads, head_dim, dtype, g, strided=seed % 2 == 1)

        def both(b):
            cache, view = b.cache(NAME)
            before = cache.clone()
            # The reference's write cannot take T = 0 (no step of the engine has no token).
            want = paged_attention(q, k, v, b, NAME, scale, window) if t else q
            outs = [pab.paged_attention_kernel(q, cache, view, b, scale, window, portable)
                    for portable in (False, True)]
            for portable in (False, True):   # the op's own write, from the cache before it
                fused = before.clone()
                outs.append(pab.paged_attention_kernel(q, fused, view, b, scale, window,
                                                       portable, k=k, v=v))
                torch.testing.assert_close(fused, cache, rtol=0, atol=0, equal_nan=True)
            return want, outs

        want, gots = h.run(slots, new, both)
        for got in gots:
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.isfinite(got).all(), f"step {step}: non-finite output"
            if t:
                worst = max(worst, (got.float() - want.float()).abs().max().item())
    assert worst <= TOL[dtype], worst
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [
    (4, 2, 64, None), (16, 4, 32, 5), (6, 2, 48, None), (3, 3, 8, 3), (8, 1, 64, 9)])
def test_random_schedules_match_reference(heads, kv_heads, head_dim, window, dtype):
    rng = np.random.default_rng(heads * 131 + head_dim)
    for seed in range(2):
        schedule = random_schedule(rng, reqs=int(rng.integers(1, 6)), steps=5, max_len=40)
        run_schedule(schedule, heads, kv_heads, head_dim, window, dtype, seed=seed)


@pytest.mark.parametrize("window", [None, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_span_many_tiles(window, dtype):
    """Contexts past the op's 128-key tile (online softmax across tiles, windows that start
    mid-tile), with 16-position blocks; decodes and a verification segment after prefills."""
    schedule = [[140, 1, 1, 5], [200, 61, 1, 1], [3, 1, 130, 1]]
    run_schedule(schedule, 4, 2, 64, window, dtype, block_size=16)


def test_edge_cases():
    """A single decode; a batch whose only request has no new token (T = 0)."""
    run_schedule([[1, 1]], 2, 1, 16, None, torch.float32)
    run_schedule([[5, -1, 1], [0, -1, -1]], 4, 2, 16, 2, torch.bfloat16)


def test_mixed_cache_and_query_dtypes():
    """fp32 queries over a bf16 cache, and bf16 queries over an fp32 cache."""
    for q_dtype, cache_dtype in ((torch.float32, torch.bfloat16),
                                 (torch.bfloat16, torch.float32)):
        h = make_harness(2, 32, None, cache_dtype, 2, 24, 4)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(9, hh, 32, generator=g).to(q_dtype) for hh in (4, 2, 2))

        def both(b):
            cache, view = b.cache(NAME)
            fused = cache.clone()
            want = paged_attention(q, k, v, b, NAME, 0.2, None)
            return want, fused, cache, [
                pab.paged_attention_kernel(q, cache, view, b, 0.2, None),
                pab.paged_attention_kernel(q, fused, view, b, 0.2, None, k=k, v=v)]

        want, fused, cache, gots = h.run([0, 1], [[0] * 7, [0] * 2], both)
        torch.testing.assert_close(fused, cache, rtol=0, atol=0, equal_nan=True)
        for got in gots:
            assert got.dtype == q_dtype
            assert (got.float() - want.float()).abs().max().item() <= TOL[torch.bfloat16]


def test_default_batched_backend_uses_the_op(monkeypatch):
    """paged_attention_batched on the CPU: the op's output and the same cache writes as the
    reference (replayed prefix positions of a FULL cache are not rewritten). A plain step
    takes the op's own write; the replay step the torch write of its rows, then the op."""
    calls = []
    kernel = pab.paged_attention_kernel
    monkeypatch.setattr(pab, "paged_attention_kernel",
                        lambda *a, **kw: calls.append("k" in kw) or kernel(*a, **kw))
    outs, caches = [], []
    for op in (paged_attention, pab.paged_attention_batched):
        h = make_harness(2, 16, None, torch.float32, 2, 24, 4)
        g = torch.Generator().manual_seed(3)

        def call(b, n, op=op, g=g):
            q, k, v = (torch.randn(n, hh, 16, generator=g) for hh in (4, 2, 2))
            return op(q, k, v, b, NAME, 0.25, None)

        h.run([0, 1], [[0] * 12, [0] * 5], lambda b: call(b, 17))
        h.seq_lens[0] = 8                  # replay positions 8..11, then 12, 13 are new
        outs.append(h.run([0, 1], [[0] * 6, [0]], lambda b: call(b, 7), kv_write_start=[12, 5]))
        caches.append(h.kv_caches[NAME])
    assert calls == [True, False]
    assert (outs[0] - outs[1]).abs().max().item() <= TOL[torch.float32]
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0, equal_nan=True)


def test_rejects_bad_metadata():
    h = make_harness(2, 16, None, torch.float32, 1, 8, 4)
    q = torch.randn(3, 4, 16)

    def call(b, table=None, lens=None):
        cache, view = b.cache(NAME)
        return torch.ops.wideserve.paged_attention(
            q, cache, view.block_table if table is None else table, None, b.query_start_loc,
            b.seq_lens if lens is None else lens, 1.0, 0, False)

    with pytest.raises(RuntimeError, match="out of range"):
        h.run([0], [[0] * 3], lambda b: call(b, table=torch.full((1, 2), 99)))
    with pytest.raises(RuntimeError, match="queries but seq_len"):
        h.run([0], [[0] * 3], lambda b: call(b, lens=torch.tensor([2])))
    with pytest.raises(RuntimeError, match="passes its block table"):
        h.run([0], [[0] * 3], lambda b: call(b, lens=torch.tensor([40])))

    def write(b, slots):
        cache, view = b.cache(NAME)
        kv = torch.randn(3, 2, 16)
        return torch.ops.wideserve.paged_attention_write(
            q, kv, kv, cache, slots, view.block_table, None, b.query_start_loc, b.seq_lens,
            1.0, 0, False)

    with pytest.raises(RuntimeError, match="past the cache"):
        h.run([0], [[0] * 3], lambda b: write(b, torch.tensor([4, 5, 10 ** 6])))
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        h.run([0], [[0] * 3], lambda b: write(b, torch.tensor([4, 5])))


def test_write_skips_negative_slots():
    """Rows whose slot is -1 are not written (the reference's rule), the others are."""
    h = make_harness(2, 16, None, torch.float32, 1, 8, 4)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, hh, 16, generator=g) for hh in (4, 2, 2))

    def call(b):
        cache, view = b.cache(NAME)
        slots = view.slot_mapping.clone()
        slots[1] = -1
        torch.ops.wideserve.paged_attention_write(
            q, k, v, cache, slots, view.block_table, None, b.query_start_loc, b.seq_lens,
            1.0, 0, False)
        return cache.view(-1, cache.shape[-1])[view.slot_mapping]

    rows = h.run([0], [[0] * 3], call)
    torch.testing.assert_close(rows[0], torch.cat((k[0].reshape(-1), v[0].reshape(-1))))
    torch.testing.assert_close(rows[2], torch.cat((k[2].reshape(-1), v[2].reshape(-1))))
    assert torch.isnan(rows[1]).all()


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.bfloat16),
                                     (torch.float32, torch.float32)])
def test_kv_write_alone_is_the_torch_write(src, dst):
    """paged_kv_write (the write of paged_attention_write, used where SDPA or the flash kernel
    attends) stores what cat + index_copy_ stored, bit for bit, from strided k/v views (a
    fused qkv output), skipping -1 slots; a slot past the cache is an error."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(37, 8 + 2 * 3, 32, generator=g).to(src)
    k, v = qkv[:, 8:11], qkv[:, 11:14]
    cache = torch.full((20, 4, 2 * 3 * 32), float("nan"), dtype=dst)
    slots = torch.randperm(80, generator=g)[:37]
    slots[5] = -1
    torch.ops.wideserve.paged_kv_write(k, v, cache, slots)
    want = torch.full_like(cache, float("nan")).view(80, -1)
    keep = slots >= 0
    want.index_copy_(0, slots[keep], torch.cat((k.reshape(37, -1), v.reshape(37, -1)),
                                               dim=-1)[keep].to(dst))
    torch.testing.assert_close(cache.view(80, -1), want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.wideserve.paged_kv_write(k, v, cache, torch.full((37,), 80))


def test_avx512_path_is_built_where_the_cpu_has_it():
    """Otherwise `portable=False` would silently test the portable loop twice."""
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    assert torch.ops.wideserve.paged_attention_has_avx512() == ("avx512f" in flags)
