"""KernelConfig: the CPU-op switches are per engine (per model object), not per process.

Two models in one process: the one given KernelConfig with every op off runs none of the
wideserve C++ ops and gives the same greedy tokens as the default; the other keeps running
them. The sampler and the worker hold their own `cpu_argmax`."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paged_harness import PagedHarness
from test_paged_backends import build
from wideserve.config import KernelConfig, engine_config_from_kwargs
from wideserve.worker.sampler import argmax_rows
from wideserve.kernels.loader import cpu_ops_available

OFF = KernelConfig(cpu_norm=False, cpu_rope=False, cpu_gemm=False, cpu_attention=False,
                   sdpa_prefill=False, fused_kv_write=False, cpu_argmax=False)
pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU ops are not built")


class _WideserveOps(TorchDispatchMode):
    """Records the torch.ops.wideserve ops dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "wideserve":
            self.ops.add(func.name().split("::")[-1])
        return func(*args, **(kwargs or {}))


def _greedy(model) -> tuple[list[list[int]], set[str]]:
    """Prefill three prompts and decode two steps: the greedy tokens and the C++ ops seen."""
    h = PagedHarness(model, max_reqs=3, max_len=32, block_size=4)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 12, 3)]
    out: list[list[int]] = []
    with _WideserveOps() as seen, torch.inference_mode():
        for _ in range(3):
            logits = h.step([0, 1, 2], tokens)                     # [T, V], every row
            last = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
            tokens = [[int(t)] for t in logits[last].argmax(-1)]
            out.append([t[0] for t in tokens])
    return out, seen.ops


def test_each_model_keeps_its_own_switches() -> None:
    fast, plain = build("qwen3-moe", None), build("qwen3-moe", None)
    plain.apply_kernel_config(OFF)
    assert plain.model.attention_config.cpu_kernel is False
    assert fast.model.attention_config.cpu_kernel is True
    want, fast_ops = _greedy(fast)
    got, plain_ops = _greedy(plain)
    assert got == want
    assert plain_ops == set()                        # every op off: the torch paths
    assert {"rms_norm", "add_rms_norm"} & fast_ops   # the other model still runs them
    assert any(op.startswith("paged_attention") for op in fast_ops)


def test_argmax_switch_is_the_callers() -> None:
    x = torch.randn(3, 50)
    with _WideserveOps() as seen:
        assert torch.equal(argmax_rows(x, cpu_op=False), x.argmax(-1))
    assert seen.ops == set()
    with _WideserveOps() as seen:
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert seen.ops == {"argmax_rows"}


def test_engine_config_takes_kernel_config() -> None:
    cfg = engine_config_from_kwargs(kernel_config={"cpu_attention": False})
    assert cfg.kernels == KernelConfig(cpu_attention=False)
    assert engine_config_from_kwargs().kernels == KernelConfig()
    with pytest.raises(TypeError, match="cpu_attn"):
        engine_config_from_kwargs(kernel_config={"cpu_attn": False})


@pytest.mark.skipif(not __import__("wideserve.kernels.lossless").kernels.lossless.available(),
                    reason="the coded experts op needs AMX-BF16 and the AVX512-BF16 build")
def test_lossless_experts_switch_gives_the_same_tokens() -> None:
    """KernelConfig.lossless_experts: a bf16 Qwen3-MoE's experts run the coded op and give
    the greedy tokens of the bf16 packs on brgemm (the coded products equal those)."""
    from wideserve.kernels.choice import KernelChoice, KernelPolicy
    from wideserve.layers.experts import RoutedExperts
    models = [build("qwen3-moe", None).to(torch.bfloat16) for _ in range(2)]
    models[1].apply_kernel_config(KernelConfig(lossless_experts=True))
    for model in models:
        for m in model.modules():
            if isinstance(m, RoutedExperts):
                m.kernel_choice = KernelChoice(KernelPolicy(force="brgemm", cache_dir=None))
    (want, plain_ops), (got, coded_ops) = (_greedy(m) for m in models)
    assert got == want
    assert "moe_fused_experts_lossless" in coded_ops
    assert "moe_fused_experts_lossless" not in plain_ops
    assert engine_config_from_kwargs(lossless_experts=True).kernels.lossless_experts == "on"


def test_lossless_experts_flag() -> None:
    """`--lossless-experts [auto|on|off]` and LLM(lossless_experts=...) set
    KernelConfig.lossless_experts ("auto" by default; the flag alone and True mean "on");
    anything else is a clear error naming the setting."""
    import argparse
    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], "auto"), (["--lossless-experts"], "on"),
                       (["--lossless-experts", "off"], "off")):
        assert engine_config_from_args(parser.parse_args(argv)).kernels.lossless_experts == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--lossless-experts", "yes"])
    assert engine_config_from_kwargs().kernels.lossless_experts == "auto"
    for value, want in ((True, "on"), (False, "off"), ("off", "off")):
        assert engine_config_from_kwargs(lossless_experts=value).kernels.lossless_experts == want
    assert engine_config_from_kwargs(
        kernel_config={"lossless_experts": True}).kernels.lossless_experts == "on"
    with pytest.raises(ValueError, match="lossless_experts"):
        engine_config_from_kwargs(lossless_experts="sometimes")
