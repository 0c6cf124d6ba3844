"""Draft-model proposer: a separate (smaller) wideserve model with the target's tokenizer.

Its KV caches live in the target's KV cache manager under the prefix "draft." (same pools,
same block tables when specs coincide, else groups of their own), so one allocation, one
prefix-cache lookup, one preemption and one rewind cover both models.

Each step the draft model first catches up on what the target just verified: the rows of the
target's step up to the last verified one, plus the token emitted this step (positions
start .. c). Accepted drafts are recomputed rather than kept from the previous proposal: the
cost is a few rows of a small model, and it needs no bookkeeping of which draft rows were
right. Its last row gives draft 1 (position c + 1); drafts 2..k are one row per request each,
fed back on the device through proposer.ChainedProposer (one batch built for the chain, moved
on in place). Drafts are the draft model's argmax (deterministic drafts).
"""
from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from wideserve.config import LoadConfig
from wideserve.worker.model_loader import load_model
from wideserve.worker.model_runner import ModelRunner, StepRequest
from wideserve.spec_decode.proposer import ChainedProposer, ProposeInput

PREFIX = "draft."


class DraftModelProposer(ChainedProposer):
    def __init__(self, path: str, load_format: str, target_load: LoadConfig,
                 target_vocab: int, max_model_len: int) -> None:
        load = LoadConfig(model=path, dtype=target_load.dtype, load_format=load_format,  # type: ignore[arg-type]
                          seed=target_load.seed, device=target_load.device)
        try:
            loaded = load_model(load)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model: cannot load the draft model: "
                             f"{e}") from e
        self.model: Any = cast(Any, loaded.model).eval()
        self.device = torch.device(target_load.device)
        cfg = loaded.config_json
        positions = next((int(cfg[k]) for k in ("max_position_embeddings", "n_positions",
                                                "max_seq_len") if isinstance(cfg.get(k), int)),
                         None)
        if positions is not None and positions < max_model_len:
            raise ValueError(f"speculative_config.model: the draft model handles {positions} "
                             f"positions, fewer than max_model_len={max_model_len}")
        hidden = int(cfg.get("hidden_size") or cfg["n_embd"])
        vocab = int(self.model.compute_logits(torch.zeros(
            1, hidden, dtype=loaded.dtype, device=self.device)).shape[-1])
        if vocab > target_vocab:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary "
                             f"({vocab}) is larger than the target's ({target_vocab}); "
                             f"it must share the target's tokenizer")
        self.runner: ModelRunner | None = None

    def kv_cache_specs(self, kv_cache_dtype: str) -> dict:
        return {PREFIX + n: s for n, s in self.model.kv_cache_specs(kv_cache_dtype).items()}

    def bind(self, target_runner: ModelRunner, kv_config, kv_caches) -> None:
        n = len(PREFIX)
        caches = {k[n:]: t for k, t in kv_caches.items() if k.startswith(PREFIX)}
        groups = {k[n:]: g for k, g in kv_config.cache_group.items() if k.startswith(PREFIX)}
        self.runner = ModelRunner(self.model, target_runner.groups, groups, caches, self.device,
                                  tables=target_runner.tables)

    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        assert self.runner is not None
        catch_up = []
        for i, s in enumerate(inp.step_reqs):
            toks = s.token_ids[:int(inp.num_valid[i])]
            emitted = inp.sampled[i]
            if emitted:
                toks = toks + [emitted[-1]]
            catch_up.append(StepRequest(s.request_id, toks, s.start, s.block_ids,
                                        s.kv_write_start, sample=bool(inp.num_drafts[i] > 0),
                                        replay_start=s.replay_start))
        fwd = self.runner.forward(catch_up)
        out: list[list[int]] = [[] for _ in inp.step_reqs]
        if fwd.logits is None:
            return out
        active = np.asarray(fwd.sample_rows, dtype=np.int64)
        tok = fwd.logits.argmax(dim=-1)                                    # [A]
        # Position of each active request's draft 1 (the emitted token is at end - 1).
        pos = np.array([catch_up[i].start + len(catch_up[i].token_ids) for i in active])
        return self.chain(inp, active, pos, tok, None, self._step)

    def _step(self, batch, tok: torch.Tensor, state: None) -> tuple[torch.Tensor, None]:
        hidden = self.model.forward(batch)                                 # [A, d]: one row each
        return self.model.compute_logits(hidden).argmax(dim=-1), None
