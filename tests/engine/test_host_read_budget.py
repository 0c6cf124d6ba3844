"""The host-read budget of a decode step (docs/host_path.md, "The host-read budget"): the decode
forward reads nothing from the device, and the whole engine step (schedule -> sample ->
output) reads at most STEP_READ_BUDGET times (the sampled token ids). Per family, on the CPU
paths and on the paths CUDA takes (tests/cuda_paths.py), single rank (with and without EPLB
recording); DEP2 with the EP dispatcher and EPLB recording is
tests/parallel/test_host_read_budget_dep.py, with the same helpers.

Families: FAMILIES below. DeepSeek-V4 / V4.1 are held to it on the paths CUDA takes only (their
decode batches through layers/attention/v4_static.py): on the CPU paths V4Step plans from the
block table with numpy, a host tensor there, which costs nothing on the CPU.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from host_read_counter import STEP_READ_BUDGET, HostReadCounter
from tiny_families import model_dir, vocab_size

FAMILIES = ["qwen3moe", "llama", "v4", "v41"]
MOE_FAMILIES = [f for f in FAMILIES if f not in ("llama",)]
CPU_READ_FREE = ("qwen3moe", "llama")        # V4 / V4.1: see the docstring
COUNTED_STEPS = 4
EPLB = {"window_size": 4, "step_interval": 1000}      # recording on, no rebalance meanwhile


def _params(max_tokens: int):
    from wideserve import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _add(core, path: Path, n: int, max_tokens: int, seed: int) -> None:
    from wideserve.types.messages import EngineCoreRequest
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        prompt = torch.randint(2, vocab_size(path), (7 + 3 * i,), generator=gen).tolist()
        core.add_request(EngineCoreRequest(f"r{seed}-{i}", prompt, _params(max_tokens)))


def _count(step, model, scopes: list[tuple[object, str]]) -> list[tuple[int, int, dict]]:
    """COUNTED_STEPS calls of step(): per call (forward reads, step reads, where)."""
    out = []
    for _ in range(COUNTED_STEPS):
        with HostReadCounter() as c:
            undo = [c.wrap_forward(model)] + [c.wrap(o, m, "step") for o, m in scopes]
            step()
            for u in undo:
                u()
        out.append((c.reads("inside"), c.reads("step"), dict(c.sites)))
    return out


def _engine_kwargs(path: Path, **kw) -> dict:
    return dict(model=str(path), load_format="dummy", dtype="float32", max_num_seqs=4,
                max_model_len=256, kv_cache_memory=1 << 26, **kw)


# (family, paths, EPLB recording): EPLB only where there are routed experts to balance.
CASES = [(f, p, e) for f in FAMILIES
         for p in (("cpu", "cuda") if f in CPU_READ_FREE else ("cuda",))
         for e in ((False, True) if f in MOE_FAMILIES else (False,))]


@pytest.mark.parametrize("family,paths,eplb", CASES)
def test_decode_step_reads_single_rank(family, paths, eplb, tmp_path, monkeypatch):
    from wideserve.config import engine_config_from_kwargs
    from wideserve.engine.engine_core import EngineCore
    path = model_dir(family, tmp_path)
    kw = dict(enable_eplb=True, eplb_config=EPLB) if eplb else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = EngineCore(engine_config_from_kwargs(**_engine_kwargs(path, **kw)))
    if paths == "cuda":
        from cuda_paths import force_cuda_paths
        force_cuda_paths(monkeypatch, core.model)
    _add(core, path, 3, 2 + COUNTED_STEPS, seed=0)
    core.step()                                   # the prefill
    counted = _count(core.step, core.model, [(core, "step")])
    assert core.has_unfinished_requests()         # every counted step was a decode step
    for forward, step, sites in counted:
        assert forward == 0, sites
        assert step <= STEP_READ_BUDGET, sites
