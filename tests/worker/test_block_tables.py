"""Persistent block tables against tables rebuilt from the KV manager's rows every step:
growing rows, entries nulled, requests finishing, preempted and resumed, tables widening."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from wideserve.worker.block_tables import BlockTables


@pytest.mark.parametrize("separate_copy", [False, True])
def test_incremental_tables_match_rebuilt_rows(separate_copy: bool) -> None:
    rng = random.Random(7)
    groups = 3
    tables = BlockTables(groups, torch.device("cpu"), rows=2, separate_copy=separate_copy)
    live: dict[str, list[list[int]]] = {}      # the manager's rows
    next_id = 1
    for step in range(120):
        if rng.random() < 0.3 or not live:
            live[f"r{step}"] = [[] for _ in range(groups)]
        for rid in list(live):
            u = rng.random()
            if u < 0.08:                       # finished or preempted: the row is dropped
                del live[rid]
                tables.drop([rid])
                continue
            for row in live[rid]:
                for _ in range(rng.choice([0, 0, 1, 1, 2, 40])):
                    row.append(next_id)
                    next_id += 1
                if row and rng.random() < 0.2:  # a sliding page leaves the window
                    row[rng.randrange(len(row))] = 0
        if not live:
            continue
        step_reqs = rng.sample(sorted(live), k=rng.randint(1, len(live)))
        # Resumed this step (preempted without a drop): the manager rebuilt its rows.
        reset = {rid for rid in step_reqs if rng.random() < 0.05}
        for rid in reset:
            live[rid] = [[next_id + j] * rng.randrange(3) for j in range(groups)]
            next_id += groups
        rows = {rid: tables.update(rid, live[rid], reset=rid in reset) for rid in step_reqs}
        assert len(set(rows.values())) == len(rows)
        for g in range(groups):
            dev = tables.device_table(g)
            assert separate_copy != (dev.data_ptr() == tables.host(g).ctypes.data)
            for rid, r in rows.items():
                want = np.asarray(live[rid][g], dtype=np.int64)
                got = dev[r, :len(want)].numpy()
                # Nulled entries may stay stale (never read again); every other one matches,
                # and nothing past the row is left over from an earlier request.
                assert np.array_equal(got[want != 0], want[want != 0])
                assert not dev[r, len(want):].any()
