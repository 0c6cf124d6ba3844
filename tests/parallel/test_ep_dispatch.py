"""The EP dispatch/combine on its own: 4 gloo ranks, each holding 2 of 8 experts, against the
same MoE run in one process with all experts, on random routings. Covers experts that get no
tokens, a rank that owns only idle experts, ranks that send nothing, ranks making different
numbers of MoE calls in a step (the drain), peers in different layers in the same round, and
bf16 with the V4 SwiGLU clamp. The same group then checks the per-step DP sync. (Equal up to GEMM rounding; the engine tests check greedy
outputs token for token.)"""
from __future__ import annotations

import torch

from dist_utils import free_port, run_ranks

E, D, INTER, K = 8, 16, 16, 2
LAYERS = [(torch.float32, None), (torch.float32, 7.0), (torch.bfloat16, 0.5)]


def _layers(num_local: int | None, rank: int):
    from wideserve.layers.experts import RoutedExperts
    out = []
    for i, (dtype, limit) in enumerate(LAYERS):
        gen = torch.Generator().manual_seed(100 + i)
        w1 = (torch.randn(E, 2 * INTER, D, generator=gen) / D ** 0.5).to(dtype)
        w2 = (torch.randn(E, D, INTER, generator=gen) / INTER ** 0.5).to(dtype)
        m = RoutedExperts(E, D, INTER, limit, num_local_experts=num_local)
        lo = 0 if num_local is None else rank * num_local
        hi = E if num_local is None else lo + num_local
        m.gate_up_proj = torch.nn.Parameter(w1[lo:hi].clone(), requires_grad=False)
        m.down_proj = torch.nn.Parameter(w2[lo:hi].clone(), requires_grad=False)
        m.expert_load = torch.zeros(E, dtype=torch.int64)
        out.append(m)
    return out


def _routing(layer: int, tokens: int, allowed: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    dtype = LAYERS[layer][0]
    x = torch.randn(tokens, D, generator=gen).to(dtype)
    pick = torch.rand(tokens, len(allowed), generator=gen).argsort(dim=-1)[:, :K]
    ids = torch.tensor(allowed)[pick]
    weights = torch.rand(tokens, K, generator=gen)
    return x, ids, weights


# Per step: per rank, the MoE calls it makes: (layer, tokens, allowed experts).
STEPS = [
    # experts 3, 4, 6, 7 get nothing (rank 3 owns only idle experts); rank 3 sends nothing
    [[(0, 7, [0, 1, 2, 5])], [(0, 3, [0, 1, 2, 5])], [(0, 1, [0, 1, 2, 5])], [(0, 0, [0, 1])]],
    # different numbers of calls: ranks 2 and 3 only drain
    [[(0, 5, list(range(E))), (1, 4, [6, 7]), (0, 2, [1, 6])], [(1, 6, list(range(E)))], [], []],
    # peers in different layers in the same round
    [[(1, 4, list(range(E)))], [(0, 5, list(range(E)))], [(1, 6, [0, 3, 7])], [(0, 1, [5, 6])]],
    # bf16 with the V4 clamp; rank 1 sends nothing
    [[(2, 6, [0, 3, 7])], [(2, 0, [0, 1])], [(2, 9, list(range(E)))], [(2, 1, [5, 6])]],
    # nobody calls: finish_step alone must return
    [[], [], [], []],
]


def _worker(rank: int, world: int, port: int) -> dict:
    from wideserve.config import ParallelConfig
    from wideserve.layers.ep_dispatch import AllToAllDispatcher
    from wideserve.parallel.groups import init_dp_group
    group = init_dp_group(ParallelConfig(
        data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
        enable_expert_parallel=True, dp_sync_timeout_s=30), torch.device("cpu"))
    full = _layers(None, rank)
    sharded = _layers(E // world, rank)
    disp = AllToAllDispatcher(group.device_group, rank, world, E // world, torch.device("cpu"))
    for m in sharded:
        disp.register(m)
    mismatches = []
    for s, step in enumerate(STEPS):
        for c, (layer, tokens, allowed) in enumerate(step[rank]):
            x, ids, w = _routing(layer, tokens, allowed, seed=1000 * s + 10 * c + rank)
            with torch.inference_mode():
                ref = full[layer](x, ids, w)
                got = sharded[layer](x, ids, w)
            assert got.shape == ref.shape and got.dtype == ref.dtype
            # Each expert sees a different set of rows than in one process (rows from every
            # rank), and a GEMM's rounding may depend on its row count: equal up to rounding.
            tol = 1e-5 if got.dtype == torch.float32 else 2e-2
            if not torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol):
                mismatches.append((s, c, float((got.float() - ref.float()).abs().max())))
        disp.finish_step()
    loads = [m.expert_load.tolist() for m in sharded]
    ref_loads = [m.expert_load.tolist() for m in full]
    syncs = _sync_rows(group, rank)
    group.destroy()
    return dict(mismatches=mismatches, loads=loads, ref_loads=ref_loads, syncs=syncs,
                received=disp.stats.rows_received, drains=disp.stats.drain_calls)


def _sync_rows(group, rank: int) -> dict:
    """The per-step DP sync on the same group: both methods, then "auto"."""
    import numpy as np
    from wideserve.parallel.dp_sync import GlooStepSync, RecursiveDoublingSync, choose_step_sync
    out = {}
    for sync in (GlooStepSync(group), RecursiveDoublingSync(group)):
        out[sync.name] = [sync.exchange(np.array([rank, 10 * rank + s, s])).tolist()
                          for s in range(3)]
        sync.close()
    chosen, stats = choose_step_sync(group, "auto", rounds=5)
    out["chosen"], out["calibrated"] = stats.method, sorted(stats.calibration_us)
    chosen.close()
    return out


def test_all_to_all_dispatch_equals_one_process_moe():
    world = 4
    results = run_ranks(_worker, world, (world, free_port()), timeout_s=90)
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches']}"
        assert r["loads"] == r["ref_loads"]              # load counted per physical expert
    # Rank 3 owns experts 6, 7: nothing in step 0, rows in steps 1-2.
    assert results[3]["received"] > 0
    # Ranks 2, 3 made no call in step 1 and answered rank 0's and 1's: drain calls happened.
    # Step 1: rank 0 makes 3 calls, rank 1 one, ranks 2-3 none; every other round is a drain.
    assert [r["drains"] for r in results] == [0, 2, 3, 3]
    # The step sync: both methods give every rank every row; "auto" picks one for all.
    expected = [[[r, 10 * r + s, s] for r in range(world)] for s in range(3)]
    for r in results:
        assert r["syncs"]["gloo"] == expected and r["syncs"]["rd"] == expected
        assert r["syncs"]["calibrated"] == ["gloo", "rd"]
    assert len({r["syncs"]["chosen"] for r in results}) == 1
