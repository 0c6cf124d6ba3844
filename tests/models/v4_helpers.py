"""Shared helpers for the DeepSeek-V4 tests: an HF oracle with every parameter random, a
stable (lowest-index-wins) top-k patch for HF's indexer, and a wideserve copy of the model."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from wideserve.models.deepseek_v4.config import DeepseekV4Config


def hf_model(kw: dict, seed: int = 0):
    """transformers' DeepseekV4ForCausalLM (fp32, eval) with the parameters HF zero-initialises
    made random too (docs/deepseek_v4.md, "Test configurations"): sinks, position_bias, mHC base/scale,
    e_score_correction_bias, and tid2eid with k distinct experts per token id."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HFModel(HFConfig(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                E = model.config.n_routed_experts
                t.copy_(torch.rand(t.shape[0], E, generator=gen).argsort(-1)[:, :t.shape[1]])
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif leaf in ("scale", "hc_scale"):
                t.copy_(0.5 + torch.rand(t.shape, generator=gen))
            elif leaf == "e_score_correction_bias":
                t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
            elif name.endswith("norm.weight"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
            elif leaf == "bias":
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


@contextlib.contextmanager
def stable_topk() -> Iterator[None]:
    """HF's indexer calls Tensor.topk, whose tie order is unspecified; make equal scores pick
    the lowest index, as wideserve's indexer does. (Routers use torch.topk: untouched.)"""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        s = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((s.values.narrow(dim, 0, k), s.indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full no-cache forward of one sequence -> [L, vocab] fp32."""
    with stable_topk():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def ws_model(kw: dict, hf=None, mtp_layers: int = 0) -> DeepseekV4ForCausalLM:
    """wideserve's model for the same kwargs, with HF's weights when `hf` is given."""
    cfg = DeepseekV4Config.from_dict({**kw, "num_nextn_predict_layers": mtp_layers})
    model = DeepseekV4ForCausalLM(cfg).eval()
    if hf is not None:
        state = hf.state_dict()
        loaded = model.load_weights(state.items())
        assert loaded == set(state)
        missing = {n for n in model.state_dict() if not n.startswith("mtp.")} - loaded
        assert not missing, f"not filled from the HF state dict: {sorted(missing)[:5]}"
    return model


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Fill every parameter/persistent buffer of `module` (e.g. `model.mtp`, which HF lacks)
    with values at a sane scale: norms ~1, projections N(0, 1/fan_in), small random biases."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in module.state_dict(keep_vars=True).items():
        leaf = name.rsplit(".", 1)[-1]
        noise = torch.randn(t.shape, generator=gen)
        if name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * noise)
        elif leaf in ("scale", "hc_scale"):
            t.copy_(0.5 + torch.rand(t.shape, generator=gen))
        elif t.dim() >= 2:
            t.copy_(noise / t.shape[-1] ** 0.5)
        else:
            t.copy_(0.5 * noise)


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
