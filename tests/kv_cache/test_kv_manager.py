from __future__ import annotations

import math

import pytest
import torch
from kv_testing import FULL, SLIDING, make_manager, make_request, run_prefill, v4_specs

from wideserve.kv_cache.groups import bounded_blocks_per_request, exact_replay_tokens
from wideserve.kv_cache.hashing import sub_block_key
from wideserve.kv_cache.spec import KVCacheSpec

F32 = torch.float32


def kv_specs(n: int = 2) -> dict[str, KVCacheSpec]:
    return {f"l{i}.kv": KVCacheSpec(FULL, "kv", 8, F32) for i in range(n)}


def ids(blocks) -> list[list[int]]:
    """Block ids per group of a KVCacheBlocks."""
    return [[b.block_id for b in group] for group in blocks.blocks]


def lengths(mgr, request_id: str) -> list[int]:
    """Blocks per group in a request's block-table rows."""
    return [len(row) for row in mgr.block_rows(request_id)]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * i) % 50_000 for i in range(n)]


def test_hits_last_token_never_a_hit_and_shared_blocks():
    mgr, _ = make_manager(kv_specs(), num_blocks=40)
    a = make_request("a", prompt(1024))
    run_prefill(mgr, a, chunk=300)
    a_ids = mgr.block_ids("a")[0]
    mgr.free(a)
    b = make_request("b", prompt(1024))
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 768                                   # not 1024: the last token is computed
    assert ids(blocks) == [a_ids[:3]]
    # b's new block is a never-cached one: hashless free blocks are reused first.
    assert ids(mgr.allocate_slots(b, 256, blocks, hit))[0] != a_ids[3:]
    assert mgr.block_ids("b")[0][:3] == a_ids[:3]
    c = make_request("c", prompt(600) + [1] * 100)
    assert mgr.get_computed_blocks(c)[1] == 512
    d = make_request("d", prompt(1024) + [5])
    _, hit_d = mgr.get_computed_blocks(d)
    assert hit_d == 1024                                # a's 4th block is still cached
    c_blocks, c_hit = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 700 - c_hit, c_blocks, c_hit) is not None
    for block in c_blocks.blocks[0]:
        assert block.ref_cnt == 2                       # shared by b and c
    assert mgr.check_integrity()[0]["used"] == 4 + 3 - 2   # b: 4, c: 3 of which 2 shared
    mgr.free(b)
    mgr.free(c)
    counts = mgr.check_integrity()[0]
    assert counts["used"] == 0 and counts["free"] + counts["cached"] == 39


def two_bucket_specs() -> dict[str, KVCacheSpec]:
    return {"a.kv": KVCacheSpec(FULL, "kv", 8, F32),                       # 8 KiB pages
            "b.idx": KVCacheSpec(FULL, "indexer", 4, F32, compress_ratio=4)}  # 1 KiB pages


def test_hit_is_capped_by_the_shortest_group_and_lru_evicts_the_tail():
    mgr, cfg = make_manager(two_bucket_specs(), num_blocks=9)
    assert len(cfg.buckets) == 2
    a = make_request("a", prompt(1100))
    run_prefill(mgr, a)
    a_ids = mgr.block_ids("a")
    mgr.free(a)
    pool_b = mgr.pools[cfg.groups[1].bucket_id]
    # Pressure in bucket b only: take the hashless blocks plus one more and give them back.
    hashless = sum(blk.block_hash is None for blk in pool_b.free_queue)
    taken = pool_b.get_new_blocks(hashless + 1)
    assert taken[-1].block_id == a_ids[1][3]            # a's last full block goes first
    pool_b.free_blocks(taken)
    mgr.check_integrity()
    b = make_request("b", prompt(1100))
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 3 * 256
    assert ids(blocks) == [a_ids[0][:3], a_ids[1][:3]]


