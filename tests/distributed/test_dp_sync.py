"""The per-step DP sync: a silent rank makes the others fail with DPGroupError after the
timeout instead of waiting forever, with either method. (That both methods gather every row
and that "auto" agrees on all ranks is checked in test_ep_dispatch.py's 4-rank group.)"""
from __future__ import annotations

import time

import numpy as np

from dist_utils import free_port, run_ranks


def _group(rank: int, world: int, port: int, timeout_s: float):
    import torch
    from wideserve.config import ParallelConfig
    from wideserve.parallel.groups import init_dp_group
    return init_dp_group(ParallelConfig(data_parallel_size=world, data_parallel_rank=rank,
                                        data_parallel_rpc_port=port,
                                        dp_sync_timeout_s=timeout_s), torch.device("cpu"))


def _silent_worker(rank: int, world: int, port: int) -> dict:
    from wideserve.parallel.dp_sync import GlooStepSync, RecursiveDoublingSync
    from wideserve.parallel.groups import DPGroupError
    group = _group(rank, world, port, 1.0)
    syncs = [RecursiveDoublingSync(group), GlooStepSync(group)]
    for sync in syncs:
        sync.exchange(np.zeros(3, dtype=np.int64))
    if rank == 1:
        time.sleep(5.5)                  # hung: misses the next syncs
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
    assert all(0.7 < w < 5.0 for w in waited.values()), waited    # 1 s timeout, busy box
