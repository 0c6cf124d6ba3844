"""The host-read budget (tests/engine/test_host_read_budget.py) under DEP2: each rank a
DPEngineCore in its own process, with the EP dispatcher and EPLB recording on, counting its
own reads. The decode forward reads nothing (the EP exchange is the padded one,
layers/ep_dispatch.py) and a rank's step, its finish_step and EPLB's step together read at
most STEP_READ_BUDGET times. The per-step DP sync (rows of host integers over the gloo group,
parallel/dp_sync.py) is host memory on every device and is not counted."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from dist_utils import free_port_block, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_host_read_budget import (COUNTED_STEPS, CPU_READ_FREE, EPLB, MOE_FAMILIES,  # noqa: E402
                                   _add, _count, _engine_kwargs)
from host_read_counter import STEP_READ_BUDGET  # noqa: E402
from tiny_families import model_dir  # noqa: E402


def _dep_rank(rank: int, world: int, port: int, family: str, tmp: str) -> dict:
    from wideserve.config import engine_config_from_kwargs
    from wideserve.engine.dp_engine import DPEngineCore
    path = model_dir(family, Path(tmp) / f"rank{rank}")
    config = engine_config_from_kwargs(**_engine_kwargs(
        path, data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
        enable_expert_parallel=True, dp_sync_timeout_s=60, enable_eplb=True,
        eplb_config=EPLB))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = DPEngineCore(config)
    try:
        # Rank 1's requests end early: it runs dummy steps while rank 0 still decodes.
        _add(core, path, 3 - rank, 2 + COUNTED_STEPS if rank == 0 else 3, seed=rank)
        core.dp_step(False)                       # the prefill
        scopes = [(core, "step"), (core, "_dummy_step"), (core.dispatcher, "finish_step"),
                  (core.eplb, "step")]
        counted = _count(lambda: core.dp_step(False), core.model, scopes)
        stats = core.dispatcher.stats
        return dict(counted=counted, padded_steps=stats.padded_steps,
                    padded_calls=stats.padded_calls, dummy=core.dp.dummy_steps,
                    busy=core.has_unfinished_requests(),
                    layers=len(core.dispatcher.layers))
    finally:
        core.dp_step(True)                        # the agreed stop
        core.group.destroy()


# The CPU paths (DEP runs them): V4 / V4.1 plan their CPU steps from the host block table
# (test_host_read_budget.py's docstring), so they are held to the budget on the CUDA paths there.
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f in CPU_READ_FREE])
def test_decode_step_reads_dep2_with_eplb(family, tmp_path):
    results = run_ranks(_dep_rank, 2, (2, free_port_block(4), family, str(tmp_path)),
                        timeout_s=240)
    for rank, r in enumerate(results):
        for forward, step, sites in r["counted"]:
            assert forward == 0, (rank, sites)
            assert step <= STEP_READ_BUDGET, (rank, sites)
        # Every counted step went over the padded exchange, every layer once (the prefill,
        # over max_num_seqs tokens, took the exact path).
        assert r["padded_steps"] >= COUNTED_STEPS
        assert r["padded_calls"] == r["padded_steps"] * r["layers"]
    assert results[0]["busy"] and results[1]["dummy"] > 0


def _run_until_idle(core, outs: dict) -> None:
    """dp_step until no rank has work (every rank sees the same rows: same step count)."""
    while True:
        for o in core.dp_step(False):
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not core.group_busy:
            return


def _capture_rank(rank: int, world: int, port: int, family: str, tmp: str) -> dict:
    """A DEP2 rank on the CUDA paths, bf16: eager greedy, then the decode step captured
    (every rank at once: the captures exchange rows) by GuardedCapturer and then by
    FullgraphCapturer, the same prompts again through each one's replays."""
    import torch
    from cuda_paths import force_cuda_paths
    from wideserve.config import engine_config_from_kwargs
    from wideserve.engine.dp_engine import DPEngineCore
    from wideserve.layers import experts
    from wideserve.worker.capture_guard import FullgraphCapturer, GuardedCapturer
    path = model_dir(family, Path(tmp) / f"rank{rank}")
    config = engine_config_from_kwargs(**_engine_kwargs(
        path, data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
        enable_expert_parallel=True, dp_sync_timeout_s=60, enable_prefix_caching=False)
        | dict(dtype="bfloat16"))     # torch._grouped_mm traces in bf16 (test_decode_fullgraph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = DPEngineCore(config)
    patch = pytest.MonkeyPatch()
    try:
        force_cuda_paths(patch, core.model)
        patch.setattr(experts, "_grouped_mm_runs", lambda *a: True)   # as on CUDA
        patch.delenv("TORCHDYNAMO_DISABLE", raising=False)            # (v41_helpers sets it)
        capturable = core.model.decode_capturable(torch.device("cuda"))
        # Which all_reduce calls (the EP step header's, the DP sync's) ran inside a forward.
        inside, headers = [False], []
        forward, all_reduce = type(core.model).forward, torch.distributed.all_reduce

        def tracked(self, batch):
            inside[0] = True
            try:
                return forward(self, batch)
            finally:
                inside[0] = False
        patch.setattr(type(core.model), "forward", tracked)     # what FullgraphCapturer compiles
        patch.setattr(torch.distributed, "all_reduce",
                      lambda *a, **k: (headers.append(inside[0]), all_reduce(*a, **k))[1])
        # Rank 0 three requests, rank 1 one: rank 1 replays padded to rank 0's size.
        outs, calls, capturers = [], [], [None, GuardedCapturer(),
                                       FullgraphCapturer(core.model)]
        for cap in capturers:
            if cap is not None:
                # Few sizes (CI time): rank 1's one request pads to 2 alone, rank 0's three
                # to 4; the compile at 4 only.
                sizes = (2, 4) if isinstance(cap, GuardedCapturer) else (4,)
                core.runner.enable_decode_capture(sizes, 256, capturer=cap)
                calls.append([])
                run, seen = core.runner.captured.run, calls[-1]
                core.runner.captured.run = lambda reqs, n, run=run, seen=seen: (
                    seen.append((len(reqs), n)), run(reqs, n))[1]
            outs.append({})
            _add(core, path, 3 if rank == 0 else 1, 3, seed=rank)
            _run_until_idle(core, outs[-1])
        return dict(outs=[sorted(o.values()) for o in outs], capturable=capturable,
                    calls=calls, replays=[c.replays for c in capturers[1:]], headers=headers,
                    compiled=capturers[2].compiled)
    finally:
        patch.undo()
        core.dp_step(True)
        core.group.destroy()


