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
