"""DSpark speculation on DeepSeek-V4.1 (nemo-automodel 0.7.0's target and drafter weights in one
checkpoint): the target's tap features equal the reference's (the streams entering attention of
each tap layer, averaged); greedy outputs are identical with and without DSpark (chunked
prefill with prefix caching, and one-step prefill); confidence early stop drafts fewer
tokens and changes nothing."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
import v41_helpers as h  # noqa: E402
from paged_harness import PagedHarness  # noqa: E402
from test_engine_greedy import _check_idle  # noqa: E402

from wideserve import LLM, SamplingParams  # noqa: E402

MAX_NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    kw = h.CONFIGS["A"]
    path, target, state = h.save_dspark_checkpoint(kw, tmp_path_factory.mktemp("v41_dspark"))
    prompts = [h.random_tokens(n, seed=60 + n) for n in (4, 19, 33, 12)]
    # The same weights under the released checkpoint's official names (`mtp.{s}.hc_attn_fn`,
    # `mtp.{s}.ffn.experts.{e}.w1.weight`, `embed.weight`, ...).
    official = tmp_path_factory.mktemp("v41_dspark_official")
    for f in ("config.json", "tokenizer.json"):
        (official / f).write_text((path / f).read_text())
    save_file(h.official_state(state), str(official / "model.safetensors"))
    return dict(path=str(path), official=str(official), target=target, prompts=prompts)


def _llm(ckpt, spec, **kw) -> LLM:
    args = dict(dtype="float32", block_size=16, kv_cache_memory=1 << 26,
                skip_tokenizer_init=True, kv_cache_dtype="raw", speculative_config=spec)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(ckpt["path"], **args)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with h.kv_quant_off():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_tap_features_equal_the_references(ckpt):
    from wideserve.models.deepseek_v41.model import DSPARK_FEATURES
    target = ckpt["target"]
    seq = h.random_tokens(30, seed=70)
    captured = []
    mods = target.get_dspark_target_feature_modules(list(h.A["dspark_target_layer_ids"]))
    hooks = [m.register_forward_pre_hook(lambda _m, args: captured.append(args[0].mean(2)))
             for m in mods]
    try:
        h.oracle_logits(target, seq)
    finally:
        for hk in hooks:
            hk.remove()
    ref = torch.cat(captured, dim=-1)[0]                                     # [S, 3d]
    ws = h.ws_model(Path(ckpt["path"]))
    specs = {**ws.kv_cache_specs(), **ws.dspark_kv_cache_specs()}
    hr = PagedHarness(ws, max_reqs=1, max_len=40, specs=specs, poison=False)
    hr.step([0], [seq])
    cache = hr.kv_caches[DSPARK_FEATURES]
    got = cache.view(-1, cache.shape[-1])[hr.block_size:hr.block_size + len(seq)]
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=13, enable_prefix_caching=True),
                                dict(max_num_batched_tokens=4096, enable_prefix_caching=False)])
def test_greedy_equal_with_and_without_dspark(ckpt, kw):
    expected = _generate(_llm(ckpt, None, **kw), ckpt["prompts"])
    llm = _llm(ckpt, {"method": "dspark", "num_speculative_tokens": 4}, **kw)
    assert _generate(llm, ckpt["prompts"]) == expected
    sd = llm.engine.get_stats().spec_decode
    assert sd is not None and sd.num_drafts > 0 and sd.num_draft_tokens >= sd.num_drafts
    _check_idle(llm)
    stop = _llm(ckpt, {"method": "dspark", "num_speculative_tokens": 4,
                       "dspark_confidence_threshold": 0.6}, **kw)
    assert _generate(stop, ckpt["prompts"]) == expected
    assert stop.engine.get_stats().spec_decode.num_draft_tokens < sd.num_draft_tokens
    _check_idle(stop)


def test_official_names_serve_the_same_speculation(ckpt):
    """DSpark from the released checkpoint's names: the draft loads (it used to be skipped:
    'dspark' unavailable) and greedy outputs and draft counts equal the HF-named run's."""
    spec = {"method": "dspark", "num_speculative_tokens": 4}
    runs = []
    for path in (ckpt["path"], ckpt["official"]):
        llm = _llm({**ckpt, "path": path}, spec)
        runs.append((_generate(llm, ckpt["prompts"][1:3]), llm.engine.get_stats().spec_decode))
    (hf_out, hf_sd), (off_out, off_sd) = runs
    assert off_out == hf_out
    assert off_sd.num_drafts == hf_sd.num_drafts > 0
    assert off_sd.num_accepted_tokens == hf_sd.num_accepted_tokens


def test_dspark_needs_its_weights(tmp_path):
    kw = h.CONFIGS["B"]
    path = h.save_checkpoint(h.oracle_model(kw), kw, tmp_path)
    with pytest.raises(ValueError, match="'dspark' is unavailable"):
        _llm({"path": str(path)}, {"method": "dspark", "num_speculative_tokens": 2})


def test_draft_step_is_capturable_at_fixed_k(ckpt, monkeypatch):
    """The draft step (DSparkProposer.draft) on the code paths CUDA takes, at fixed k
    (docs/cuda_graphs.md): every call after the first runs under CaptureGuard (no host read,
    no tensor built on the host, no CPU-only op), drafts [B, k] whatever each request wants,
    and two calls of one B record the same trace; greedy stays the target's. (fp32: the
    fullgraph compile would stop at the fp32 experts' eager island, layers/experts.py.)"""
    from cuda_paths import force_cuda_paths
    from wideserve.worker.capture_guard import CaptureGuard
    expected = _generate(_llm(ckpt, None), ckpt["prompts"])
    llm = _llm(ckpt, {"method": "dspark", "num_speculative_tokens": 3})
    force_cuda_paths(monkeypatch, llm.engine.model)
    proposer = llm.engine.spec.proposer
    draft, guard, traces, shapes = proposer.draft, None, {}, []

    def guarded(batch, req_idx, anchor, tokens):
        nonlocal guard
        if guard is None:                        # warm-up: lazy state is made eagerly
            guard = CaptureGuard()
            return draft(batch, req_idx, anchor, tokens)
        guard.allow([req_idx, anchor, tokens, *batch.kv_caches.values(),
                     *(v.block_table for v in batch.kv_groups),
                     *(v.req_rows for v in batch.kv_groups if v.req_rows is not None)])
        with guard:
            out = draft(batch, req_idx, anchor, tokens)
        traces.setdefault(anchor.shape[0], []).append(guard.trace)
        shapes.append(tuple(out.shape))
        return out
    monkeypatch.setattr(proposer, "draft", guarded)
    assert _generate(llm, ckpt["prompts"]) == expected
    assert shapes and all(k == 3 for _, k in shapes)
    assert any(len(t) > 1 for t in traces.values())
    for same_b in traces.values():
        assert all(t == same_b[0] for t in same_b)
