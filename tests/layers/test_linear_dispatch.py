"""WeightPack (layers/linear.py) runs the kernel the choice table picked for each token-count
bucket (wideserve/kernels/choice.py; fake timings, nothing timed for real), holds only the
layouts those kernels read, and every kernel path equals the reference op on random shapes
(M = 0, 1, odd, large; N not a multiple of 16; fused weights with biases; widen)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wideserve.kernels import choice as ch
from wideserve.kernels import loader
from wideserve.kernels.choice import KernelChoice, KernelPolicy
from wideserve.layers import linear as lin
from wideserve.layers.linear import KERNEL_FNS, WeightPack

ROWS = (0, 1, 3, 7, 17, 70, 300)           # every bucket, odd counts, several row blocks


@pytest.fixture(scope="module", autouse=True)
def built():
    return loader.build()        # a compiler error fails every test here, never a skip


def _runnable() -> tuple[str, ...]:
    return KernelChoice(KernelPolicy(cache_dir=None)).runnable("linear", torch.bfloat16)


def _weights(seed: int, outs=(48, 11, 11), k: int = 40):
    g = torch.Generator().manual_seed(seed)
    ws = tuple((torch.randn(n, k, generator=g) * 0.2).bfloat16() for n in outs)
    bs = tuple((torch.randn(n, generator=g).bfloat16() if i != 1 else None)
               for i, n in enumerate(outs))
    return ws, bs


@pytest.mark.parametrize("kernel", ch.KERNELS)
def test_forced_kernel_matches_reference_on_every_bucket(kernel: str, tmp_path) -> None:
    if kernel not in _runnable():
        pytest.skip(f"{kernel} does not run on this CPU (choice.runnable says so)")
    pack = WeightPack(KernelChoice(KernelPolicy(force=kernel, cache_dir=tmp_path)))
    ws, bs = _weights(seed=1)
    for rows in ROWS:
        x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = pack.linear(x, ws, bs)
        assert pack.kernels == (kernel,) * len(ch.BUCKETS)
        want = torch.cat([F.linear(x.double(), w.double(), None if b is None else b.double())
                          for w, b in zip(ws, bs)], dim=-1)
        assert got.shape == (rows, 70) and got.dtype == torch.bfloat16
        scale = max(want.abs().max().item(), 1.0) if rows else 1.0
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * scale)
        wide = pack.linear(x, ws, bs, widen=True)
        assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    if kernel == "onednn":
        assert pack.kind == "onednn"
    elif kernel == "torch":
        assert pack.kind == "plain"
    else:
        assert pack.kind == "gemm"


class _Timer:
    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, family, kernels, shape, rows):
        return {c: self.seconds[c][ch.SAMPLE_ROWS.index(rows)] for c in kernels}


def _choice_with(tmp_path, monkeypatch, seconds) -> KernelChoice:
    monkeypatch.setattr(KernelChoice, "runnable",
                        lambda self, family, dtype: ch.FAMILY_KERNELS[family])
    return KernelChoice(KernelPolicy(cache_dir=tmp_path), timer=_Timer(seconds))


def test_each_bucket_runs_its_chosen_kernel(tmp_path, monkeypatch) -> None:
    """A mixed plan: every call goes to the bucket's kernel (bitwise its direct call)."""
    if not {"micro", "onednn"} <= set(_runnable()):
        pytest.skip("needs the micro-kernel and oneDNN")
    seconds = {"micro": [1, 1, 1, 50, 500, 900], "brgemm": [9, 9, 9, 9, 90, 90],
               "onednn": [5, 5, 5, 5, 5, 5], "torch": [9, 9, 9, 9, 90, 90]}
    pack = WeightPack(_choice_with(tmp_path, monkeypatch, seconds))
    ws, bs = _weights(seed=2)
    for rows in ROWS:
        x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = pack.linear(x, ws, bs)
        call = pack._calls[ch.bucket_of(rows)]
        assert call.kernel == ("micro" if rows <= 16 else "onednn")
        assert call.fn is KERNEL_FNS[call.kernel]
        assert torch.equal(got, call(x))
        assert pack.gemm_call(ws, bs, torch.bfloat16, rows) == call
    assert pack.kernels == ("micro",) * 3 + ("onednn",) * 3
    # two layouts held, because the plan needs both
    assert len({id(c.weight) for c in pack._calls}) == 2 and pack.kind == "gemm"


