"""--batch-invariant end to end, bf16: a prompt's greedy tokens alone equal its tokens in a
batch of 7 mixed prompts (Qwen3-MoE, DeepSeek-V4, DeepSeek-V4.1), MTP k = 3 equals no
speculation, and prefill -> decode over the loopback connector equals one engine.

The kernels are chosen by measurement here (WIDESERVE_GEMM=auto, as users run; the suite
otherwise pins the micro-kernel, tests/conftest.py), so the default mode mixes kernels by
token count and can differ; the mode must not (docs/cpu_kernels.md, "Batch invariance")."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tiny_families import qwen3_moe_checkpoint
from wideserve import LLM, SamplingParams
from wideserve.kernels import choice
from wideserve.kernels.loader import cpu_ops_available

sys.path.insert(0, str(Path(__file__).parent / "disagg"))
from pd_harness import make_engines, run_colocated, run_pd  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU ops not built")
ASSETS = Path(__file__).parents[1] / "wideserve" / "assets"
LENGTHS = (37, 5, 60, 12, 90, 3, 25)
NEW = 32


@pytest.fixture
def measured_kernels(monkeypatch):
    """Kernels chosen by timing (the default a user gets), in this process and engines it
    starts."""
    monkeypatch.setenv(choice.ENV_FORCE, "auto")
    choice.default_choice.cache_clear()
    yield
    choice.default_choice.cache_clear()


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> str:
    """A Qwen3-MoE with the 11M model's widths (hidden 256, experts 256 wide), 2 layers."""
    return qwen3_moe_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe_bi"), torch.bfloat16, vocab_size=2048,
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        max_position_embeddings=1024, tie_word_embeddings=False)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class PlainLinears(TorchFunctionMode):
    """Records the weight shapes of the `F.linear` calls made while active. In the mode
    none may run: every GEMM of a weight goes through an invariant kernel chosen at load
    (WeightPack, InvariantLinear, FunctionalLinear), and F.linear's oneDNN / MKL GEMMs round
    a row differently with the rows beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.linear:
            self.shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def alone_and_batched(model: str | None, vocab: int, **kw) -> tuple[list, list]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, dtype="bfloat16", skip_tokenizer_init=True,
                  enable_prefix_caching=False, batch_invariant=True, **kw)
    try:
        ps = prompts(vocab)
        alone = [generate(llm, [p])[0] for p in ps]
        with PlainLinears() as plain:
            batched = generate(llm, ps)
        assert plain.shapes == [], f"F.linear ran in the mode on weights {plain.shapes}"
        return alone, batched
    finally:
        llm.shutdown()


@pytest.mark.parametrize("which", ["qwen3_moe", "v4", "v41"])
def test_a_prompt_gets_the_same_tokens_alone_and_in_a_mixed_batch(which, measured_kernels,
                                                                  request):
    model, vocab = {"qwen3_moe": (None, 2048), "v4": (str(ASSETS / "shakespeare-v4-tiny"), 4096),
                    "v41": (str(ASSETS / "shakespeare-v41-tiny"), 4096)}[which]
    if which == "qwen3_moe":
        model = request.getfixturevalue("qwen3_moe_dir")
    alone, batched = alone_and_batched(model, vocab)
    assert all(len(t) == NEW for t in alone)
    assert batched == alone, [i for i, (a, b) in enumerate(zip(alone, batched)) if a != b]


def _model(which: str, request) -> tuple[str | None, int]:
    if which == "qwen3_moe":
        return request.getfixturevalue("qwen3_moe_dir"), 2048
    return {"v4": (str(ASSETS / "shakespeare-v4-tiny"), 4096),
            "v41": (str(ASSETS / "shakespeare-v41-tiny"), 4096)}[which]


def _mode_llm(model: str | None, **kw) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(model, dtype="bfloat16", skip_tokenizer_init=True, batch_invariant=True,
                   **kw)


def _bits(llm: LLM, batch: list[list[int]], prompt_lps: bool = False, new: int = 4) -> list:
    """Per prompt: (greedy tokens, their logprobs and top-2, and the prompt's logprobs), the
    floats as they came out (compared exactly)."""
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=2,
                        prompt_logprobs=0 if prompt_lps else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
             [next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] if prompt_lps
             else None) for o in outs]


@pytest.mark.parametrize("which", ["qwen3_moe", "v4", "v41"])
def test_whole_chunked_and_prefix_hit_prefills_give_the_same_bits(which, measured_kernels,
                                                                  request):
    # A 300-token prompt (past V4's 128-token window) prefilled whole, in chunks where other
    # prompts share the 320-token budget (split 283 + 17 and 70 + 230), and after a 256-token
    # prefix-cache hit: its prompt logprobs, greedy tokens and their logprobs bit-identical.
    # (Before the fix, Qwen3-MoE's fresh prefill took SDPA and its chunks the C++ op: the
    # logprobs differed from the 3rd-6th digit; docs/cpu_kernels.md, "Batch invariance".)
    model, vocab = _model(which, request)
    g = torch.Generator().manual_seed(5)
    prompt, short, long, tail = (torch.randint(2, vocab, (n,), generator=g).tolist()
                                 for n in (300, 37, 250, 30))
    forked = prompt[:256] + tail                      # shares 256 tokens with `prompt`
    llm = _mode_llm(model, enable_prefix_caching=True, max_num_batched_tokens=320)
    try:
        forked_cold = _bits(llm, [forked])[0]          # cold, and now cached
        whole = _bits(llm, [prompt], prompt_lps=True)[0]     # prompt logprobs: no cache
        chunked = [_bits(llm, [other, prompt], prompt_lps=True)[1] for other in (short, long)]
        hits = llm.engine.get_stats().prefix_hits
        hit = _bits(llm, [prompt])[0]                  # forked's 256 tokens from the cache
        forked_hit = _bits(llm, [forked])[0]
        hits = llm.engine.get_stats().prefix_hits - hits
    finally:
        llm.shutdown()
    assert hits >= 2 * 256, hits
    assert len(whole[2]) == 299 and len(whole[1]) == 4
    for got in chunked:
        assert got[2] == whole[2], [i for i, (x, y) in enumerate(zip(got[2], whole[2]))
                                    if x != y]
        assert got[:2] == whole[:2]
    assert hit[:2] == whole[:2] and forked_hit[:2] == forked_cold[:2]


def test_mtp_k3_gives_the_bits_of_decoding_without_speculation(measured_kernels):
    # greedy tokens and their logprobs (verification runs 4 positions at once)
    outs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        llm = _mode_llm(None, enable_prefix_caching=False, speculative_config=spec)
        try:
            outs.append(_bits(llm, prompts(4096), new=NEW))
            stats = llm.engine.get_stats() if spec else {}
        finally:
            llm.shutdown()
    assert stats.spec_decode.num_drafts > 0
    assert outs[1] == outs[0], [i for i, (a, b) in enumerate(zip(*outs)) if a != b]


@pytest.mark.parametrize("which", ["qwen3_moe", "v4"])
def test_preemption_and_ngram_speculation_keep_the_bits(which, measured_kernels, request):
    # A pool of 5 blocks for 9 requests (recompute after preemption, chunks cut by the pool)
    # and n-gram drafts (2 prompts repeat themselves) give the tokens and logprobs of a roomy
    # engine without speculation. (V4 failed before lane_aligned: a chunk of 47 rows put the
    # mHC sigmoid of rows 32-46 on ATen's scalar tail, 1 ulp from the whole prefill's.)
    model, vocab = _model(which, request)
    g = torch.Generator().manual_seed(3)
    batch = prompts(vocab) + [torch.randint(2, vocab, (6,), generator=g).tolist() * 8
                              for _ in range(2)]
    runs, stats = [], []
    for kw in ({}, dict(max_num_batched_tokens=64, num_blocks_override=5, max_num_seqs=16),
               dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})):
        llm = _mode_llm(model, enable_prefix_caching=False, **kw)
        try:
            runs.append(_bits(llm, batch, new=24))
            stats.append(llm.engine.get_stats())
        finally:
            llm.shutdown()
    assert stats[1].num_preemptions > 0 and stats[2].spec_decode.num_drafts > 0
    for got in runs[1:]:
        assert got == runs[0], [i for i, (a, b) in enumerate(zip(got, runs[0])) if a != b]


def test_prefill_decode_over_loopback_gives_the_colocated_tokens(measured_kernels):
    p, d, ref = make_engines(None, dtype="bfloat16", batch_invariant=True,
                             enable_prefix_caching=False, kv_cache_memory=1 << 25)
    ps = prompts(4096)
    assert run_pd(p, d, ps, NEW) == run_colocated(ref, ps, NEW)


def test_the_mode_is_a_config_field_set_by_the_llm_keyword_and_the_cli_flag():
    import argparse

    from wideserve.config import engine_config_from_kwargs
    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    assert engine_config_from_kwargs().kernels.batch_invariant is False
    cfg = engine_config_from_kwargs(batch_invariant=True, kernel_config={"cpu_argmax": False})
    assert cfg.kernels.batch_invariant and not cfg.kernels.cpu_argmax
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--batch-invariant"])).kernels \
        .batch_invariant
    assert not engine_config_from_args(parser.parse_args([])).kernels.batch_invariant


def test_the_engine_kernel_config_reaches_the_gqa_attention_config():
    # Each KernelConfig switch lands on its own PagedAttentionConfig field. batch_invariant
    # once went positionally into sdpa_context: the mode kept SDPA prefills (so whole and
    # chunked prefills differed) and the default mode had the chunked-context SDPA off.
    import dataclasses

    from wideserve.config import KernelConfig
    from wideserve.models.registry import resolve_model_class
    config = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, max_position_embeddings=64)
    cls = resolve_model_class(config)
    model = cls(cls.config_class.from_dict(config))
    for kernels in (KernelConfig(), KernelConfig(batch_invariant=True),
                    KernelConfig(cpu_attention=False, sdpa_prefill=False,
                                 fused_kv_write=False)):
        model.apply_kernel_config(kernels)
        got = dataclasses.asdict(model.model.attention_config)
        assert got == dict(cpu_kernel=kernels.cpu_attention, sdpa_prefill=kernels.sdpa_prefill,
                           fused_kv_write=kernels.fused_kv_write, sdpa_context=True,
                           batch_invariant=kernels.batch_invariant), (kernels, got)


def test_lane_aligned_elementwise_gives_a_row_the_same_bits_at_any_row_count():
    # mHC's sigmoid over [T, n] and the router's softplus over [T, E]: ATen's scalar tail of
    # a flat buffer rounds exp differently from its vector code; padded rows never reach it.
    from wideserve.layers.linear import lane_aligned
    g = torch.Generator().manual_seed(6)
    z = torch.randn(200, 4, generator=g) * 4
    for fn in (torch.sigmoid, F.softplus):
        full = lane_aligned(fn, z, True)
        assert torch.allclose(full, fn(z), rtol=1e-6, atol=0)
        assert [m for m in range(1, 201)
                if not torch.equal(lane_aligned(fn, z[:m], True), full[:m])] == []