def test_dep2_decode_step_is_capturable(tmp_path):
    """DEP2 with the EP dispatcher in the decode step (docs/cuda_graphs.md): the model says
    it is capturable on CUDA; every size is captured on both ranks at once through the
    capture machinery (worker/capture_guard.py) with the padded exchange inside: the
    guard's replays read nothing, build nothing on the host and record the capture's
    trace, the fullgraph compile has no graph break; every step header runs outside the
    forward; a rank with fewer requests replays at its peer's size; greedy equals eager."""
    results = run_ranks(_capture_rank, 2, (2, free_port_block(4), "qwen3moe", str(tmp_path)),
                        timeout_s=240)
    for rank, r in enumerate(results):
        eager, guarded, compiled = r["outs"]
        assert r["capturable"], rank
        assert guarded == eager and compiled == eager and len(eager) == (3 if rank == 0 else 1)
        assert r["replays"] == [len(c) for c in r["calls"]] and min(r["replays"]) > 0, rank
        assert r["compiled"] == 1, rank
        # The step headers ran, every one outside the forward (a graph cannot hold one).
        assert r["headers"] and not any(r["headers"]), rank
    # Rank 1 (one request: size 2 alone) replays at rank 0's size (three requests: 4).
    assert (1, 4) in results[1]["calls"][0]
