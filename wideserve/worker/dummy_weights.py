"""`load_format="dummy"`: random weights from the config alone, deterministic by seed.

Every parameter and persistent buffer gets a value that keeps activations at a sane scale, so
outputs are informative (distinct tokens give distinct logits, routing spreads over experts):
norm weights near 1, projections N(0, 1/fan_in) (unit-variance outputs), embeddings N(0, 1),
and the small V4 tensors that HF zero-initialises (attention sinks, compressor position
biases, mHC base, router correction bias) random too. Hash-routing tables `tid2eid` [V, k]
get k distinct experts per token id. Non-persistent buffers (rotary tables, expert maps and
load counters) keep the values the model built them with.

Each tensor is drawn on the CPU from a generator seeded by (seed, tensor name), so the result
is bitwise reproducible regardless of device or iteration order.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()))
                                                     % (2**63))


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _float_init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A float32 tensor for parameter `name` (rules by name, then by rank)."""
    leaf = _leaf(name)
    normal = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * normal
    if leaf in ("scale", "hc_scale"):                       # mHC mixing scales: positive
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf in ("base", "hc_base"):                         # mHC biases
        return 0.5 * normal
    if leaf == "sinks":
        return 0.5 * normal
    if leaf in ("position_bias", "e_score_correction_bias") or leaf == "bias":
        return 0.1 * normal
    if "embed" in name:
        return normal
    if len(shape) >= 2:
        return normal / math.sqrt(shape[-1])                # last dim = fan_in ([out, in] layouts)
    return 0.1 * normal


def dummy_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """The float32 value `init_dummy_weights` gives a floating tensor `name` of `shape` (used to
    draw a full expert tensor of which an expert-parallel rank keeps its rows)."""
    return _float_init(name, torch.Size(shape), _generator(seed, name))


def distinct_expert_table(vocab: int, k: int, num_experts: int, gen: torch.Generator,
                          chunk: int = 8192) -> torch.Tensor:
    """[vocab, k] int64, each row k distinct experts (a random permutation prefix)."""
    if k > num_experts:
        raise ValueError(f"tid2eid needs k={k} distinct experts but there are only {num_experts}")
    rows = [torch.rand(min(chunk, vocab - s), num_experts, generator=gen).argsort(dim=-1)[:, :k]
            for s in range(0, vocab, chunk)]
    return torch.cat(rows).to(torch.int64)


def _num_experts_for(table_name: str, state: dict[str, torch.Tensor]) -> int:
    gate = table_name.rsplit(".", 1)[0] + ".weight"          # the router weight [E, d] beside it
    if gate not in state:
        raise ValueError(f"cannot size dummy {table_name}: no router weight {gate} next to it")
    return int(state[gate].shape[0])


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> set[str]:
    """Fill every parameter and persistent buffer of `model` in place; returns the names filled."""
    state = model.state_dict(keep_vars=True)
    done: set[int] = set()
    filled: set[str] = set()
    for name, tensor in state.items():
        if id(tensor) in done:                               # tied weights: fill once
            filled.add(name)
            continue
        gen = _generator(seed, name)
        if _leaf(name) == "tid2eid":
            vocab, k = tensor.shape
            value = distinct_expert_table(vocab, k, _num_experts_for(name, state), gen)
        elif tensor.is_floating_point():
            value = _float_init(name, tensor.shape, gen)
        else:
            continue                                         # other integer buffers stay as built
        tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
        done.add(id(tensor))
        filled.add(name)
    return filled
