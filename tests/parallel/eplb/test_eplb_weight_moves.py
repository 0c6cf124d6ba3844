"""EPLB across real processes (gloo): a skewed routing, a rebalance that moves expert weights
rank to rank one layer per step while the MoE keeps running, and afterwards every rank's slots
hold exactly the checkpoint's weights for the experts the (shared) map says it holds. Also with
FP8 block-scaled experts kept in checkpoint format: the codes and their scales move together."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ep_harness import ep_moe, gloo_ranks, reference_moe
from wideserve.parallel.eplb import policy
from wideserve.worker.eplb_balancer import EpGroup, ExpertBalancer
from wideserve.config.eplb import EplbConfig
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.quant import ExpertFormat, expert_format

E, D, I, LAYERS, K, T = 8, 16, 8, 3, 2, 24


def _checkpoint(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + layer)
    return (torch.randn(E, 2 * I, D, generator=g) / 4, torch.randn(E, D, I, generator=g) / 4)


def _routing(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Skewed: experts 0 and 1 take most routings (distinct top-k per token)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(T, D, generator=g)
    probs = torch.tensor([8.0, 6.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25])
    ids = torch.multinomial(probs.expand(T, E), K, generator=g)
    w = torch.rand(T, K, generator=g)
    return x, ids, w / w.sum(-1, keepdim=True)


def _quantised(ckpt: tuple[torch.Tensor, torch.Tensor], fmt: ExpertFormat
               ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(codes and scales: gate_up, its scale, down, its scale; the dequantised checkpoint)."""
    w13, s13, _ = fmt.quantize(ckpt[0], halves=2)
    w2, s2, _ = fmt.quantize(ckpt[1])
    return [w13, s13, w2, s2], (fmt.dequantize(w13, s13, 2, torch.float32),
                                fmt.dequantize(w2, s2, 1, torch.float32))


def _case(rank: int, world: int, redundant: int, group: dist.ProcessGroup,
          fmt: ExpertFormat | None = None) -> None:
    cfg = EplbConfig(window_size=3, step_interval=4, num_redundant_experts=redundant,
                     layers_per_step=1)
    slots = E + redundant
    per_rank = slots // world
    layers = [RoutedExperts(E, D, I, num_local_experts=per_rank) for _ in range(LAYERS)]
    bal = ExpertBalancer("target", layers, E, cfg, EpGroup(rank, world, group),
                         torch.device("cpu"))
    ckpts = [_checkpoint(i) for i in range(LAYERS)]
    stored: list[list[torch.Tensor]] = [list(c) for c in ckpts]   # as the layers hold them
    if fmt is not None:
        for i, layer in enumerate(layers):
            layer.keep_checkpoint_format(fmt)
            stored[i], ckpts[i] = _quantised(ckpts[i], fmt)
        bal = ExpertBalancer("target", layers, E, cfg, EpGroup(rank, world, group),
                             torch.device("cpu"))
    with torch.no_grad():                       # what the loader does for this rank's slots
        for i, layer in enumerate(layers):
            idx = torch.tensor(bal.local_experts(i))
            params = [layer.gate_up_proj, layer.down_proj] if fmt is None else \
                [layer.gate_up_proj, layer.gate_up_proj_scale, layer.down_proj,
                 layer.down_proj_scale]
            for p, full in zip(params, stored[i]):
                p.copy_(full[idx])
    before = bal.placement.clone()
    for step in range(7):              # plan at step 4, one layer a step: done at step 6
        x, ids, w = _routing(step, rank)
        h = x
        for i, layer in enumerate(layers):
            got = ep_moe(layer, h, ids, w, rank, world, slots, group)
            want = reference_moe(ckpts[i], h, ids, w)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=f"step {step} layer {i}")
            h = got
        bal.step()
        if step == 4:
            assert bal.stats.rebalancing and bal.stats.layers_moved == 2
    assert bal.stats.rebalances == 1 and not bal.stats.rebalancing
    assert not torch.equal(bal.placement, before), "the skewed load moved nothing"
    gathered = [torch.empty_like(bal.placement) for _ in range(world)]
    dist.all_gather(gathered, bal.placement, group=group)
    assert all(torch.equal(g, bal.placement) for g in gathered), "ranks disagree on the map"
    for i, layer in enumerate(layers):
        idx = torch.tensor(bal.local_experts(i))
        params = [layer.gate_up_proj, layer.down_proj] if fmt is None else \
            [layer.gate_up_proj, layer.gate_up_proj_scale, layer.down_proj, layer.down_proj_scale]
        for p, full in zip(params, stored[i]):
            assert torch.equal(p.detach(), full[idx]), f"layer {i}"
        l2p = policy.logical_to_physical(bal.placement[i:i + 1], E)[0]
        assert torch.equal(layer.logical_to_physical[:, :l2p.shape[1]], l2p)
    sent = torch.tensor([bal.stats.bytes_sent])
    dist.all_reduce(sent, group=group)
    assert int(sent) > 0


def _rank_main(rank: int, world: int) -> None:
    """One spawn of 4 ranks runs every case (process start-up dominates the cost): EP4 with
    and without redundant experts, then EP2 twice side by side on ranks {0, 1} and {2, 3}."""
    everyone = dist.group.WORLD
    _case(rank, 4, 4, everyone)
    _case(rank, 4, 0, everyone)
    _case(rank, 4, 4, everyone, expert_format("fp8", (8, 8)))   # 2 x 2 scale blocks
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _case(rank % 2, 2, 4, pairs[rank // 2])


def test_rebalance_moves_weights_between_ranks() -> None:
    gloo_ranks(_rank_main, 4)
