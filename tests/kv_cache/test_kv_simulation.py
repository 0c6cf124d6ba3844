"""A fake model writes position/prefix codes through the manager's block tables into the real
(slab-aliased) KV tensors; every read a real model would make is checked against the truth.

This proves, end to end over a random workload (chunked prefill, shared prefixes, drafts that
get rejected, preemption, eviction), that prefix hits hold the right entries, that sliding
pages are freed only once no query reads them, that shared/cached blocks are never
overwritten with different content, and that groups sharing slabs never clobber each other.
"""
from __future__ import annotations

import random

import pytest
import torch
from kv_testing import FULL, SLIDING, make_request

from wideserve.config import CacheConfig
from wideserve.kv_cache.groups import (allocate_kv_tensors, build_kv_cache_config,
                                       exact_replay_tokens)
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.kv_cache.spec import KVCacheSpec

F32 = torch.float32
L = 16


def specs() -> dict[str, KVCacheSpec]:
    win = KVCacheSpec(SLIDING, "window", 2, F32, window=6)          # 8-position pages, 64 B
    state = KVCacheSpec(SLIDING, "state", 2, F32, window=8)         # 8-position pages, 64 B
    c8 = KVCacheSpec(FULL, "compressed", 8, F32, compress_ratio=8)  # 2 entries x 32 B = 64 B
    c4 = KVCacheSpec(FULL, "indexer", 2, F32, compress_ratio=4)     # 4 x 8 B
    kv = KVCacheSpec(FULL, "kv", 2, F32)                            # 16 x 8 B
    return {"l0.w": win, "l0.s": state, "l0.c8": c8, "l0.c4": c4,
            "l1.w": win, "l1.c8": c8, "l1.kv": kv, "l2.w": win}


