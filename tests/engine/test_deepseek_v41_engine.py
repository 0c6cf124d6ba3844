"""DeepSeek-V4.1 through the whole engine: greedy continuations equal the reference's
(nemo-automodel 0.7.0, re-run on the full sequence for every new token) under chunked prefill,
prefix caching (keep and replay) and preemption; shared KV records stay consistent (the
integrity check counts each block once)."""
from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import v41_helpers as h  # noqa: E402

from test_engine_greedy import _check_idle  # noqa: E402

from wideserve import LLM, SamplingParams  # noqa: E402

MAX_NEW = 5
BLOCK = 16


@torch.no_grad()
def _oracle_greedy(m, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for p in prompts:
        seq = list(p)
        for _ in range(MAX_NEW):
            seq.append(int(h.oracle_logits(m, seq)[-1].argmax()))
        outs.append(seq[len(p):])
    return outs


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    kw = h.CONFIGS["A"]
    m = h.oracle_model(kw, seed=5)
    path = h.save_checkpoint(m, kw, tmp_path_factory.mktemp("v41_engine"))
    prompts = [h.random_tokens(n, seed=20 + i) for i, n in enumerate([3, 17, 30, 9, 41])]
    prefix = h.random_tokens(2 * BLOCK + 5, seed=40)
    shared = [prefix + h.random_tokens(n, seed=50 + n) for n in (4, 11)]
    with h.kv_quant_off():
        expected = _oracle_greedy(m, prompts + shared)
    return dict(path=str(path), prompts=prompts, shared=shared,
                expected=expected[:len(prompts)], expected_shared=expected[len(prompts):],
                expected_quantised=_oracle_greedy(m, prompts[:3]))


def _llm(case, **kw) -> LLM:
    # Quantisers off on both sides (see tests/models/test_deepseek_v41.py), so values are
    # stored as they are ("raw").
    args = dict(dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 26,
                skip_tokenizer_init=True, kv_cache_dtype="raw")
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(case["path"], **args)


def _generate(llm: LLM, prompts: list[list[int]], quant: bool = False) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with contextlib.nullcontext() if quant else h.kv_quant_off():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget,caching", [(4096, False), (13, True)])
def test_greedy_matches_the_reference(case, budget, caching):
    llm = _llm(case, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    assert _generate(llm, case["prompts"]) == case["expected"]
    _check_idle(llm)


@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_prefix_hits_do_not_change_outputs(case, mode):
    llm = _llm(case, max_num_batched_tokens=64, enable_prefix_caching=True,
               prefix_window_mode=mode)
    got = _generate(llm, case["shared"][:1]) + _generate(llm, case["shared"][1:])
    assert got == case["expected_shared"]
    kv = llm.engine.kv_manager.stats
    assert kv.hits + kv.replayed >= 2 * BLOCK, kv
    _check_idle(llm)


def test_preemption_does_not_change_outputs(case):
    llm = _llm(case, max_num_batched_tokens=64, num_blocks_override=12, max_num_seqs=5)
    assert _generate(llm, case["prompts"]) == case["expected"]
    assert llm.engine.get_stats().num_preemptions > 0
    _check_idle(llm)


def test_packed_records_greedy_matches_the_quantised_reference(case):
    """The reference's FP8 / NVFP4 / MXFP4 records, packed in uint8 caches (890 B/token on
    Flash), chunked at 13 tokens a step with prefix caching."""
    llm = _llm(case, max_num_batched_tokens=13, enable_prefix_caching=True,
               kv_cache_dtype="auto")
    assert llm.engine.kv_caches["model.layers.2.attn.compressed"].dtype == torch.uint8
    assert _generate(llm, case["prompts"][:3], quant=True) == case["expected_quantised"]
    _check_idle(llm)


def test_decoder_bounded_replay_default_and_flag(case, monkeypatch):
    """The exact decoder bounded replay is on by default for V4.1: a 41-token prompt's
    prefill runs the last KV source and the layers after it on fewer rows (seen) and the
    greedy output is the reference's (chunked at 13 tokens with prefix caching, and with
    prefix hits: the tests above, which run with it on); a request with prompt logprobs
    reads every row and gets those of an engine without it (--no-decoder-bounded-replay);
    forcing it on a model that is not V4.1 is an error; the CLI flags reach the config."""
    import argparse

    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    from wideserve.models.deepseek_v41 import model as v41_model
    from wideserve.models.llama.model import LlamaConfig, LlamaForCausalLM
    cut, plan = [], v41_model.plan_decoder_replay

    def record(*args, **kw):
        replay = plan(*args, **kw)
        cut.append(replay is not None and bool(replay.stages))
        return replay
    monkeypatch.setattr(v41_model, "plan_decoder_replay", record)
    on = _llm(case, max_num_batched_tokens=4096)
    assert on.engine.model.decoder_replay is True
    long = case["prompts"][4]
    assert _generate(on, [long]) == [case["expected"][4]] and any(cut)
    off = _llm(case, decoder_bounded_replay=False)
    assert off.engine.model.decoder_replay is False
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    with h.kv_quant_off():
        a, b = [llm.generate([{"prompt_token_ids": long}], sp, use_tqdm=False)[0]
                for llm in (on, off)]
    assert len(a.prompt_logprobs) == len(long) and a.prompt_logprobs[0] is None
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) <= 1e-4 for t in x)
    for llm in (on, off):
        _check_idle(llm)
    with pytest.raises(ValueError, match="--decoder-bounded-replay applies to DeepSeek-V4.1"):
        with torch.device("meta"):      # a model that is not V4.1 (the contract's default)
            LlamaForCausalLM(LlamaConfig.from_dict(dict(
                vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1))).enable_decoder_bounded_replay()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], None), (["--decoder-bounded-replay"], True),
                       (["--no-decoder-bounded-replay"], False)):
        assert engine_config_from_args(parser.parse_args(argv)).load.decoder_bounded_replay \
            is want