def test_v4_sliding_groups_stay_bounded_while_full_groups_grow_by_ratio():
    specs = v4_specs(n_swa=2, n_csa=2, n_hca=2)
    mgr, cfg = make_manager(specs, num_blocks=200)
    req = make_request("r", prompt(3584))
    hit_blocks, hit = mgr.get_computed_blocks(req)
    assert hit == 0
    chunk = 512

    def check(slots: int) -> None:
        c = req.num_computed_tokens
        for g, row in zip(cfg.groups, mgr.block_ids("r")):
            if not g.is_sliding:
                assert len(row) == math.ceil(slots / 256)
                entries = len(row) * g.entries_per_block
                assert math.ceil(slots / g.compress_ratio) <= entries
                assert entries < math.ceil(slots / g.compress_ratio) + g.entries_per_block
            else:
                # Pages the next query reads are live; pages below are null or freed at the
                # request's next page allocation (lazily, never early).
                first = max(0, c - g.spec.window + 1) // g.block_size
                assert 0 not in row[first:]
                assert row[:row.count(0)] == [0] * row.count(0)
                assert len(row) == math.ceil(slots / g.block_size)
                if slots - c == 1:
                    assert len(row) - row.count(0) <= bounded_blocks_per_request(g)

    assert mgr.allocate_slots(req, chunk, hit_blocks, 0) is not None
    check(chunk)
    req.num_computed_tokens = chunk
    while req.num_computed_tokens < req.num_tokens:
        assert mgr.allocate_slots(req, chunk) is not None
        check(req.num_computed_tokens + chunk)
        req.num_computed_tokens += chunk
    for i in range(512):                                # decode to 4,096 tokens
        req.append_output_token_ids([i % 97])
        assert mgr.allocate_slots(req, 1) is not None
        check(req.num_computed_tokens + 1)
        req.num_computed_tokens += 1
        if i % 128 == 0:
            mgr.check_integrity()
    assert req.num_computed_tokens == 4096
    rows = {(g.spec.role, g.compress_ratio, g.spec.window): row
            for g, row in zip(cfg.groups, mgr.block_ids("r"))}
    # Ratios predict the growing groups: 16 pages of 64 (CSA) or 2 (HCA) entries.
    csa = next(g for g in cfg.groups if g.compress_ratio == 4)
    assert len(rows[("compressed", 4, 0)]) == 16 and csa.entries_per_block * 16 == 4096 // 4
    assert len(rows[("indexer", 4, 0)]) == 16
    assert len(rows[("compressed", 128, 0)]) == 16 and 16 * 2 == 4096 // 128
    # Sliding groups hold a bounded number of pages: the last query (at 4095) reads
    # 3969..4095, page 31; page 30 is freed at the next page allocation at the latest.
    for g, row in zip(cfg.groups, mgr.block_ids("r")):
        if g.is_sliding:
            assert len(row) - row.count(0) <= bounded_blocks_per_request(g)
    window_row = rows[("window", 1, 128)]
    assert window_row[31] and window_row[:30] == [0] * 30
    req.append_output_token_ids([1] * 128)
    assert mgr.allocate_slots(req, 128) is not None        # a new page: lazy frees happen
    window_row = mgr.block_ids("r")[window_group(cfg).group_id]
    assert window_row[:31] == [0] * 31 and window_row[31] and window_row[32]
    mgr.free(req)
    counts = mgr.check_integrity()
    assert all(c["used"] == 0 for c in counts.values())


def window_group(cfg):
    return next(g for g in cfg.groups if g.spec.role == "window")


