"""The fused routed-experts C++ op (wideserve/kernels/csrc/moe.cpp) against a per-token fp64
oracle and the readable loop, on random shapes: empty experts, empty and single-token
batches, every row on one expert, odd widths, the SwiGLU limit clamp, bf16 and fp32, through
both the AVX512-BF16 and the portable paths; the default choice. (RoutedExperts("fused")
following weight writes after packing: tests/layers/test_experts.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wideserve.kernels import loader
from wideserve.kernels import moe as moe_op
from wideserve.layers.experts import RoutedExperts, swiglu


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    return loader.build()        # a compiler error fails every test here, never a skip


CASES = {  # name: (experts, k, hidden, intermediate, tokens, limit, routing)
    "half-empty": (8, 2, 32, 48, 37, None, "half"),
    "odd-widths": (4, 2, 33, 12, 7, None, "all"),
    "single-token": (6, 3, 16, 40, 1, None, "all"),
    "one-expert": (5, 4, 24, 16, 6, None, "one"),      # all T*k rows on expert 0
    "limit-clamp": (16, 4, 32, 16, 19, 0.5, "half"),
    "empty-batch": (4, 2, 16, 16, 0, None, "all"),
    "wide-tiles": (3, 2, 80, 200, 21, 1.0, "all"),     # >1 row tile, output-block tails
    "top-1": (6, 1, 32, 16, 9, None, "all"),          # each token's one row writes it
    # expert e gets e + 1 rows: every split into a full first tile and balanced passes (1-17
    # rows: 1-14 in one up pass, 15 as 8 + 7 and 17 as 8 + 5 + 4 up, 17 as 7 + 5 + 5 down),
    # the tiles that stream the next group ahead
    "ramp": (17, 1, 160, 48, 153, None, "ramp"),
}


def _weights(E: int, d: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, d, generator=g) * 0.3, torch.randn(E, d, I, generator=g) * 0.3


def _routing(T: int, E: int, k: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        ids = torch.zeros(T, k, dtype=torch.int64)
    elif kind == "ramp":
        ids = torch.cat([torch.full((e + 1,), e) for e in range(E)]).view(T, k)
        ids = ids[torch.randperm(T, generator=g)]
    else:
        used = max(k, E // 2) if kind == "half" else E
        rows = [torch.randperm(used, generator=g)[:k] for _ in range(T)]
        ids = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)
    return ids, torch.rand(T, k, generator=g)


def _oracle(x, ids, w, w1, w2, limit) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w1[e].double() @ x[t].double()).chunk(2)
            out[t] += float(w[t, j]) * (w2[e].double() @ swiglu(gate, up, limit))
    return out


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_op_matches_oracle(case: str, dtype: torch.dtype, portable: bool) -> None:
    E, k, d, I, T, limit, kind = CASES[case]
    w1, w2 = (t.to(dtype) for t in _weights(E, d, I, seed=E + d))
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).to(dtype)
    ids, w = _routing(T, E, k, kind, seed=T + k)
    packed = moe_op.pack_experts(w1, w2)
    got = moe_op.fused_experts(x, ids, w.to(dtype), *packed, I, limit, portable)
    assert got.dtype == dtype and got.shape == (T, d)
    want = _oracle(x, ids, w.to(dtype), w1, w2, limit)
    scale = max(want.abs().max().item(), 1.0) if T else 1.0
    # bf16: the activation and the output are rounded once each (fp32 accumulation).
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("inter", [16, 200], ids=["block-items", "block-ranges"])
def test_two_threads_give_the_one_thread_result(inter: int, dtype: torch.dtype) -> None:
    """Phase 1 splits blocks of I into per-thread ranges when there are enough (200 -> 13
    blocks), else (block, expert) items (16 -> 1 block); either way every output element is
    computed by one thread in the same order: bit-identical to one thread."""
    E, k, d, T = 8, 2, 48, 29
    w1, w2 = (t.to(dtype) for t in _weights(E, d, inter, seed=11))
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(6)).to(dtype)
    ids, w = _routing(T, E, k, "half", seed=7)
    packed = moe_op.pack_experts(w1, w2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_op.fused_experts(x, ids, w.to(dtype), *packed, inter, None)
        torch.set_num_threads(2)
        two = moe_op.fused_experts(x, ids, w.to(dtype), *packed, inter, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_limit_changes_the_result() -> None:
    """The clamp case really clamps (else the oracle comparison above could not tell)."""
    E, k, d, I, T, limit, kind = CASES["limit-clamp"]
    w1, w2 = _weights(E, d, I, seed=E + d)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(T))
    ids, w = _routing(T, E, k, kind, seed=T + k)
    packed = moe_op.pack_experts(w1, w2)
    clamped = moe_op.fused_experts(x, ids, w, *packed, I, limit)
    free = moe_op.fused_experts(x, ids, w, *packed, I, None)
    assert (clamped - free).abs().max() > 0.1


def test_fast_path_is_compiled_where_the_cpu_has_avx512_bf16() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    assert moe_op.fast_path_compiled() == ("avx512_bf16" in flags)


def test_bad_input_is_a_clear_error() -> None:
    w1, w2 = _weights(4, 16, 16, seed=0)
    packed = moe_op.pack_experts(w1, w2)
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        moe_op.fused_experts(x, torch.tensor([[0], [4], [1]]), torch.ones(3, 1), *packed, 16,
                             None)
    with pytest.raises(RuntimeError, match="do not match"):
        moe_op.fused_experts(x, torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1),
                             *packed, 32, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        moe_op.fused_experts(x.half(), torch.zeros(3, 1, dtype=torch.int64),
                             torch.ones(3, 1), *(p.half() for p in packed), 16, None)


def test_default_choice_and_fallback() -> None:
    """bf16 on a CPU with the fast path: fused by default; fp32 keeps the torch path; an
    explicit "fused" in a dtype the op lacks (fp16) falls back to a torch impl and still
    computes the experts."""
    m = RoutedExperts(4, 16, 16)
    fast = moe_op.fast_path_compiled()
    assert (m.resolved_impl(torch.device("cpu"), torch.bfloat16) == "fused") == fast
    assert m.resolved_impl(torch.device("cpu"), torch.float32) != "fused"
    w1, w2 = _weights(4, 16, 16, seed=5)
    fused, ref = RoutedExperts(4, 16, 16, impl="fused"), RoutedExperts(4, 16, 16, impl="loop")
    for mod in (fused, ref):
        with torch.no_grad():
            mod.gate_up_proj.copy_(w1)
            mod.down_proj.copy_(w2)
        mod.half()
    assert fused.resolved_impl(torch.device("cpu"), torch.float16) != "fused"
    x = torch.randn(5, 16).half()
    ids, w = _routing(5, 4, 2, "all", seed=3)
    torch.testing.assert_close(fused(x, ids, w), ref(x, ids, w), rtol=2e-2, atol=2e-2)


def test_op_maps_logical_ids_and_counts_loads() -> None:
    """expert_map [E, 1] maps logical ids to their physical slot inside the op, and
    expert_load gains each physical expert's row count (EPLB's counters), accumulating."""
    E, k, d, I, T = 6, 2, 16, 16, 11
    w1, w2 = _weights(E, d, I, seed=7)
    packed = moe_op.pack_experts(w1, w2)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(1))
    ids, w = _routing(T, E, k, "half", seed=2)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(3))
    load = torch.zeros(E, dtype=torch.int64)
    mapped = moe_op.fused_experts(x, ids, w, *packed, I, None, expert_map=perm[:, None],
                                  expert_load=load)
    direct = moe_op.fused_experts(x, perm[ids], w, *packed, I, None)
    assert torch.equal(mapped, direct)
    assert load.tolist() == torch.bincount(perm[ids].flatten(), minlength=E).tolist()
    moe_op.fused_experts(x, ids, w, *packed, I, None, expert_map=perm[:, None],
                         expert_load=load)
    assert load.tolist() == (2 * torch.bincount(perm[ids].flatten(), minlength=E)).tolist()
    with pytest.raises(RuntimeError, match="logical expert id"):
        moe_op.fused_experts(x, ids + E, w, *packed, I, None, expert_map=perm[:, None])
    with pytest.raises(RuntimeError, match="expert_load"):
        moe_op.fused_experts(x, ids, w, *packed, I, None, expert_load=load[:3])


def test_module_with_replicas_matches_loop() -> None:
    """Two replicas per logical expert (W = 2): the fused module spreads rows over them as
    map_to_physical does, computes the loop's outputs and counts the same physical loads."""
    E, k, d, I, T = 4, 2, 16, 24, 13
    mods = {}
    for impl in ("fused", "loop"):
        m = RoutedExperts(E, d, I, num_local_experts=2 * E, impl=impl)
        w1, w2 = _weights(E, d, I, seed=9)
        with torch.no_grad():                 # physical slot p holds logical expert p % E
            m.gate_up_proj.copy_(w1.repeat(2, 1, 1))
            m.down_proj.copy_(w2.repeat(2, 1, 1))
        m.logical_to_physical = torch.stack([torch.arange(E), torch.arange(E) + E], dim=1)
        m.replica_count.fill_(2)
        mods[impl] = m
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(4))
    ids, w = _routing(T, E, k, "all", seed=5)
    torch.testing.assert_close(mods["fused"](x, ids, w), mods["loop"](x, ids, w),
                               rtol=1e-5, atol=1e-5)
    assert mods["fused"].expert_load.tolist() == mods["loop"].expert_load.tolist()
    assert (mods["fused"].expert_load[E:] > 0).any()         # the second replicas got rows
