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


def _rejoin_worker(rank: int, world: int, ports: tuple[int, int]) -> dict:
    """A rank's engine leaves its group at the agreed stop (DPEngineCore.shutdown, what the
    lock-step loop calls); a second engine in the same process then joins a new group."""
    import torch.distributed as dist
    from wideserve.engine.dp_engine import DPEngineCore
    from wideserve.parallel.dp_sync import TimedStepSync, choose_step_sync
    group = _group(rank, world, ports[0], 30.0)
    # Only the group and its sync: what shutdown releases (no model is needed for that).
    engine = DPEngineCore.__new__(DPEngineCore)
    engine.group = group
    engine.sync = TimedStepSync(*choose_step_sync(group, "rd"))
    assert engine.sync.exchange(True, rank, False)[:, 1].tolist() == [0, 1]
    engine.shutdown()
    left = not dist.is_initialized() and engine.group is None and engine.sync is None
    again = _group(rank, world, ports[1], 30.0)
    sync = TimedStepSync(*choose_step_sync(again, "gloo"))
    rows = sync.exchange(False, 10 + rank, False)[:, 1].tolist()
    again.destroy()
    return {"left": left, "rows": rows}


def test_a_stopped_dp_engine_leaves_its_group_so_another_can_join():
    results = run_ranks(_rejoin_worker, 2, (2, (free_port(), free_port())), timeout_s=60)
    assert [r["left"] for r in results] == [True, True]
    assert [r["rows"] for r in results] == [[10, 11], [10, 11]]