def test_keep_mode_hit_needs_windows_in_every_sliding_group():
    specs = v4_specs(n_swa=1, n_csa=1, n_hca=1)
    mgr, cfg = make_manager(specs, num_blocks=400)
    a = make_request("a", prompt(2000))
    run_prefill(mgr, a, chunk=512)
    mgr.free(a)
    b = make_request("b", prompt(2000))
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 7 * 256
    for g, row in zip(cfg.groups, blocks.blocks):
        ppl = 256 // g.block_size
        assert len(row) == 7 * ppl
        if g.is_sliding:
            need = math.ceil((g.spec.window - 1) / g.block_size)
            assert all(x.is_null for x in row[:-need]) and not any(x.is_null for x in row[-need:])
            assert row[-1].block_hash == sub_block_key(b.block_hashes[6], ppl - 1) if ppl > 1 \
                else row[-1].block_hash == b.block_hashes[6]
    # Lose the window page before position 1792: the hit falls back to 1536 in every group.
    window_group = next(g for g in cfg.groups if g.spec.role == "window")
    mgr.pools[window_group.bucket_id]._evict(blocks.blocks[window_group.group_id][-1])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 6 * 256
    assert [len(r) for r in blocks.blocks] == [6 * 256 // g.block_size for g in cfg.groups]
    assert mgr.allocate_slots(b, 2000 - hit, blocks, hit) is not None
    assert mgr.kv_write_start("b") == 0
    mgr.check_integrity()


def test_replay_mode_arithmetic():
    specs = v4_specs(n_swa=1, n_csa=1, n_hca=1)
    R = exact_replay_tokens(specs, replay_depth=3)
    assert R == 3 * 127
    with pytest.raises(ValueError, match="replay_tokens"):
        make_manager(specs, num_blocks=10, mode="replay")
    mgr, cfg = make_manager(specs, num_blocks=400, mode="replay", replay_tokens=R)
    a = make_request("a", prompt(2000))
    run_prefill(mgr, a, chunk=512)
    a_rows = mgr.block_ids("a")
    mgr.free(a)
    full_ids = {g.group_id for g in cfg.groups if not g.is_sliding}
    for pool in mgr.pools:
        assert {grp for (_, grp) in pool.cached} <= full_ids      # windows are never cached
    b = make_request("b", prompt(2000))
    blocks, computed = mgr.get_computed_blocks(b)
    P = 7 * 256
    assert computed == P - R == 1411
    for g, row in zip(cfg.groups, blocks.blocks):
        if g.is_sliding:
            assert len(row) == 1411 // g.block_size and all(x.is_null for x in row)
        else:
            assert [x.block_id for x in row] == a_rows[g.group_id][:7]
    with pytest.raises(ValueError, match="expected 1411"):
        mgr.allocate_slots(b, 2000 - P, blocks, P)
    new = mgr.allocate_slots(b, 2000 - computed, blocks, computed)
    assert mgr.kv_write_start("b") == P
    for g, row in zip(cfg.groups, new.blocks):
        expect = math.ceil(2000 / g.block_size) - (7 if not g.is_sliding else 1411 // g.block_size)
        assert len(row) == expect
    assert mgr.stats.hits == 1411 and mgr.stats.replayed == R
    # A hit shorter than the replay: recompute everything, still reuse the cached entries.
    c = make_request("c", prompt(300))
    blocks, computed = mgr.get_computed_blocks(c)
    assert computed == 0
    assert [len(blocks.blocks[g]) for g in sorted(full_ids)] == [1] * len(full_ids)
    assert mgr.allocate_slots(c, 300, blocks, 0) is not None
    assert mgr.kv_write_start("c") == 256
    mgr.free(b)
    mgr.free(c)
    assert mgr.kv_write_start("b") == 0
    mgr.check_integrity()


def three_group_specs() -> dict[str, KVCacheSpec]:
    # Bucket 0: kv (256 x 32 B) and idx (64 x 128 B) pages are both 8 KiB; bucket 1: 4 KiB.
    return {"l0.kv": KVCacheSpec(FULL, "kv", 8, F32),
            "l0.idx": KVCacheSpec(FULL, "indexer", 32, F32, compress_ratio=4),
            "l0.small": KVCacheSpec(FULL, "small", 4, F32)}


def test_allocation_is_atomic_across_buckets():
    mgr, cfg = make_manager(three_group_specs(), num_blocks=7)
    assert [b.group_ids for b in cfg.buckets] == [(0, 1), (2,)]
    a = make_request("a", prompt(400))
    run_prefill(mgr, a)
    assert mgr.free_blocks_per_bucket == [2, 4]
    before = mgr.check_integrity()
    b = make_request("b", prompt(400, seed=3))
    blocks, hit = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 400, blocks, hit) is None        # bucket 0 short by 2
    assert mgr.check_integrity() == before and mgr.block_ids("b") == [[], [], []]
    assert mgr.stats.requests == 1                                # failed admission not counted
    a.append_output_token_ids([1] * 400)
    assert mgr.allocate_slots(a, 400) is None                     # a running request too
    assert lengths(mgr, "a") == [2, 2, 2] and mgr.check_integrity() == before
    assert mgr.allocate_slots(b, 200, blocks, hit) is not None    # one logical block fits
    assert mgr.free_blocks_per_bucket == [0, 3] and mgr.usage == 1.0
    mgr.free(a)
    mgr.free(b)
    assert all(c["used"] == 0 for c in mgr.check_integrity().values())


def test_evictable_hit_blocks_count_against_free_space():
    mgr, _ = make_manager(kv_specs(1), num_blocks=5)
    a = make_request("a", prompt(769))
    run_prefill(mgr, a)
    a_ids = mgr.block_ids("a")[0]
    mgr.free(a)
    b = make_request("b", prompt(769))
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 768 and mgr.num_free_blocks == 4
    assert mgr.allocate_slots(b, 1, blocks, hit) is not None      # 3 hits + 1 new = all 4
    assert mgr.block_ids("b")[0][:3] == a_ids[:3]
    c = make_request("c", prompt(1025))
    blocks, hit = mgr.get_computed_blocks(c)
    assert hit == 768 and mgr.allocate_slots(c, 1025 - 768, blocks, hit) is None
    mgr.check_integrity()


def test_draft_and_lookahead_tokens_are_never_cached():
    mgr, _ = make_manager(kv_specs(1), num_blocks=10)
    req = make_request("r", prompt(250))
    blocks, hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 250, blocks, hit, num_lookahead_tokens=10) is not None
    assert lengths(mgr, "r") == [2]
    req.num_computed_tokens = 250
    req.append_output_token_ids([1])
    req.spec_token_ids = [2] * 6                       # 251 + 6 drafts cross the block end
    assert mgr.allocate_slots(req, 7, num_lookahead_tokens=6) is not None
    req.num_computed_tokens += 7                       # optimistic: 257
    assert req.block_hashes == []                      # drafts are not hashed
    req.num_computed_tokens -= 6                       # all drafts rejected: 251
    req.spec_token_ids = []
    req.append_output_token_ids([3])
    assert mgr.allocate_slots(req, 1) is not None
    assert not mgr.pools[0].cached
    req.num_computed_tokens += 1
    req.append_output_token_ids([4, 5, 6, 7])          # 256 verified tokens, 252 computed
    assert mgr.allocate_slots(req, 4) is not None
    assert not mgr.pools[0].cached
    req.num_computed_tokens += 4
    req.append_output_token_ids([8])
    assert mgr.allocate_slots(req, 1) is not None      # now block 0 is computed: published
    assert list(mgr.pools[0].cached.values()) == [mgr.pools[0].blocks[mgr.block_ids("r")[0][0]]]


