"""A DP group left behind (destroy()) leaves nothing a later group in the same process trips
on: three groups one after the other on the same rendezvous port, each with both step syncs
and an EP-style all-to-all, while the earlier group objects are still referenced (as a
shut-down engine that was not collected yet holds its group)."""
from __future__ import annotations

import numpy as np

from dist_utils import free_port, run_ranks


def _rounds(rank: int, world: int, port: int) -> list:
    import torch
    import torch.distributed as dist
    from wideserve.config import ParallelConfig
    from wideserve.parallel.dp_sync import GlooStepSync, RecursiveDoublingSync
    from wideserve.parallel.groups import init_dp_group
    kept, out = [], []
    for r in range(3):
        group = init_dp_group(ParallelConfig(
            data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
            enable_expert_parallel=True, dp_sync_timeout_s=20), torch.device("cpu"))
        syncs = [GlooStepSync(group), RecursiveDoublingSync(group)]
        rows = [s.exchange(np.array([r, rank, 0])).tolist() for s in syncs]
        x = torch.full((world,), float(10 * r + rank))
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group.device_group)
        out.append((rows, y.tolist()))
        for s in syncs:
            s.close()
        group.destroy()
        assert not dist.is_initialized() and group.store is None
        kept.append(group)
    return out


def test_groups_rebuilt_on_the_same_port_in_one_process():
    world = 2
    results = run_ranks(_rounds, world, (world, free_port()), timeout_s=120)
    for rank, rounds in enumerate(results):
        assert len(rounds) == 3
        for r, (rows, gathered) in enumerate(rounds):
            assert rows == [[[r, q, 0] for q in range(world)]] * 2
            assert gathered == [float(10 * r + q) for q in range(world)]
