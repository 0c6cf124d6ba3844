"""The GQA models' decode forward on the code paths it takes on CUDA (tests/cuda_paths.py),
under CaptureGuard (worker/capture_guard.py): it does nothing a CUDA graph cannot record,
records the same ops and shapes whatever the contexts and tokens, and equals the reference
backend; the CPU paths, the host-planned attention and the syncing experts fail the same
guard. And `decode_capturable` says so on CUDA only where it holds (docs/cuda_graphs.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cuda_paths import allow_batch, force_cuda_paths
from paged_harness import PagedHarness
from test_paged_backends import build
from wideserve.worker.capture_guard import CaptureGuard, CaptureViolation
from wideserve.layers import experts

CUDA = torch.device("cuda")


def _decode_steps(model, guard_from: int, steps: int = 4, prompts=(7, 12, 3)):
    """Prefill the prompts, then `steps` decode steps; steps >= guard_from run guarded (the
    earlier ones are the warm-up). Returns (logits per decode step, traces of the guarded)."""
    g = torch.Generator().manual_seed(5)
    h = PagedHarness(model, max_reqs=len(prompts), max_len=32, block_size=4)
    slots = list(range(len(prompts)))
    h.step(slots, [torch.randint(0, 96, (n,), generator=g).tolist() for n in prompts])
    guard = None
    logits, traces = [], []
    for i in range(steps):
        tokens = [[int(t)] for t in torch.randint(0, 96, (len(prompts),), generator=g)]
        if i < guard_from:
            logits.append(h.step(slots, tokens))
            continue
        guard = guard or CaptureGuard()

        def guarded(batch):
            allow_batch(guard, batch)
            with guard:
                hidden = model.forward(batch)
            traces.append(guard.trace)
            return model.compute_logits(hidden)
        logits.append(h.run(slots, tokens, guarded))
    return logits, traces


@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen2-window"])
def test_cuda_decode_path_is_capturable(variant, monkeypatch) -> None:
    """Forced CUDA paths: two guarded decode steps (other contexts, other tokens) pass the
    guard with identical traces, and every step's logits equal the reference backend's."""
    want, _ = _decode_steps(build(variant, "reference"), guard_from=99)
    model = build(variant, None)
    force_cuda_paths(monkeypatch, model)
    got, traces = _decode_steps(model, guard_from=2)
    assert len(traces) == 2 and traces[0] == traces[1]
    ops = {op for op, _ in traces[0]}
    assert "aten.index_copy_.default" in ops                 # the KV write
    if variant == "qwen3-moe":
        assert "aten._grouped_mm.default" in ops
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cuda_decode_path_is_capturable_in_bf16(monkeypatch) -> None:
    """bf16 is where the CPU picks most of its C++ ops (GEMM micro-kernel, fused router and
    experts): forced to the CUDA paths none of them runs (the guard would reject it)."""
    model = build("qwen3-moe", None).to(torch.bfloat16)
    force_cuda_paths(monkeypatch, model)
    got, traces = _decode_steps(model, guard_from=2)
    assert len(traces) == 2 and traces[0] == traces[1]
    assert all(torch.isfinite(x).all() for x in got)


def test_the_guard_fails_the_other_paths(monkeypatch) -> None:
    """The guard is not vacuous on the real forward: the CPU default (C++ ops), the
    host-planned attention (the reference's boolean-mask write, the buckets' host-built
    indices) and the experts that read counts on the host (padded, loop) each fail it."""
    with pytest.raises(CaptureViolation, match="CPU-only"):
        _decode_steps(build("qwen3-moe", None), guard_from=1, steps=2)
    buckets = build("qwen3-moe", None)
    force_cuda_paths(monkeypatch, buckets)
    buckets.set_attention_backend("reference")
    with pytest.raises(CaptureViolation):
        _decode_steps(buckets, guard_from=1, steps=2)
    buckets.set_attention_backend("batched")          # on the CPU: the host-planned buckets
    with pytest.raises(CaptureViolation, match="built during the forward"):
        _decode_steps(buckets, guard_from=1, steps=2)
    for impl in ("padded", "loop"):
        model = build("qwen3-moe", None)
        force_cuda_paths(monkeypatch, model)
        for m in model.modules():
            if isinstance(m, experts.RoutedExperts):
                m.impl, m._resolved = impl, {}
        with pytest.raises(CaptureViolation, match="reads a device value"):
            _decode_steps(model, guard_from=1, steps=2)


def test_decode_capturable(monkeypatch) -> None:
    """True on CUDA for the default backend and grouped_mm experts; False on the CPU, for a
    host-planned backend, for experts that sync and under an expert-parallel dispatcher."""
    dense = build("qwen2-window", None)
    assert dense.decode_capturable(CUDA) and not dense.decode_capturable(torch.device("cpu"))
    dense.set_attention_backend("reference")
    assert not dense.decode_capturable(CUDA)
    moe = build("qwen3-moe", None)
    assert not moe.decode_capturable(CUDA)      # this torch has no CUDA: no grouped_mm there
    monkeypatch.setattr(experts, "_grouped_mm_runs", lambda *a: True)
    moe = build("qwen3-moe", None)
    assert moe.decode_capturable(CUDA)
    layer = next(m for m in moe.modules() if isinstance(m, experts.RoutedExperts))
    layer.ep = SimpleNamespace(capturable=False)     # a dispatcher whose exchange syncs
    assert not moe.decode_capturable(CUDA)
    layer.ep = SimpleNamespace(capturable=True)      # the padded one (layers/ep_dispatch.py)
    assert moe.decode_capturable(CUDA)
    layer.ep, layer.impl, layer._resolved = None, "padded", {}
    assert not moe.decode_capturable(CUDA)