def test_stats_reset_and_preemption_resume():
    mgr, _ = make_manager(kv_specs(1), num_blocks=12)
    a = make_request("a", prompt(1000))
    blocks, hit = mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 600, blocks, hit) is not None
    a.num_computed_tokens = 600
    mgr.free(a)                                        # preempted after 600 tokens
    a.num_computed_tokens = 0
    blocks, hit = mgr.get_computed_blocks(a)
    assert hit == 512                                  # its computed full blocks were kept
    assert mgr.allocate_slots(a, 1000 - hit, blocks, hit) is not None
    stats = mgr.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 2000, 512)
    assert stats.hit_rate == pytest.approx(512 / 2000)
    assert not mgr.reset_prefix_cache()                # a is running
    a.num_computed_tokens = 1000
    mgr.free(a)
    assert mgr.reset_prefix_cache() and mgr.stats.resets == 1
    assert mgr.get_computed_blocks(make_request("x", prompt(1000)))[1] == 0
    mgr.check_integrity()


def test_caching_disabled_and_api_errors():
    mgr, _ = make_manager(kv_specs(1), num_blocks=12, enable_prefix_caching=False,
                          max_model_len=600)
    a = make_request("a", prompt(1000))
    blocks, hit = mgr.get_computed_blocks(a)
    assert hit == 0 and blocks.num_blocks == 0
    assert mgr.allocate_slots(a, 1000, blocks, 0) is not None
    assert lengths(mgr, "a") == [3]        # capped at max_model_len = 600
    with pytest.raises(ValueError, match="already holds"):
        mgr.get_computed_blocks(a)
    with pytest.raises(ValueError, match="admission only"):
        mgr.allocate_slots(a, 1, blocks, 5)
    with pytest.raises(ValueError, match="negative"):
        mgr.allocate_slots(a, -1)
    a.num_computed_tokens = 600
    mgr.free(a)
    assert not any(p.cached for p in mgr.pools) and a.block_hashes == []
    mgr.free(a)                                        # freeing twice is harmless


