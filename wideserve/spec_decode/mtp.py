"""MTP proposer: the checkpoint's multi-token-prediction block drafts k tokens step by step.

Draft step 1 runs the MTP block over EVERY row of the target's batch (prompt chunks included),
because its sliding-window cache must hold every position: at position p it takes the target's
pre-hc_head streams at p and the embedding of the token at p + 1 (the next row's token; for a
request's last verified row, the token just emitted). The row at position c - 1 (c = the
emitted token's position) gives draft 1 for position c + 1.

Draft step j >= 2 is one row per request at position c + j - 2, fed the previous draft and, in
place of the target's streams (not computed yet for that position), the MTP block's own output
streams at the previous position (EAGLE-style chaining, as vLLM's DeepSeek MTP proposer does);
the chain (proposer.ChainedProposer) builds that batch once and moves it on in place.
Its cache rows at positions >= c are provisional: the next step recomputes them from the
target's streams before any query reads them as history.

Checkpoints with several MTP blocks: block 0 drafts every step (vLLM uses the step index
modulo the block count; the extra blocks would need their own windows filled at every
position, which block 0 alone already gives us). Drafts are the MTP argmax (deterministic
drafts: the rejection sampler treats q as one-hot).
"""
from __future__ import annotations

import numpy as np
import torch

from wideserve.worker.model_runner import ModelRunner
from wideserve.models.interface import CausalLM
from wideserve.spec_decode.proposer import ChainedProposer, ProposeInput


class MTPProposer(ChainedProposer):
    def __init__(self, model: CausalLM) -> None:
        """model: a target with `supports_mtp` (DeepseekV4ForCausalLM: mtp, mtp_forward,
        last_streams)."""
        unavailable = model.mtp_unavailable
        if unavailable is not None:
            raise ValueError(f"speculative_config.method 'mtp' is unavailable: {unavailable}; "
                             f"use method 'ngram' or 'draft_model' instead")
        if not model.supports_mtp or model.num_mtp_blocks == 0:
            raise ValueError(
                f"speculative_config.method 'mtp' needs a model with MTP block(s) "
                f"(num_nextn_predict_layers >= 1); {type(model).__name__} has none")
        self.model = model
        self.runner: ModelRunner | None = None

    def kv_cache_specs(self, kv_cache_dtype: str) -> dict:
        return {n: s for n, s in self.model.mtp_kv_cache_specs(kv_cache_dtype).items()
                if n.startswith("mtp.0.")}

    def bind(self, target_runner: ModelRunner, kv_config, kv_caches) -> None:
        self.runner = target_runner

    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        model, batch = self.model, inp.batch
        assert self.runner is not None and model.last_streams is not None
        qsl = batch.query_start_loc_cpu
        next_tok = inp.next_tokens()
        has_next = next_tok >= 0
        # Each row's successor is the next row's token; the last verified row's is the token
        # emitted this step. Rows after it (rejected drafts) get a provisional value.
        next_ids = torch.roll(batch.input_ids, -1)
        fix = (qsl[:-1] + inp.num_valid - 1)[has_next]
        next_ids[torch.from_numpy(fix).to(next_ids.device)] = \
            torch.from_numpy(next_tok[has_next]).to(next_ids.device)
        hidden = model.mtp_forward(batch, model.last_streams, next_ids)      # [T, d]
        want = np.nonzero(inp.num_drafts > 0)[0]
        out: list[list[int]] = [[] for _ in inp.step_reqs]
        if want.size == 0:
            return out
        rows = torch.from_numpy(qsl[want] + inp.num_valid[want] - 1).to(hidden.device)
        tok = model.compute_logits(hidden.index_select(0, rows)).argmax(dim=-1)   # [A]
        streams = model.last_mtp_streams.index_select(0, rows)                   # [A, n, d]
        emitted = np.array([inp.step_reqs[i].start for i in want]) + inp.num_valid[want]
        return self.chain(inp, want, emitted, tok, streams, self._step)

    def _step(self, batch, tok: torch.Tensor, streams: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chained draft: the MTP block's own output streams stand in for the target's."""
        hidden = self.model.mtp_forward(batch, streams, tok)                  # [A, d]
        return self.model.compute_logits(hidden).argmax(dim=-1), self.model.last_mtp_streams
