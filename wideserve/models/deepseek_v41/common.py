"""What the DeepSeek-V4.1 decoder (deepseek_v41.py) and its DSpark draft stages
(deepseek_v41_dspark.py) share: the single-pass mHC site, collapsing and expanding the residual
streams, and the routed-expert checkpoint layout. A module of its own so that the draft stages
need not import the model that builds them (docs/architecture.md, "Layer order")."""
from __future__ import annotations

import re

import torch

from wideserve.layers.mhc import HyperConnection, sinkhorn


class SinglePassHC(HyperConnection):
    """One mHC site of V4.1 (names fn, base, scale): the same coefficients as V4's, with the
    projection taken before the RMS scaling and one fused affine (the reference's rounding)."""

    def coefficients(self, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, n, d] -> pre [T, n], post [T, n], comb [T, n, n] (fp32)."""
        if self.fused(x):
            return self.fused_coefficients(x)
        n = self.n
        flat = x.flatten(1).float()
        mixes = self.mix(flat, self.fn, widen_weight=True) * torch.rsqrt(
            flat.square().mean(-1, keepdim=True) + self.norm_eps)
        s = self.scale.float()
        scales = torch.cat([s[0].expand(n), s[1].expand(n), s[2].expand(n * n)])
        logits = torch.addcmul(self.base.float(), mixes, scales)
        pre = torch.sigmoid(logits[:, :n]) + self.hc_eps
        post = 2 * torch.sigmoid(logits[:, n:2 * n])
        comb = logits[:, 2 * n:].unflatten(-1, (n, n)).softmax(dim=-1) + self.hc_eps
        return pre, post, sinkhorn(comb, self.iters, self.hc_eps)

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return super().collapse(x, pre) if self.fused(x) else collapse(x, pre)

    def expand(self, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
        """V4.1's expand (elementwise sums: the reference's rounding), fused in a small step."""
        return super().expand(x, post, comb, y) if self.fused(x) else expand(y, x, post, comb)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, n, d] weighted by pre [T, n] -> [T, d] (fp32 sum, cast back)."""
    return (pre.unsqueeze(-1) * streams.float()).sum(1).to(streams.dtype)


def expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
           comb: torch.Tensor) -> torch.Tensor:
    """Stream k <- post_k * y + sum_j comb[j, k] * stream_j."""
    update = post.unsqueeze(-1) * y.unsqueeze(-2).float()
    mixed = (comb.unsqueeze(-1) * streams.float().unsqueeze(-2)).sum(1)
    return (update + mixed).to(y.dtype)


_EXPERT = re.compile(r"^(?P<p>.+\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")


def expert_layout(name: str, tensor: torch.Tensor
                   ) -> tuple[str, torch.Tensor, tuple | None]:
    """Routed-expert tensors -> RoutedExperts' layout. The reference stacks
    gate_and_up_projs [E, d, 2I] and down_projs [E, I, d]; the official checkpoint has one
    w1/w3 [I, d] and w2 [d, I] per expert, returned with (expert, slice, parts per expert)."""
    if name.endswith(".experts.gate_and_up_projs"):
        return name[:-len("gate_and_up_projs")] + "gate_up_proj", tensor.transpose(1, 2), None
    if name.endswith(".experts.down_projs"):
        return name[:-len("down_projs")] + "down_proj", tensor.transpose(1, 2), None
    m = _EXPERT.match(name)
    if m is None:
        return name, tensor, None
    e, w = int(m["e"]), m["w"]
    if w == "w2":
        return f"{m['p']}.down_proj", tensor, (e, slice(None), 1)
    half = tensor.shape[0]
    rows = slice(0, half) if w == "w1" else slice(half, 2 * half)
    return f"{m['p']}.gate_up_proj", tensor, (e, rows, 2)


def place_weight(targets: dict[str, torch.Tensor], name: str, raw: str, tensor: torch.Tensor,
                 parts: dict[str, int], owner: str) -> str | None:
    """Copy one checkpoint tensor (`name` in the reference's naming, `raw` as the checkpoint
    has it, for messages) into its target, an expert's slice of a stack for per-expert tensors. Returns
    the target's name once it is complete (a stack: when every slice is in; `parts` counts
    them across calls), else None."""
    name, tensor, part = expert_layout(name, tensor)
    target = targets.get(name)
    dst = None if target is None else (
        target.data if part is None else target.data[part[0]][part[1]])
    if dst is None or tuple(dst.shape) != tuple(tensor.shape):
        if dst is None:
            raise ValueError(f"{owner}: unknown weight {raw!r}")
        raise ValueError(f"{owner}: weight {raw!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(tensor)
    if part is None:
        return name
    parts[name] = parts.get(name, 0) + 1
    return name if parts[name] == target.shape[0] * part[2] else None