def test_one_layout_when_a_plan_needs_one(tmp_path, monkeypatch) -> None:
    """micro + brgemm share the packed copy: no oneDNN copy, no concatenated plain copy."""
    seconds = {"micro": [1, 1, 9, 50, 500, 900], "brgemm": [5, 5, 5, 5, 5, 5],
               "onednn": [9, 9, 9, 9, 9, 9], "torch": [9, 9, 9, 9, 90, 90]}
    pack = WeightPack(_choice_with(tmp_path, monkeypatch, seconds))
    ws, bs = _weights(seed=3)
    pack.linear(torch.randn(2, 40).bfloat16(), ws, bs)
    assert pack.kernels == ("micro", "micro") + ("brgemm",) * 4
    assert len({id(c.weight) for c in pack._calls}) == 1


@pytest.fixture
def threads_restored():
    """The tests below set torch's thread count; the process's own comes back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("threads_restored")
def test_thread_count_change_replans(tmp_path, monkeypatch) -> None:
    seen = []

    def plan(self, family, n, k, dtype, allowed=None):
        seen.append(torch.get_num_threads())
        return ("torch",) * len(ch.BUCKETS)
    monkeypatch.setattr(KernelChoice, "plan", plan)
    pack = WeightPack(KernelChoice(KernelPolicy(cache_dir=tmp_path)))
    ws, bs = _weights(seed=4)
    x = torch.randn(3, 40).bfloat16()
    torch.set_num_threads(1)
    pack.linear(x, ws, bs)
    pack.linear(x, ws, bs)
    torch.set_num_threads(2)
    pack.linear(x, ws, bs)
    assert seen == [1, 2]


@pytest.mark.usefixtures("threads_restored")
def test_a_replan_keeps_the_layouts_it_still_needs(tmp_path, monkeypatch) -> None:
    """Another thread count (utils/thread_governor.py) re-plans the same weights: the packed
    copy a kernel of the new plan reads is the one already held; only a layout the new plan
    adds is built, and one it no longer needs is dropped."""
    if not {"micro", "brgemm", "onednn"} <= set(_runnable()):
        pytest.skip("needs the micro-kernel, brgemm and oneDNN")
    plans = {1: ("micro",) * 3 + ("brgemm",) * 3, 2: ("micro",) * 3 + ("onednn",) * 3,
             3: ("onednn",) * 6}
    monkeypatch.setattr(KernelChoice, "plan", lambda self, family, n, k, dtype, allowed=None:
                        plans[torch.get_num_threads()])
    packs = []
    real = lin.gemm.pack_linear
    monkeypatch.setattr(lin.gemm, "pack_linear", lambda w: packs.append(1) or real(w))
    pack = WeightPack(KernelChoice(KernelPolicy(cache_dir=tmp_path)))
    ws, bs = _weights(seed=5)
    x = torch.randn(3, 40).bfloat16()
    torch.set_num_threads(1)
    ref = pack.linear(x, ws, bs)
    panel = pack._calls[0].weight
    torch.set_num_threads(2)
    assert torch.equal(pack.linear(x, ws, bs), ref)            # micro again, at 3 rows
    assert pack._calls[0].weight is panel and len(packs) == 1
    onednn = pack._calls[-1].weight
    torch.set_num_threads(3)
    pack.linear(x, ws, bs)
    assert {id(c.weight) for c in pack._calls} == {id(onednn)}
    torch.set_num_threads(1)
    assert torch.equal(pack.linear(x, ws, bs), ref)
    assert len(packs) == 2                                      # dropped, so packed again


def test_fp32_weights_stay_plain(tmp_path) -> None:
    pack = WeightPack(KernelChoice(KernelPolicy(force="micro", cache_dir=tmp_path)))
    w = torch.randn(24, 40)
    x = torch.randn(5, 40)
    torch.testing.assert_close(pack.linear(x, (w,)), F.linear(x, w), rtol=0, atol=0)
    assert pack.kind == "plain" and pack.gemm_call((w,), (None,), torch.float32, 5) is None


def test_router_route_follows_the_router_plan(tmp_path, monkeypatch) -> None:
    if "brgemm" not in _runnable():
        pytest.skip("torch's bf16 brgemm does not run on this CPU")
    seconds = {"micro": [1, 1, 9, 50, 500, 900], "brgemm": [5, 5, 5, 5, 5, 5]}
    pack = WeightPack(_choice_with(tmp_path, monkeypatch, seconds))
    w = (torch.randn(20, 40) * 0.3).bfloat16()
    x = torch.randn(70, 40).bfloat16()
    ids, wts = pack.route(x, (w,), 4, True)
    assert pack.kernels == ("micro", "micro") + ("brgemm",) * 4
    assert pack.route_brgemm(70) and not pack.route_brgemm(3)
    from wideserve.kernels import gemm
    packed = pack.gemm_pack((w,), (None,), torch.bfloat16)[0]
    want = gemm.route(x, packed, 20, 4, True, brgemm=True)
    assert torch.equal(ids, want[0]) and torch.equal(wts, want[1])