def test_sliding_block_ids_use_the_null_block():
    specs = {"w": KVCacheSpec(SLIDING, "window", 4, F32, window=16)}
    mgr, cfg = make_manager(specs, num_blocks=50, block_size=64)
    assert cfg.groups[0].block_size == 16
    req = make_request("r", prompt(100))
    run_prefill(mgr, req, chunk=40)
    assert mgr.allocate_slots(req, 1) is not None          # fits: no work (lazy frees)
    assert mgr.block_ids("r")[0][:4] == [0] * 4 and mgr.block_ids("r")[0][4]
    req.append_output_token_ids([1] * 13)
    assert mgr.allocate_slots(req, 13) is not None         # page 7 needed: frees first
    # Next query at 100 reads 85..100: pages 5 and 6 live, 0..4 null.
    assert mgr.block_ids("r")[0][:5] == [0] * 5 and 0 not in mgr.block_ids("r")[0][5:]
    mgr.free(req)
    mgr.check_integrity()


def test_fast_path_still_frees_a_finished_prefill_chunk():
    specs = {"w": KVCacheSpec(SLIDING, "window", 4, F32, window=128),
             "kv": KVCacheSpec(FULL, "kv", 4, F32)}
    # No prefix caching: publishing computed blocks would also take the slow path.
    mgr, cfg = make_manager(specs, num_blocks=40, enable_prefix_caching=False)
    req = make_request("r", prompt(2000))
    run_prefill(mgr, req)                                # one 2,000-token chunk
    assert lengths(mgr, "r") == [16, 8]      # 2,048 slots: decode fits
    req.append_output_token_ids([1])
    assert mgr.allocate_slots(req, 1).num_blocks == 0    # nothing new to allocate ...
    w = mgr.block_ids("r")[0]
    assert w[:14] == [0] * 14 and all(w[14:])            # ... but the chunk's pages are freed
    req.num_computed_tokens += 1
    for _ in range(40):                                  # steady decode: at most 1 page lags
        req.append_output_token_ids([1])
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        w = mgr.block_ids("r")[0]
        assert len(w) - w.count(0) <= bounded_blocks_per_request(cfg.groups[0])
    mgr.free(req)
    mgr.check_integrity()
