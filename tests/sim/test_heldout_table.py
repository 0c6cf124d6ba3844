"""The held-out prediction table, regenerated on a tiny config with the real engine.

Not a timing assertion (the suite runs on a loaded 2-core machine): it checks that the table
is produced from the calibration batches alone and that every number is a real measurement.
The accuracy itself is reported by benchmarks/sim_validate.py (docs/simulator.md)."""
from __future__ import annotations

import math

from wideserve.sim import validate
from wideserve.sim.calibrate import DEFAULT_CONFIG

TINY = {**DEFAULT_CONFIG, "hidden_size": 64, "moe_intermediate_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_experts": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def test_heldout_table_on_tiny_config(monkeypatch):
    seen = []
    real = validate.profile_from_rows

    def spy(rows):
        seen.append(sorted(int(r["batch"]) for r in rows))
        return real(rows)
    monkeypatch.setattr(validate, "profile_from_rows", spy)
    rows = validate.single_rank_heldout(TINY, cal=[1, 2], held=4)
    assert seen == [[1, 2]]                        # the held-out batch never calibrates
    (row,) = rows
    assert row["predicted"] > 0 and row["measured"] > 0
    assert math.isclose(row["error"], row["predicted"] / row["measured"] - 1)
