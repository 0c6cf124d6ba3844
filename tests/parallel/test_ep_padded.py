"""The EP dispatcher's padded path (layers/ep_dispatch.py): steps in which every rank calls
every layer once exchange fixed-capacity buffers and read nothing from the device, with
outputs those of the exact path (up to GEMM rounding: the CPU grouped GEMM's blocking follows
the total row count, padding included) and expert loads equal to one process's. A rank
without a forward takes part with nothing to send; a step over the capacity takes the exact
path (and its drain); a forward that fails part-way still pairs its peers' rounds."""
from __future__ import annotations

import torch

from dist_utils import free_port, run_ranks

E, D, INTER, K, LAYERS = 8, 16, 16, 2, 3
SIZES = (1, 2, 4, 8)          # the padded sizes (the decode capture sizes in an engine)


def _layers(num_local: int | None, rank: int, impl: str | None):
    from wideserve.layers.experts import RoutedExperts
    out = []
    for i in range(LAYERS):
        gen = torch.Generator().manual_seed(100 + i)
        w1 = torch.randn(E, 2 * INTER, D, generator=gen) / D ** 0.5
        w2 = torch.randn(E, D, INTER, generator=gen) / INTER ** 0.5
        m = RoutedExperts(E, D, INTER, 7.0 if i == 1 else None, num_local_experts=num_local,
                          impl=impl)
        lo = 0 if num_local is None else rank * num_local
        hi = E if num_local is None else lo + num_local
        m.gate_up_proj = torch.nn.Parameter(w1[lo:hi].clone(), requires_grad=False)
        m.down_proj = torch.nn.Parameter(w2[lo:hi].clone(), requires_grad=False)
        m.expert_load = torch.zeros(E, dtype=torch.int64)
        out.append(m)
    return out


def _routing(tokens: int, allowed: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen)
    pick = torch.rand(tokens, len(allowed), generator=gen).argsort(dim=-1)[:, :K]
    return x, torch.tensor(allowed)[pick], torch.rand(tokens, K, generator=gen)


# Per step, per rank: tokens its forward routes (None: no forward), experts it may pick.
STEPS = [
    [(3, list(range(E))), (1, list(range(E)))],          # padded
    [(0, [0, 1]), (5, [2, 3, 6, 7])],                     # padded, one rank routes nothing
    [(8, [6, 7]), (8, [6, 7])],                           # padded at capacity, one rank idle
    [(9, list(range(E))), (2, list(range(E)))],           # over the capacity: exact
    [(None, []), (4, list(range(E)))],                    # a rank without forward
    [(6, list(range(E))), (3, list(range(E)))],           # rank 0 fails after layer 0
]
FAILS_AFTER_LAYER0 = (5, 0)                              # (step, rank)


def _run(rank: int, world: int, port: int, impl: str | None, padded: bool) -> dict:
    from wideserve.config import ParallelConfig
    from wideserve.layers.ep_dispatch import AllToAllDispatcher, PaddedSteps
    from wideserve.parallel.groups import init_dp_group
    from host_read_counter import HostReadCounter
    group = init_dp_group(ParallelConfig(
        data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
        enable_expert_parallel=True, dp_sync_timeout_s=30), torch.device("cpu"))
    full, sharded = _layers(None, rank, impl), _layers(E // world, rank, impl)
    disp = AllToAllDispatcher(group.device_group, rank, world, E // world, torch.device("cpu"),
                              control_group=group.cpu_group,
                              padded=PaddedSteps(SIZES, K, D, torch.float32) if padded else None)
    for m in sharded:
        disp.register(m)
    outs, mismatches, reads, sizes = [], [], [], []
    for s, step in enumerate(STEPS):
        tokens, allowed = step[rank]
        padded_before = disp.stats.padded_steps
        with HostReadCounter() as c, c.scope():
            if tokens is not None:     # the runner's step header, before the forward
                sizes.append(disp.begin_step(tokens))
            for layer in range(LAYERS if tokens is not None else 0):
                if (s, rank) == FAILS_AFTER_LAYER0 and layer == 1:
                    break
                x, ids, w = _routing(tokens, allowed, seed=1000 * s + 10 * layer + rank)
                with torch.inference_mode():
                    ref = full[layer](x, ids, w)
                    got = sharded[layer](x, ids, w)
                outs.append(got)
                if not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
                    mismatches.append((s, layer))
            disp.finish_step()
        reads.append((disp.stats.padded_steps > padded_before, sum(c.inside.values())))
    loads = [m.expert_load.tolist() for m in sharded]
    ref_loads = [m.expert_load.tolist() for m in full]
    refused = None
    if padded:      # a padded forward without its step header: refused before any collective
        x, ids, w = _routing(2, list(range(E)), seed=1)
        try:
            sharded[0](x, ids, w)
        except RuntimeError as e:
            refused = str(e)
    group.destroy()
    return dict(outs=[o.tolist() for o in outs], mismatches=mismatches, loads=loads, ref_loads=ref_loads,
                reads=reads, sizes=sizes, refused=refused, padded_calls=disp.stats.padded_calls,
                drains=disp.stats.drain_calls)


def _both(rank: int, world: int, port_padded: int, port_exact: int, impl: str | None) -> dict:
    return dict(padded=_run(rank, world, port_padded, impl, True),
                exact=_run(rank, world, port_exact, impl, False))


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-6)
        for x, y in zip(a, b))


def test_padded_dispatch_is_read_free_and_matches_the_exact_path():
    world = 2
    results = run_ranks(_both, world, (world, free_port(), free_port(), None), timeout_s=120)
    for rank, r in enumerate(results):
        p, x = r["padded"], r["exact"]
        assert p["mismatches"] == [] and x["mismatches"] == [], rank
        # Each step padded to the smallest size holding every rank's tokens (0: exact).
        assert p["sizes"] == [[4, 8, 8, 0, 8], [4, 8, 8, 0, 4, 8]][rank]
        assert x["sizes"] == [[0] * 5, [0] * 6][rank]
        assert "begin_step" in p["refused"] and x["refused"] is None
        assert p["loads"] == p["ref_loads"] == x["loads"]       # EPLB counts, per slot
        assert _close(p["outs"], x["outs"])
        # Step 3 (9 tokens > 8) takes the exact path, which reads the counts; the others go
        # padded and read nothing.
        assert [padded for padded, _ in p["reads"]] == [True, True, True, False, True, True]
        assert [n for padded, n in p["reads"] if padded] == [0] * 5
        assert p["reads"][3][1] > 0
        # Five padded steps of 3 layers: rank 0's finish_step made the rounds it did not
        # (all 3 in step 4, 2 in step 5), so nothing was left to drain.
        assert p["padded_calls"] == 5 * LAYERS and p["drains"] == 0
    # On the exact path rank 0 drains rank 1's calls in step 4 (no forward) and the 2 calls
    # its failed forward of step 5 did not make.
    assert [r["exact"]["drains"] for r in results] == [LAYERS + 2, 0]


def test_padded_dispatch_with_the_loop_experts():
    """An expert implementation that reads the counts runs the padded rows too (valid rows
    only), with the same outputs."""
    world = 2
    results = run_ranks(_both, world, (world, free_port(), free_port(), "loop"), timeout_s=120)
    for r in results:
        p, x = r["padded"], r["exact"]
        assert p["mismatches"] == [] and x["mismatches"] == []
        assert _close(p["outs"], x["outs"])
