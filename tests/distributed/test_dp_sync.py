"""The per-step DP sync: the gloo all-reduce and the recursive-doubling side channel give every
rank every rank's row; "auto" measures both and all ranks take the same choice; a silent rank
makes the others fail with DPGroupError after the timeout instead of waiting forever."""
from __future__ import annotations

import time

import numpy as np

from dist_utils import free_port, run_ranks


def _group(rank: int, world: int, port: int, timeout_s: float):
    import torch
    from wideserve.config import ParallelConfig
    from wideserve.distributed.groups import init_dp_group
    return init_dp_group(ParallelConfig(data_parallel_size=world, data_parallel_rank=rank,
                                        data_parallel_rpc_port=port,
                                        dp_sync_timeout_s=timeout_s), torch.device("cpu"))


def _exchange_worker(rank: int, world: int, port: int) -> dict:
    from wideserve.distributed.dp_sync import (GlooStepSync, RecursiveDoublingSync,
                                               choose_step_sync)
    group = _group(rank, world, port, 30)
    out = {}
    for sync in (GlooStepSync(group), RecursiveDoublingSync(group)):
        rows = [sync.exchange(np.array([rank, 10 * rank + step, step], dtype=np.int64))
                for step in range(3)]
        out[sync.name] = [r.tolist() for r in rows]
        sync.close()
    chosen, stats = choose_step_sync(group, "auto", rounds=5)
    out["chosen"] = stats.method
    out["calibrated"] = sorted(stats.calibration_us)
    chosen.close()
    group.destroy()
    return out


def test_both_syncs_gather_every_row_and_auto_agrees():
    world = 4
    results = run_ranks(_exchange_worker, world, (world, free_port()), timeout_s=90)
    expected = [[[r, 10 * r + s, s] for r in range(world)] for s in range(3)]
    for r in results:
        assert r["gloo"] == expected and r["rd"] == expected
        assert r["calibrated"] == ["gloo", "rd"]
    assert len({r["chosen"] for r in results}) == 1


def _silent_worker(rank: int, world: int, port: int) -> dict:
    from wideserve.distributed.dp_sync import GlooStepSync, RecursiveDoublingSync
    from wideserve.distributed.groups import DPGroupError
    group = _group(rank, world, port, 1.0)
    syncs = [RecursiveDoublingSync(group), GlooStepSync(group)]
    for sync in syncs:
        sync.exchange(np.zeros(3, dtype=np.int64))
    if rank == 1:
        time.sleep(3.0)                  # hung: misses the next syncs
        return {}
    waited = {}
    for sync in syncs:
        start = time.monotonic()
        try:
            sync.exchange(np.zeros(3, dtype=np.int64))
        except DPGroupError:
            waited[sync.name] = time.monotonic() - start
    return waited


def test_a_silent_rank_fails_the_sync_after_the_timeout():
    waited = run_ranks(_silent_worker, 2, (2, free_port()), timeout_s=60)[0]
    assert sorted(waited) == ["gloo", "rd"], waited       # both raised, neither hung
    assert all(0.7 < w < 2.5 for w in waited.values()), waited
