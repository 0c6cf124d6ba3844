"""KernelConfig.lossless_experts "auto" (worker/lossless_choice.py): the decision from the
mode, the last-level cache, the memory available and the timings; an engine on a model whose
experts fit in the cache keeps bf16 without timing anything; one whose experts do not (the
cache size patched down) times both forms, keeps the faster, frees the other and serves on the
one it kept."""
from __future__ import annotations

import warnings

import pytest
import torch

from wideserve import LLM, SamplingParams
from wideserve.kernels import lossless
from wideserve.layers.expert_packs import FusedPack
from wideserve.layers.experts import RoutedExperts
from wideserve.worker import lossless_choice
from wideserve.worker.lossless_choice import GAIN, decide

MiB = 1 << 20


class _Layer:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def pack_bytes(self) -> int:
        return self.nbytes


def _no_timing() -> tuple[float, float]:
    raise AssertionError("timed where it should not")


def test_decide_by_mode_cache_memory_and_timings() -> None:
    layers = [_Layer(300 * MiB), _Layer(300 * MiB)]
    big = dict(llc=100 * MiB, free=64 << 30)
    assert not decide("off", layers, True, _no_timing, **big).on
    assert decide("on", layers, False, _no_timing, **big).on
    none = decide("on", [], True, _no_timing, **big)
    assert not none.on and "AMX-BF16" in none.note
    fits = decide("auto", layers, True, _no_timing, llc=1024 * MiB, free=64 << 30)
    assert not fits.on and "last-level cache" in fits.note
    assert not decide("auto", layers, False, _no_timing, **big).on      # no warm-up
    short = decide("auto", layers, True, _no_timing, llc=100 * MiB, free=500 * MiB)
    assert not short.on and "available" in short.note
    assert decide("auto", layers, True, lambda: (0.100, 0.100 * GAIN), **big).on
    slow = decide("auto", layers, True, lambda: (0.100, 0.100 * GAIN + 1e-4), **big)
    assert not slow.on and "ms coded" in slow.note


def _checkpoint(tmp_path) -> str:
    from tiny_families import qwen3_moe_checkpoint
    return qwen3_moe_checkpoint(
        tmp_path, torch.bfloat16, vocab_size=96, hidden_size=64, intermediate_size=64,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False)


def _engine(path: str) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, dtype="bfloat16", block_size=16, kv_cache_memory=1 << 24,
                   skip_tokenizer_init=True, lossless_experts="auto")


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)]}
               for i in range(4)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_auto_keeps_bf16_for_experts_in_the_cache(tmp_path, monkeypatch) -> None:
    timed = []
    monkeypatch.setattr(lossless_choice, "measure", lambda *a: timed.append(a) or (1.0, 0.5))
    llm = _engine(_checkpoint(tmp_path))
    experts = [m for m in llm.engine.model.modules() if isinstance(m, RoutedExperts)]
    assert experts and not timed
    assert all(not m.lossless and m._coded is None for m in experts)


@pytest.mark.skipif(not lossless.available(),
                    reason="the coded experts op needs AMX-BF16 and the AVX512-BF16 build")
@pytest.mark.parametrize("coded_faster", [True, False])
def test_auto_times_keeps_one_form_and_frees_the_other(tmp_path, monkeypatch,
                                                       coded_faster: bool) -> None:
    """The cache made small, the timings real but their verdict forced either way (a tiny
    model's steps are too short to compare reliably here): both forms were built and timed,
    one is left."""
    path = _checkpoint(tmp_path)
    real = lossless_choice.measure
    seen = []

    def measure(layers, step):
        plain, coded = real(layers, step)
        seen.append((plain, coded))
        assert all(m._coded is not None and isinstance(m._packs, FusedPack)
                   for m in layers)
        return (1.0, 0.5) if coded_faster else (1.0, 1.0)
    monkeypatch.setattr(lossless_choice, "last_level_cache", lambda: 1)
    monkeypatch.setattr(lossless_choice, "measure", measure)
    llm = _engine(path)
    experts = [m for m in llm.engine.model.modules() if isinstance(m, RoutedExperts)]
    assert len(seen) == 1 and all(t > 0 for t in seen[0])
    for m in experts:
        assert m.lossless is coded_faster
        assert (m._coded is not None) is coded_faster
        assert (m._packs is None) is coded_faster
    monkeypatch.undo()
    assert all(len(t) == 6 for t in _greedy(llm))
    for m in experts:        # the kept form ran the requests; the other was not rebuilt
        assert (m._coded is not None) is coded_faster
        assert (m._packs is None) is coded_faster


def test_last_level_cache_from_sysfs(tmp_path) -> None:
    from wideserve.utils.cpu_cache import last_level_cache_bytes
    for name, level, kind, size in (("index0", 1, "Data", "48K"), ("index1", 1, "Instruction",
                                                                   "32K"),
                                    ("index2", 2, "Unified", "2048K"),
                                    ("index3", 3, "Unified", "491520K")):
        d = tmp_path / name
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 480 * MiB
    assert last_level_cache_bytes(tmp_path / "missing") == 0
