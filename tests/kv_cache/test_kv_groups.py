from __future__ import annotations

import functools
import math

import pytest
import torch
from kv_testing import FULL, SLIDING, v4_specs

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache.groups import (allocate_kv_tensors, bounded_blocks_per_request,
                                       build_kv_cache_config, default_block_size,
                                       exact_replay_tokens, sliding_page_size, window_pages_for_hit)
from wideserve.kv_cache.spec import KVCacheSpec

F32 = torch.float32
# The layouts below are worked out for 256-position logical blocks.
C256 = functools.partial(CacheConfig, block_size=256)


def roles(cfg):
    return [(g.spec.role, g.spec.compress_ratio, g.spec.window, len(g.names), g.block_size)
            for g in cfg.groups]


def test_v4_groups_and_page_sizes():
    cfg = build_kv_cache_config(v4_specs(), C256(num_blocks_override=10))
    assert roles(cfg) == [
        ("window", 1, 128, 43, 128),
        ("compressed", 4, 0, 21, 256),
        ("state", 1, 8, 21, 8),
        ("indexer", 4, 0, 21, 256),
        ("indexer_state", 1, 8, 21, 8),
        ("compressed", 128, 0, 20, 256),
        ("state", 1, 128, 20, 128),
    ]
    assert [g.entries_per_block for g in cfg.groups] == [128, 64, 8, 64, 8, 2, 128]
    for name, gid in cfg.cache_group.items():
        assert name in cfg.groups[gid].names
    assert sum(len(g.names) for g in cfg.groups) == len(cfg.cache_group) == 2 + 21 * 5 + 20 * 3


@pytest.mark.parametrize("quantised,per_role,total", [
    # docs/deepseek_v4.md, "KV bytes per token": bf16 CSA 320 B/tok, HCA 8 B/tok, model 6,880 B/tok;
    # fp8_ds_mla + MXFP4 indexer: CSA 163, HCA 4.5625, model 3,514.25.
    (False, {"compressed": 21 * 1024 / 4 + 20 * 1024 / 128, "indexer": 21 * 256 / 4}, 6880.0),
    (True, {"compressed": 21 * 584 / 4 + 20 * 584 / 128, "indexer": 21 * 68 / 4}, 3514.25),
])
def test_v4_flash_bytes_per_token(quantised, per_role, total):
    cfg = build_kv_cache_config(v4_specs(quantised=quantised), C256(num_blocks_override=4))
    assert cfg.bytes_per_token == pytest.approx(per_role)
    assert cfg.total_bytes_per_token == pytest.approx(total)
    window_bytes = 43 * 128 * (584 if quantised else 1024)    # ~3.1 MiB fp8 (§6.3)
    # fp32 compressor states: CSA 8 positions x 2048, HCA 128 x 1024, CSA indexer 8 x 512.
    assert cfg.bounded_bytes_per_request == {
        "window": window_bytes, "state": 21 * 8 * 2048 * 4 + 20 * 128 * 1024 * 4,
        "indexer_state": 21 * 8 * 512 * 4}


def test_block_size_must_be_multiple_of_every_ratio():
    with pytest.raises(ValueError, match=r"ratio 128.*e\.g\. block_size=128"):
        build_kv_cache_config(v4_specs(), CacheConfig(block_size=100, num_blocks_override=4))
    with pytest.raises(ValueError, match=r"multiple of 128, e\.g\. block_size=256"):
        build_kv_cache_config(v4_specs(), CacheConfig(block_size=200, num_blocks_override=4))
    cfg = build_kv_cache_config(v4_specs(), CacheConfig(block_size=512, num_blocks_override=4))
    assert [g.block_size for g in cfg.groups] == [128, 512, 8, 512, 8, 512, 128]


@pytest.mark.parametrize("window,block,page", [
    (8, 256, 8), (128, 256, 128), (100, 256, 128), (129, 256, 256), (300, 256, 256),
    (3, 256, 4), (1, 16, 1), (5, 24, 6)])
