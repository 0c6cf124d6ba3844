"""The EP MoE layer calibration (wideserve/sim/calibrate_ep.py) on a tiny config: two real
ranks over gloo with the engine's own dispatcher. No timing is asserted (the suite runs on a
loaded machine): the table's shape and the nesting of its parts are."""
from __future__ import annotations

from wideserve.sim import calibrate_ep
from wideserve.sim.calibrate import DEFAULT_CONFIG

TINY = {**DEFAULT_CONFIG, "hidden_size": 64, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_experts": 8}


def test_ep_layer_table_from_two_real_ranks():
    dense = {"tokens": [1.0, 4.0], "s": [2e-4, 3e-4]}
    t = calibrate_ep.measure_ep_layer(2, TINY, dense, max_tokens=4, tokens=(1, 4), steps=4)
    assert t["tokens"] == [1.0, 4.0]
    for i in range(2):
        assert t["a2a_s"][i] > 0 and t["expert_s"][i] > 0 and t["step_s"][i] > 0
        # the exchanges and the grouped MLP run inside the layer's call
        assert t["layer_s"][i] >= t["a2a_s"][i] + t["expert_s"][i]
        assert t["work_cpu_s"][i] > 0


def test_ep_layer_needs_experts_that_split_over_the_ranks():
    import pytest
    with pytest.raises(ValueError, match="do not split"):
        calibrate_ep.measure_ep_layer(3, TINY, {"tokens": [1.0], "s": [1e-4]}, max_tokens=1)