def codes(tokens: list[int]) -> list[int]:
    """codes[p] identifies tokens[0..p] (what a position's KV depends on)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 31 + t + 1) % (1 << 20)
        out.append(h)
    return out


class FakeModel:
    def __init__(self, mgr: KVCacheManager, kv: dict[str, torch.Tensor]) -> None:
        self.mgr, self.kv = mgr, kv
        self.names = list(kv)
        self.valid_from: dict[str, int] = {}       # replay start: windows below are rebuilt

    def _entry(self, name: str, rid: str, pos: int, write: bool):
        cfg = self.mgr.kv_config
        g = cfg.groups[cfg.cache_group[name]]
        mgr = self.mgr.managers[g.group_id]
        block = mgr.pool.blocks[mgr.req_tables[rid][pos // g.block_size]]
        assert not block.is_null, (name, rid, pos)
        slot = block.block_id * g.entries_per_block + (pos % g.block_size) // g.compress_ratio
        return self.kv[name].view(-1, self.kv[name].shape[-1])[slot], block, g

    def expected(self, name: str, prefix_codes: list[int], end: int) -> list[float]:
        return [end + 1 + 1024 * self.names.index(name), prefix_codes[end]]

    def step(self, req, start: int, n: int) -> None:
        rid, toks = req.request_id, codes(req.all_token_ids + req.spec_token_ids)
        ws = self.mgr.kv_write_start(rid)
        cfg = self.mgr.kv_config
        for name in self.names:
            g = cfg.groups[cfg.cache_group[name]]
            m = g.compress_ratio
            # Reads: FULL entries completed before `start`; the first query's window.
            lo = 0 if not g.is_sliding else max(self.valid_from.get(rid, 0),
                                                 start - g.spec.window + 1)
            for end in range(lo, start):
                if (end + 1) % m == 0:
                    row, _, _ = self._entry(name, rid, end, write=False)
                    assert row[:2].tolist() == self.expected(name, toks, end), (name, rid, end)
            for end in range(start, start + n):
                if (end + 1) % m or (not g.is_sliding and end < ws):
                    continue
                row, block, _ = self._entry(name, rid, end, write=True)
                value = self.expected(name, toks, end)
                if block.block_hash is not None or block.ref_cnt > 1:
                    assert row[:2].tolist() == value, ("shared block rewritten", name, end)
                row[:2] = torch.tensor(value)


def run_workload(mode: str, seed: int, num_blocks: int) -> KVCacheManager:
    rng = random.Random(seed)
    sp = specs()
    cc = CacheConfig(block_size=L, num_blocks_override=num_blocks, prefix_window_mode=mode)
    cfg = build_kv_cache_config(sp, cc)
    mgr = KVCacheManager(cfg, cc, max_model_len=512,
                         replay_tokens=exact_replay_tokens(sp, replay_depth=3))
    model = FakeModel(mgr, allocate_kv_tensors(cfg, "cpu"))
    bases = [[rng.randrange(5) for _ in range(rng.randint(10, 60))] for _ in range(4)]
    waiting, running, finished, target = [], [], 0, {}
    for i in range(40):
        base = rng.choice(bases)
        suffix = [rng.randrange(5) for _ in range(rng.randint(0, 20))]
        toks = base[:rng.randint(1, len(base))] + suffix
        r = make_request(f"r{i}", toks)
        target[r.request_id] = r.num_tokens + rng.randint(1, 25)
        waiting.append(r)
    while waiting or running:
        # Running requests: decode (with drafts sometimes) or continue their prefill.
        for r in list(running):
            if r.num_computed_tokens == r.num_tokens and rng.random() < 0.3:
                r.spec_token_ids = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
            n = min(rng.randint(1, 24), r.num_tokens_with_spec - r.num_computed_tokens)
            if mgr.allocate_slots(r, n, num_lookahead_tokens=rng.choice([0, 2])) is None \
                    or rng.random() < 0.03:
                running.remove(r)                   # preempt: recompute later
                mgr.free(r)
                r.num_computed_tokens, r.spec_token_ids = 0, []
                waiting.insert(0, r)
                continue
            model.step(r, r.num_computed_tokens, n)
            r.num_computed_tokens += n
            drafts = r.num_computed_tokens - r.num_tokens
            if drafts > 0:                          # verify: accept a prefix of the drafts
                accepted = rng.randint(0, drafts)
                r.num_computed_tokens -= drafts - accepted
                r.append_output_token_ids(r.spec_token_ids[:accepted])
                r.spec_token_ids = []
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids([codes(r.all_token_ids)[-1] % 5])
            if r.num_tokens >= target[r.request_id]:
                running.remove(r)
                mgr.free(r)
                finished += 1
        # Admit from the head of the queue.
        while waiting and len(running) < 4:
            r = waiting[0]
            blocks, hit = mgr.get_computed_blocks(r)
            n = min(rng.randint(1, 24), r.num_tokens - hit)
            if mgr.allocate_slots(r, n, blocks, hit) is None:
                if not running:
                    raise AssertionError("a request does not fit an empty cache")
                break
            waiting.pop(0)
            # Bounded replay rebuilds windows from the replay start; "keep" hits hold them.
            model.valid_from[r.request_id] = hit if mode == "replay" else 0
            r.num_computed_tokens = hit
            model.step(r, hit, n)
            r.num_computed_tokens += n
            running.append(r)
        mgr.check_integrity()
    assert finished == 40
    counts = mgr.check_integrity()
    assert all(c["used"] == 0 for c in counts.values())
    return mgr


@pytest.mark.parametrize("mode", ["keep", "replay"])
@pytest.mark.parametrize("seed,num_blocks", [(0, 60), (1, 24), (2, 200)])
def test_random_workload_reads_what_was_written(mode, seed, num_blocks):
    mgr = run_workload(mode, seed, num_blocks)
    assert mgr.kv_config.buckets[0].group_ids == (0, 1, 2)   # window, state and c8 share slabs
    if num_blocks >= 60:
        assert mgr.stats.hits > 0
