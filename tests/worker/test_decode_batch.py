"""The persistent decode batch (worker/decode_batch.py): decode steps of any size over inputs
kept across steps, the lean forward's plan kept per batch size. Greedy outputs equal the
standard path's (LoadConfig.persistent_decode_batch=False) while the batch grows and shrinks,
requests are aborted and preempted and block tables are reallocated."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_families import FAMILIES, model_dir, vocab_size  # noqa: E402
from wideserve import LLM, SamplingParams  # noqa: E402
from wideserve.models import lean_decode  # noqa: E402
from wideserve.types.messages import EngineCoreRequest  # noqa: E402
from wideserve.worker.decode_batch import DecodeBatch  # noqa: E402


def _llm(path: Path, persistent: bool, dtype: str = "float32", **kw) -> LLM:
    # small_batch_decode=0: every decode step is the persistent batch's (or the standard's)
    args = dict(dtype=dtype, load_format="dummy", max_model_len=256,
                kv_cache_memory=1 << 26, skip_tokenizer_init=True, max_num_seqs=8,
                small_batch_decode=0, persistent_decode_batch=persistent, seed=0)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(path), **args)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scenario(llm: LLM, vocab: int) -> dict[str, list[int]]:
    """Two users, then a batch that grows to six and shrinks as requests of different lengths
    finish, an abort mid-decode and a late arrival; the tokens each request received."""
    engine = llm.engine
    got: dict[str, list[int]] = {}

    def add(rid: str, n: int, max_tokens: int) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(EngineCoreRequest(rid, _prompt(vocab, n, len(got) + 3), sp))
        got[rid] = []

    def steps(k: int) -> None:
        for _ in range(k):
            for out in engine.step():
                got[out.request_id] += out.new_token_ids

    add("a", 9, 16)
    add("b", 4, 12)
    steps(4)
    for rid, n, m in (("c", 20, 9), ("d", 5, 5), ("e", 3, 7), ("f", 11, 6)):
        add(rid, n, m)
    steps(3)
    engine.abort_requests(["c"])
    steps(2)
    add("g", 6, 5)
    while engine.has_unfinished_requests():
        steps(1)
    assert engine.kv_manager.usage == 0.0
    engine.check_integrity()
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equal_to_the_standard_path(family: str, tmp_path: Path) -> None:
    path = model_dir(family, tmp_path)
    vocab = vocab_size(path)
    runs = {}
    for persistent in (False, True):
        llm = _llm(path, persistent)
        runs[persistent] = _scenario(llm, vocab)
        decode = llm.engine.runner.decode
        if persistent:
            # sizes 2, 5, 6 (and the shrinking ones) all ran here
            assert isinstance(decode, DecodeBatch) and decode.steps >= 12
            assert len(decode._views) >= 4
        else:
            assert decode is None
    assert runs[True] == runs[False]
    assert len(runs[True]["a"]) == 16 and 0 < len(runs[True]["c"]) < 9


def test_preemption_equal_to_the_standard_path(tmp_path: Path) -> None:
    """A pool too small for every request: preempted requests resume (their first step
    again a prefill) and the outputs do not change."""
    path = model_dir("qwen3moe", tmp_path)
    runs, steps = {}, 0
    for persistent in (False, True):
        llm = _llm(path, persistent, block_size=16, num_blocks_override=5)
        runs[persistent] = _scenario(llm, vocab_size(path))
        assert llm.engine.get_stats().num_preemptions > 0
        steps = llm.engine.runner.decode.steps if persistent else steps
    assert runs[True] == runs[False] and steps > 0


def test_cuda_like_copies(tmp_path: Path) -> None:
    """Separate device copies of the inputs and block tables, uploaded each step as on CUDA:
    every field the model reads is uploaded (V4: ratio-1 and compressed groups)."""
    from wideserve.worker.block_tables import BlockTables
    path = model_dir("v4", tmp_path)
    base = _scenario(_llm(path, False), vocab_size(path))
    llm = _llm(path, False)
    runner = llm.engine.runner
    runner.tables = BlockTables(len(runner.groups), torch.device("cpu"), separate_copy=True)
    runner.decode = DecodeBatch(runner.groups, runner.cache_group, runner.kv_caches,
                                runner.tables, runner.device, 8, separate_copy=True)
    assert _scenario(llm, vocab_size(path)) == base and runner.decode.steps >= 12


def test_lean_plan_kept_per_size(tmp_path: Path, monkeypatch) -> None:
    """bf16 Qwen3-MoE (the lean forward): decode steps plan the layers once per batch size;
    a block table reallocated or a hook registered later makes the next step plan again (the
    hook runs); outputs stay the standard path's."""
    path = model_dir("qwen3moe", tmp_path)
    vocab = vocab_size(path)
    # three requests finishing at 6, 9 and 12 tokens: decode sizes 3, 2, 1
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 9, 12)]
    prompts = [{"prompt_token_ids": _prompt(vocab, 10, s)} for s in range(3)]

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    base = tokens(_llm(path, False, dtype="bfloat16"))
    llm = _llm(path, True, dtype="bfloat16")
    calls: list[int] = []
    plan = lean_decode._plan_layer

    def counted(*args, **kw):
        calls.append(1)
        return plan(*args, **kw)
    monkeypatch.setattr(lean_decode, "_plan_layer", counted)
    assert tokens(llm) == base
    layers = len(llm.engine.model.model.layers)
    # the prefill plans for itself; the 10 decode steps one plan per size (3, 2, 1)
    assert len(calls) == 4 * layers, len(calls)
    calls.clear()
    decode = llm.engine.runner.decode
    decode.tables.reserve(32, [64] * len(decode.groups))        # new table tensors
    assert tokens(llm) == base
    assert len(calls) == 4 * layers
    calls.clear()
    # kept: only the prefill plans
    assert tokens(llm) == base and len(calls) == layers and decode.steps == 3 * 11
    seen = []
    llm.engine.model.model.layers[0].self_attn.register_forward_hook(
        lambda *a: seen.append(1))
    assert tokens(llm) == base
    assert len(seen) == 12          # the module path ran every step, hook and all


def test_config_switch(tmp_path: Path) -> None:
    path = model_dir("llama", tmp_path)
    assert _llm(path, True).engine.runner.decode.max_size == 8
    assert _llm(path, False).engine.runner.decode is None
    with pytest.raises(ValueError, match="persistent decode batch"):
        _llm(path, False).engine.runner.enable_decode_batch(-1)
    # EPLB rewrites expert slots while serving, under a kept plan: the path is off
    assert _llm(model_dir("qwen3moe", tmp_path), True,
                enable_eplb=True).engine.runner.decode is None
