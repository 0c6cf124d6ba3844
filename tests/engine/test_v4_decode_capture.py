"""DeepSeek-V4 and V4.1 through the whole engine with the captured decode step on the code
paths they take on CUDA (tests/cuda_paths.py; layers/attention/v4_static.py): every size and
context bucket "captured" by GuardedCapturer (worker/capture_guard.py), every replay passes
the guard and records its capture's trace over the runner's persistent block tables and
padding rows, and the greedy outputs equal the default eager engine's (docs/cuda_graphs.md)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import v41_helpers as h41  # noqa: E402

from cuda_paths import force_cuda_paths  # noqa: E402
from oracle import mixed_prompts, save_hf  # noqa: E402
from wideserve import LLM, SamplingParams  # noqa: E402
from wideserve.worker.capture_guard import GuardedCapturer  # noqa: E402
from wideserve.worker.decode_capture import CapturedDecode  # noqa: E402

LENGTHS = [3, 9, 17, 30, 41, 5]


# v41_C has an Engram layer (layer 0): its rows are staged on the host before each replay
# (layers/engram.py, EngramStaging), and GuardedCapturer refuses any read of its host table
# inside the forward.
@pytest.fixture(scope="module", params=["v4_A", "v41_B", "v41_C"])
def model_path(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "v4_A":
        from models import v4_configs
        from models.v4_helpers import hf_model
        return str(save_hf(hf_model(v4_configs.A, seed=3), path))
    name = request.param[-1]
    return str(h41.save_checkpoint(h41.oracle_model(h41.CONFIGS[name], seed=5),
                                   h41.CONFIGS[name], path))


def _llm(path: str, capture: bool) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, dtype="float32", block_size=16, kv_cache_memory=1 << 26,
                   skip_tokenizer_init=True, max_num_seqs=6, decode_capture=capture)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # Different lengths: requests finish at different steps, so the padded size changes.
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_the_cuda_decode_path_replays_as_captured(model_path, monkeypatch) -> None:
    prompts = mixed_prompts(200, LENGTHS, seed=7)
    base = _generate(_llm(model_path, False), prompts)
    llm = _llm(model_path, False)
    force_cuda_paths(monkeypatch, llm.engine.model)
    guarded = GuardedCapturer()
    cap = llm.engine.runner.enable_decode_capture((1, 2, 4, 6), 4096, capturer=guarded)
    assert len(guarded.traces) == 8 and cap.buckets == (1024, 4096)     # sizes x buckets
    assert isinstance(llm.engine.runner.captured, CapturedDecode)
    calls = []
    run = cap.run

    def counted(reqs, n):
        calls.append((len(reqs), n))
        return run(reqs, n)
    cap.run = counted
    assert _generate(llm, prompts) == base
    assert guarded.replays == len(calls) and any(n > r for r, n in calls)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