def test_sliding_page_size(window, block, page):
    spec = KVCacheSpec(SLIDING, "w", 4, F32, window=window)
    assert sliding_page_size(spec, block) == page


def shared_bucket_specs() -> dict[str, KVCacheSpec]:
    # window (128 x 1024 B pages) and ratio-2 compressed (128 entries x 1024 B) share a bucket.
    win = KVCacheSpec(SLIDING, "window", 512, torch.bfloat16, window=128)
    comp = KVCacheSpec(FULL, "compressed", 512, torch.bfloat16, compress_ratio=2)
    small = KVCacheSpec(FULL, "indexer", 16, F32, compress_ratio=4)
    specs = {f"l{i}.window": win for i in range(4)}
    specs |= {f"l{i}.compressed": comp for i in range(1, 3)}
    specs |= {f"l{i}.indexer": small for i in range(1, 3)}
    return specs


def test_buckets_and_slab_aliasing():
    cfg = build_kv_cache_config(shared_bucket_specs(), C256(num_blocks_override=6))
    assert [(b.page_bytes, b.group_ids, b.num_slabs, b.num_blocks) for b in cfg.buckets] == [
        (128 * 1024, (0, 1), 4, 6), (64 * 64, (2,), 2, 6)]
    t = allocate_kv_tensors(cfg, "cpu")
    assert t["l0.window"].shape == (6, 128, 512) and t["l0.window"].dtype == torch.bfloat16
    assert t["l1.compressed"].shape == (6, 128, 512)
    assert t["l1.indexer"].shape == (6, 64, 16) and t["l1.indexer"].dtype == F32
    assert all(int(x.abs().sum()) == 0 for x in t.values())
    # Layer j of every group in a bucket is backed by slab j.
    assert t["l1.compressed"].data_ptr() == t["l0.window"].data_ptr()
    assert t["l2.compressed"].data_ptr() == t["l1.window"].data_ptr()
    assert len({t[f"l{i}.window"].data_ptr() for i in range(4)}) == 4
    t["l1.compressed"][3] = 1.0
    assert bool((t["l0.window"][3] == 1).all()) and int(t["l0.window"][2].abs().sum()) == 0
    assert cfg.total_bytes == 6 * 4 * 128 * 1024 + 6 * 2 * 64 * 64


def test_quantised_tensors_are_bytes():
    cfg = build_kv_cache_config(v4_specs(1, 1, 1, quantised=True),
                                C256(num_blocks_override=3))
    t = allocate_kv_tensors(cfg, "cpu")
    assert t["model.layers.1.self_attn.compressed"].shape == (3, 64, 584)
    assert t["model.layers.1.self_attn.indexer"].shape == (3, 64, 68)
    assert t["model.layers.0.self_attn.window"].dtype == torch.uint8
    assert t["model.layers.1.self_attn.state"].shape == (3, 8, 2048)
    assert t["model.layers.1.self_attn.state"].dtype == F32


def test_sizing_from_budget_is_maximal_and_bounded_first():
    specs = v4_specs(2, 3, 2)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)
    budget = 96 << 20
    cfg = build_kv_cache_config(specs, C256(kv_cache_memory=budget), sched,
                                max_model_len=2048)
    assert cfg.budget_bytes == budget and cfg.total_bytes <= budget
    n_full = sum(not g.is_sliding for g in cfg.groups)
    num_logical = cfg.capacity_tokens // 256
    # One more logical block in every growing group would not fit.
    assert cfg.total_bytes + 256 * cfg.pool_bytes_per_token > budget
    for b in cfg.buckets:
        gs = [cfg.groups[g] for g in b.group_ids]
        sliding = [g for g in gs if g.is_sliding]
        full = [g for g in gs if not g.is_sliding]
        if sliding:
            # Every request at full window, one step's new tokens, and 2 x max_num_seqs
            # cached hit points ("keep" mode).
            need = sum(4 * bounded_blocks_per_request(g) + math.ceil(512 / g.block_size)
                       + 8 * window_pages_for_hit(g) for g in sliding)
            assert b.num_blocks == 1 + need + len(full) * num_logical
        else:
            assert b.num_blocks == 1 + len(full) * num_logical
    assert n_full == 3 and cfg.capacity_tokens >= 2048
    # CSA state pages (8 positions x 8 KiB) = CSA compressed pages (64 entries x 1 KiB), and
    # indexer-state pages (8 x 2 KiB) = indexer pages (64 x 256 B): buckets that hold a
    # bounded and a growing group (the split vLLM's V4 pool makes too).
    mixed = [b for b in cfg.buckets if len(b.group_ids) > 1]
    assert [[cfg.groups[g].spec.role for g in b.group_ids] for b in mixed] == [
        ["compressed", "state"], ["indexer", "indexer_state"]]
    assert cfg.pool_bytes_per_token == pytest.approx(cfg.total_bytes_per_token)
    assert "capacity" in cfg.summary()


