"""Routed experts: every fused implementation against the per-expert loop and a per-token
oracle, on random shapes, with empty experts, single-token batches and a remapped expert map."""
from __future__ import annotations

import pytest
import torch

from wideserve.layers.experts import EXPERT_IMPLS, RoutedExperts, swiglu

SHAPES = [  # (experts, k, hidden, intermediate, tokens)
    (8, 2, 32, 48, 1), (8, 2, 32, 48, 37), (16, 4, 24, 16, 5), (5, 1, 16, 8, 64),
    (32, 8, 16, 24, 3), (4, 2, 16, 8, 0)]


def _experts(E: int, d: int, I: int, impl: str, limit: float | None = None,
             dtype: torch.dtype = torch.float32) -> RoutedExperts:
    g = torch.Generator().manual_seed(E * 1000 + d)
    m = RoutedExperts(E, d, I, swiglu_limit=limit, impl=impl)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 0.3)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * 0.3)
    return m.to(dtype)


def _oracle(m: RoutedExperts, x: torch.Tensor, ids: torch.Tensor,
            w: torch.Tensor) -> torch.Tensor:
    """Per token, per pick: w * expert(x), summed in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(m.logical_to_physical[ids[t, j]])
            gate, up = (m.gate_up_proj[e].double() @ x[t].double()).chunk(2)
            y = m.down_proj[e].double() @ swiglu(gate, up, m.swiglu_limit)
            out[t] += float(w[t, j]) * y
    return out


def _routing(T: int, E: int, k: int, seed: int, used: int | None = None):
    """Random distinct top-k ids among the first `used` experts (others stay empty)."""
    g = torch.Generator().manual_seed(seed)
    used = E if used is None else used
    ids = [torch.randperm(used, generator=g)[:k] for _ in range(T)]
    ids = torch.stack(ids) if ids else torch.zeros(0, k, dtype=torch.int64)
    return ids, torch.rand(T, k, generator=g)


@pytest.mark.parametrize("impl", EXPERT_IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_matches_per_token_oracle(impl: str, shape: tuple[int, ...]) -> None:
    E, k, d, I, T = shape
    m = _experts(E, d, I, impl, limit=1.5 if E == 16 else None)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(T))
    used = max(k, E // 2)                       # half the experts get no rows at all
    ids, w = _routing(T, E, k, seed=E + T, used=used)
    out = m(x, ids, w)
    torch.testing.assert_close(out.double(), _oracle(m, x, ids, w), rtol=1e-5, atol=1e-5)
    assert m.expert_load.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
    assert m.expert_load[used:].sum() == 0


@pytest.mark.parametrize("impl", [i for i in EXPERT_IMPLS if i != "loop"])
def test_grouped_mlp_matches_loop_bf16(impl: str) -> None:
    """Same rows, same experts: the fast paths give the reference loop's values in bf16."""
    E, d, I = 12, 32, 64
    ref, fast = _experts(E, d, I, "loop", dtype=torch.bfloat16), \
        _experts(E, d, I, impl, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 29):
        x = torch.randn(n, d, generator=g).bfloat16()
        slots = torch.randint(0, E // 3, (n,), generator=g)        # most experts empty
        torch.testing.assert_close(fast.grouped_mlp(x, slots), ref.grouped_mlp(x, slots),
                                   rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("impl", ["grouped_mm", "fused"])
def test_logical_to_physical_map_and_ep_hook(impl: str) -> None:
    """A permuted map over permuted weights computes the same function; loads count physical
    slots; a dispatcher set on `ep` receives the physical ids and its result is returned."""
    E, k, d, I, T = 8, 2, 16, 24, 9
    m = _experts(E, d, I, impl)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(0))
    ids, w = _routing(T, E, k, seed=1)
    expected = m(x, ids, w)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(2))   # logical -> physical
    moved = _experts(E, d, I, impl)
    with torch.no_grad():
        moved.gate_up_proj[perm] = m.gate_up_proj
        moved.down_proj[perm] = m.down_proj
    moved.logical_to_physical.copy_(perm[:, None])          # [E, 1]: one replica each
    torch.testing.assert_close(moved(x, ids, w), expected)
    assert moved.expert_load.tolist() == m.expert_load[perm.argsort()].tolist()

    class LocalDispatcher:
        """Stands in for an all-to-all dispatcher on one rank: every slot is local."""

        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def forward(self, experts: RoutedExperts, x: torch.Tensor, phys: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
            self.seen.append(phys)
            y = experts.grouped_mlp(x.repeat_interleave(phys.shape[1], 0), phys.flatten())
            return (y.view(*phys.shape, x.shape[1]) * weights[..., None]).sum(1)

    moved.ep = LocalDispatcher()
    torch.testing.assert_close(moved(x, ids, w), expected)
    assert torch.equal(moved.ep.seen[0], perm[ids])


def test_unknown_impl_names_the_choices() -> None:
    with pytest.raises(ValueError, match="grouped_mm"):
        RoutedExperts(4, 8, 8, impl="fast")


@pytest.mark.parametrize("intermediate", [12, 10])
def test_grouped_mm_falls_back_when_row_strides_are_not_16_byte_aligned(
        intermediate: int) -> None:
    """torch._grouped_mm needs 16-byte row strides: bf16 with I = 12 or 10 must take the
    padded path (not raise) and still equal the loop."""
    E, d = 4, 24
    fast = _experts(E, d, intermediate, "grouped_mm", dtype=torch.bfloat16)
    ref = _experts(E, d, intermediate, "loop", dtype=torch.bfloat16)
    assert fast.resolved_impl(torch.device("cpu"), torch.bfloat16) == "padded"
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(3)).bfloat16()
    ids, w = _routing(9, E, 2, seed=5)
    torch.testing.assert_close(fast(x, ids, w), ref(x, ids, w), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["packed", "fused"])
@pytest.mark.parametrize("T", [0, 1, 23])
def test_packed_bf16_matches_loop_and_sees_weight_writes(T: int, impl: str) -> None:
    """The CPU paths over derived weight copies (bf16) against the loop on routed tokens (most
    experts empty), then after the weights change: in place (version counter), through
    `.data` with weights_changed() (as EPLB writes), and by replacement (`.data = `)."""
    E, k, d, I = 16, 2, 32, 48
    fast = _experts(E, d, I, impl, dtype=torch.bfloat16)
    ref = _experts(E, d, I, "loop", dtype=torch.bfloat16)
    assert fast.resolved_impl(torch.device("cpu"), torch.bfloat16) == impl
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, E, k, seed=T, used=5)
    # packed runs the loop's oneDNN GEMMs bit for bit; fused rounds only its activation and
    # output to bf16 (fp32 in between), so it differs from the loop by bf16 rounding.
    tol = 0 if impl == "packed" else 2e-2

    def check() -> None:
        want = ref(x, ids, w)
        scale = want.abs().max().item() if T else 0.0
        torch.testing.assert_close(fast(x, ids, w), want, rtol=tol, atol=tol * scale)

    check()
    g = torch.Generator().manual_seed(9)
    writes = [lambda p, new: p.copy_(new),
              lambda p, new: (p.data.copy_(new), fast.weights_changed()),
              lambda p, new: setattr(p, "data", new.clone())]
    for write in writes:
        with torch.no_grad():
            for p, q in ((fast.gate_up_proj, ref.gate_up_proj), (fast.down_proj, ref.down_proj)):
                new = (torch.randn(p.shape, generator=g) * 0.3).bfloat16()
                write(p, new)
                q.copy_(new)
        check()
