"""A capturable decode forward, per model family (docs/cuda_graphs.md, "How the CPU proves it"):
on the code paths it takes on CUDA (tests/cuda_paths.py), the decode forward at each padded
batch size of the captured decode step compiles with torch.compile(fullgraph=True)
(FullgraphCapturer, worker/capture_guard.py: any graph break fails), and the engine's greedy
outputs through the compiled replays equal its eager ones.

Families: FAMILIES below (tests/tiny_families.py has their models). bf16, the dtype a GPU
serves in: torch._grouped_mm's shape function accepts only bf16, so the fp32 experts run
eagerly inside a compiled forward (layers/experts.py), which fullgraph refuses."""
from __future__ import annotations

import warnings

import pytest
import torch

from cuda_paths import force_cuda_paths
from tiny_families import model_dir, vocab_size
from wideserve import LLM, SamplingParams
from wideserve.worker.capture_guard import FullgraphCapturer

FAMILIES = ["llama", "qwen3moe", "v4", "v41"]
SIZES = (1, 2, 4)
MAX_LEN = 256


@pytest.fixture(autouse=True)
def _dynamo_on(monkeypatch):
    """tests/models/v41_helpers.py turns torch.compile off for the oracle in any process that
    imports it (TORCHDYNAMO_DISABLE); these tests need it on (FullgraphCapturer refuses
    otherwise)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)


def _generate(llm: LLM, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()}
               for n in (5, 13, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_forward_compiles_fullgraph(family, tmp_path, monkeypatch):
    torch._dynamo.reset()
    path = model_dir(family, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_num_seqs=4,
                  max_model_len=MAX_LEN, kv_cache_memory=1 << 26, skip_tokenizer_init=True,
                  enable_prefix_caching=False)
    try:
        model = llm.engine.model
        force_cuda_paths(monkeypatch, model)
        eager = _generate(llm, vocab_size(path))
        capturer = FullgraphCapturer(model)
        llm.engine.runner.enable_decode_capture(SIZES, MAX_LEN, capturer=capturer)
        assert capturer.compiled == len(SIZES)            # one bucket: MAX_LEN < 1024
        assert _generate(llm, vocab_size(path)) == eager
        assert capturer.replays > 0
    finally:
        llm.shutdown()
        torch._dynamo.reset()


def test_fullgraph_capturer_fails_on_a_graph_break(tmp_path, monkeypatch):
    """Not vacuous: the same family on the CPU paths (C++ ops, host-planned attention) does
    not compile in one graph."""
    torch._dynamo.reset()
    path = model_dir("qwen3moe", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_num_seqs=4,
                  max_model_len=MAX_LEN, kv_cache_memory=1 << 26, skip_tokenizer_init=True)
    try:
        capturer = FullgraphCapturer(llm.engine.model)
        with pytest.raises(Exception, match="(?i)graph break|disable|unsupported"):
            llm.engine.runner.enable_decode_capture((2,), MAX_LEN, capturer=capturer)
    finally:
        llm.shutdown()
        torch._dynamo.reset()
