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


def test_mtp_k3_gives_the_tokens_of_decoding_without_speculation(measured_kernels):
    outs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(None, dtype="bfloat16", skip_tokenizer_init=True, batch_invariant=True,
                      enable_prefix_caching=False, speculative_config=spec)
        try:
            outs.append(generate(llm, prompts(4096)))
            stats = llm.engine.get_stats() if spec else {}
        finally:
            llm.shutdown()
    assert stats.spec_decode.num_drafts > 0
    assert outs[1] == outs[0], [i for i, (a, b) in enumerate(zip(*outs)) if a != b]


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
