"""DSpark proposer (DeepSeek-V4.1): one parallel pass drafts a block of tokens.

After a step's verification the newest token of request i sits at position a = c_i (emitted,
not run by the target yet). The drafter (models/deepseek_v41/dspark.py) takes the embeddings of
that anchor token and dspark_block_size - 1 noise tokens at positions a .. a + block - 1, and the
target's tap features at positions [a - W, a) from the "model.dspark.features" window cache the
target's forward fills for every token it computes (so prefix caching, preemption and rejected
drafts need nothing special: the cache is stored by position like any window). Slot j's
logits predict position a + 1 + j: lm_head(h_j) + the Markov head of the previous token (the
anchor, then the slot j - 1 draft), so the argmax runs slot by slot (cheap: no model pass).
Drafts are greedy (deterministic: the rejection sampler treats q as one-hot).

Early stop (`dspark_confidence_threshold`): drafting stops at the first slot whose confidence
head predicts acceptance below the threshold (sigmoid of its logit); off by default.
"""
from __future__ import annotations


import numpy as np
import torch

from wideserve.models.interface import CausalLM
from wideserve.types.forward_batch import ForwardBatch
from wideserve.utils.device import to_device
from wideserve.spec_decode.proposer import ProposeInput, Proposer


class DSparkProposer(Proposer):
    writes_kv = False      # the feature cache is written by the target's own forward

    def __init__(self, model: CausalLM, num_tokens: int, threshold: float | None = None) -> None:
        unavailable = model.mtp_unavailable
        if unavailable is not None:
            raise ValueError(f"speculative_config.method 'dspark' is unavailable: "
                             f"{unavailable}")
        if not model.supports_dspark or model.num_mtp_blocks == 0:
            raise ValueError(f"speculative_config.method 'dspark' needs a DeepSeek-V4.1 model "
                             f"with DSpark stages (mtp.*); {type(model).__name__} has none")
        block = model.config.dspark_block_size
        if num_tokens > block:
            raise ValueError(f"speculative_config.num_speculative_tokens={num_tokens} exceeds "
                             f"the DSpark block size {block}")
        self.model = model
        self.k = num_tokens          # drafts per step: the draft step's fixed width
        self.threshold = threshold
        self.accept_prob: list[float] = []     # confidence of each drafted slot (metrics)

    def kv_cache_specs(self, kv_cache_dtype: str) -> dict:
        return self.model.dspark_kv_cache_specs(kv_cache_dtype)

    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in inp.step_reqs]
        want = np.nonzero((inp.num_drafts > 0) & (inp.next_tokens() >= 0))[0]
        if want.size == 0:
            return out
        dev = inp.batch.input_ids.device
        anchor = np.array([inp.step_reqs[i].start for i in want]) + inp.num_valid[want]
        drafts = self.draft(inp.batch, to_device(want.astype(np.int64), dev),
                            to_device(anchor.astype(np.int64), dev),
                            to_device(inp.next_tokens()[want].astype(np.int64), dev))
        table = drafts.tolist()                         # the draft step's one host read
        for row, i in enumerate(want.tolist()):
            toks = table[row][:int(inp.num_drafts[i])]
            out[i] = toks[:toks.index(-1)] if -1 in toks else toks
        return out

    def draft(self, batch: ForwardBatch, req_idx: torch.Tensor, anchor: torch.Tensor,
              tokens: torch.Tensor) -> torch.Tensor:
        """The draft step on the device at fixed k (num_speculative_tokens): the requests at
        step indices req_idx [B] with their newest tokens [B] at positions anchor [B] ->
        drafts [B, k] (-1 after an early stop). Capturable (docs/cuda_graphs.md): shapes fixed
        by B and k, no host read and no tensor built on the host; a request wanting fewer
        drafts keeps the first ones (slot j depends only on the slots before it)."""
        from wideserve.models.deepseek_v41.model import DSPARK_FEATURES
        model, c = self.model, self.model.config
        W, Q, B, dev = c.sliding_window, c.dspark_block_size, anchor.shape[0], anchor.device
        ctx_pos = anchor[:, None] - W + torch.arange(W, device=dev)                # [B, W]
        valid = ctx_pos >= 0
        view = batch.kv_groups[batch.cache_group[DSPARK_FEATURES]]
        slots = view.entry_slots(req_idx[:, None].expand(-1, W), ctx_pos.clamp(min=0))
        cache = batch.kv_caches[DSPARK_FEATURES]
        feats = cache.view(-1, cache.shape[-1]).index_select(0, slots.flatten())
        feats = torch.where(valid[..., None], feats.view(B, W, -1), 0).to(model.dtype)
        noise = torch.full((B, Q - 1), c.dspark_noise_token_id, dtype=torch.int64, device=dev)
        ids = torch.cat([tokens[:, None], noise], dim=1)
        states = model.dspark_draft(ids, feats, anchor, ctx_pos, valid)
        prev, drafts = tokens, []
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        for j in range(self.k):
            logits, conf = model.dspark_head(states[:, j], prev)
            prev = logits.argmax(dim=-1)
            if self.threshold is not None:
                alive = alive & (torch.sigmoid(conf) >= self.threshold)
            drafts.append(torch.where(alive, prev, -1))
        return torch.stack(drafts, dim=1)
