from __future__ import annotations

import pytest
from kv_testing import make_manager, make_request, run_prefill, v4_specs


def busy_manager():
    """Two finished requests (cached blocks), one running that shares a prefix hit."""
    mgr, cfg = make_manager(v4_specs(n_swa=1, n_csa=1, n_hca=1), num_blocks=300)
    toks = [i % 1000 for i in range(1300)]
    for rid in ("a", "b"):
        r = make_request(rid, toks if rid == "a" else [7] * 700)
        run_prefill(mgr, r, chunk=256)
        mgr.free(r)
    c = make_request("c", toks[:1100] + [3] * 50)
    run_prefill(mgr, c, chunk=256)
    return mgr, cfg, c


def test_integrity_holds_and_counts_add_up():
    mgr, cfg, c = busy_manager()
    counts = mgr.check_integrity()
    for bucket in cfg.buckets:
        got = counts[bucket.bucket_id]
        assert got["free"] + got["cached"] + got["used"] == bucket.num_blocks - 1
        assert got["used"] > 0 and got["cached"] > 0
    mgr.free(c)
    counts = mgr.check_integrity()
    assert all(v["used"] == 0 for v in counts.values())
    assert all(v["free"] + v["cached"] == 299 for v in counts.values())


def full_group(mgr, cfg):
    return next(g for g in cfg.groups if not g.is_sliding)


def test_catches_a_wrong_ref_count():
    mgr, cfg, c = busy_manager()
    g = full_group(mgr, cfg)
    mgr.managers[g.group_id].blocks("c")[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt 3, live requests hold it 2|ref_cnt"):
        mgr.check_integrity()


def test_catches_a_block_in_two_groups():
    mgr, cfg, c = busy_manager()
    groups = [g for g in cfg.groups if len(cfg.buckets[g.bucket_id].group_ids) > 1]
    g1, g2 = groups[0], groups[1]
    stolen = mgr.managers[g1.group_id].blocks("c")[-1]
    mgr.managers[g2.group_id].req_tables["c"].append(stolen.block_id)
    stolen.ref_cnt += 1
    with pytest.raises(AssertionError, match="held by groups"):
        mgr.check_integrity()


def test_catches_a_block_lost_from_the_free_queue():
    mgr, cfg, c = busy_manager()
    pool = mgr.pools[0]
    pool.free_queue.remove(next(iter(pool.free_queue)))
    with pytest.raises(AssertionError, match="not in the free queue"):
        mgr.check_integrity()


def test_catches_a_stale_hash_map_entry():
    mgr, cfg, c = busy_manager()
    g = full_group(mgr, cfg)
    pool = mgr.pools[g.bucket_id]
    block = next(iter(pool.cached.values()))
    block.block_hash = None
    with pytest.raises(AssertionError, match="map entry"):
        mgr.check_integrity()


def test_catches_a_used_null_block_and_a_leaked_request():
    mgr, cfg, c = busy_manager()
    mgr.pools[1].null_block.ref_cnt = 1
    with pytest.raises(AssertionError, match="null block"):
        mgr.check_integrity()
    mgr.pools[1].null_block.ref_cnt = 0
    mgr.managers[0].req_tables.pop("c")
    with pytest.raises(AssertionError, match="inconsistently"):
        mgr.check_integrity()


def test_catches_a_live_page_after_the_window_was_freed():
    mgr, cfg, c = busy_manager()
    g = next(g for g in cfg.groups if g.is_sliding)
    table = mgr.managers[g.group_id].req_tables["c"]
    assert table[0] == 0
    table[0] = table[-1]                 # a stale id below the window
    mgr.pools[g.bucket_id].blocks[table[-1]].ref_cnt += 1
    with pytest.raises(AssertionError, match="null entries followed by live blocks"):
        mgr.check_integrity()