def test_sizing_errors_and_override():
    specs = v4_specs(1, 1, 1)
    with pytest.raises(ValueError, match="sliding windows"):
        build_kv_cache_config(specs, C256(kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="max_model_len=1000000"):
        build_kv_cache_config(specs, C256(kv_cache_memory=256 << 20),
                              SchedulerConfig(max_num_seqs=2), max_model_len=1_000_000)
    cfg = build_kv_cache_config(specs, C256(num_blocks_override=9))
    assert [b.num_blocks for b in cfg.buckets] == [9] * len(cfg.buckets)
    assert cfg.capacity_tokens == 8 * 256 and cfg.budget_bytes is None


def test_only_bounded_groups_spend_the_whole_budget():
    win = KVCacheSpec(SLIDING, "window", 64, F32, window=32)
    cfg = build_kv_cache_config({"a": win, "b": win}, C256(kv_cache_memory=8 << 20))
    assert cfg.capacity_tokens is None
    assert cfg.total_bytes <= 8 << 20 and cfg.total_bytes > (8 << 20) - cfg.buckets[0].block_bytes


def test_budget_source(monkeypatch):
    specs = v4_specs(1, 1, 1)

    def boom(*a, **k):
        raise AssertionError("torch.cuda queried for a CPU cache")

    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    cfg = build_kv_cache_config(specs, C256())
    assert cfg.budget_bytes == 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2 << 30, 1 << 34))
    cfg = build_kv_cache_config(specs, C256(gpu_memory_utilization=0.5), device="cuda")
    assert cfg.budget_bytes == 1 << 30
    cfg = build_kv_cache_config(specs, C256(kv_cache_memory=512 << 20), device="cuda")
    assert cfg.budget_bytes == 512 << 20


def test_exact_replay_tokens():
    assert exact_replay_tokens(v4_specs(), replay_depth=43) == 43 * 127
    full_only = {"x": KVCacheSpec(FULL, "kv", 8, F32)}
    assert exact_replay_tokens(full_only, replay_depth=4) == 0
    with pytest.raises(ValueError):
        exact_replay_tokens(full_only, -1)


def test_default_block_size_is_the_models():
    """None = the model's: 64 positions, raised to a multiple of every compression ratio."""
    gqa = {"l0": KVCacheSpec(FULL, "kv", 64, F32), "l1": KVCacheSpec(FULL, "kv", 64, F32)}
    assert default_block_size(gqa) == 64
    assert default_block_size(v4_specs()) == 128                  # ratios 4 and 128
    assert default_block_size({"a": KVCacheSpec(FULL, "c", 8, F32, compress_ratio=3)}) == 66
    assert build_kv_cache_config(gqa, CacheConfig(num_blocks_override=4)).block_size == 64
    v4 = build_kv_cache_config(v4_specs(), CacheConfig(num_blocks_override=4))
    assert v4.block_size == 128 and {g.block_size for g in v4.groups} == {8, 128}
    assert build_kv_cache_config(gqa, C256(num_blocks_override=4)).block_size == 256
