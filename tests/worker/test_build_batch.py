"""ModelRunner.build_batch: the one-token-per-request shortcut gives the general path's
positions and slots, and a batch with as many tokens as requests but not one each (a
zero-token request) takes the general path."""
from __future__ import annotations

import numpy as np
import torch

from wideserve.worker.model_runner import GroupLayout, ModelRunner, StepRequest


def _runner() -> ModelRunner:
    return ModelRunner(None, [GroupLayout(16, 1)], {"kv": 0}, {}, torch.device("cpu"))


def _expected(reqs: list[StepRequest]) -> tuple[list[int], list[int], list[int]]:
    ids, pos, slots = [], [], []
    for r in reqs:
        for j, t in enumerate(r.token_ids):
            p = r.start + j
            ids.append(t)
            pos.append(p)
            slots.append(r.block_ids[0][p // 16] * 16 + p % 16)
    return ids, pos, slots


def test_decode_and_mixed_batches_match_the_definition():
    cases = [
        [StepRequest("a", [5], 17, [[3, 9]]), StepRequest("b", [6], 0, [[4]]),
         StepRequest("c", [7], 40, [[1, 2, 8]])],                        # decode: one each
        [StepRequest("a", [5, 6, 7], 30, [[3, 9, 11]]), StepRequest("b", [8], 3, [[4]])],
        [StepRequest("a", [], 5, [[3]]), StepRequest("b", [1, 2], 15, [[4, 6]])],   # 0 + 2
    ]
    for reqs in cases:
        batch = _runner().build_batch(reqs)
        ids, pos, slots = _expected(reqs)
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
        assert batch.kv_groups[0].slot_mapping.tolist() == slots
        assert batch.seq_lens_cpu.tolist() == [r.start + len(r.token_ids) for r in reqs]
        assert np.array_equal(batch.query_start_loc_cpu,
                              np.cumsum([0] + [len(r.token_ids) for r in reqs]))
