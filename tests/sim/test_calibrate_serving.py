"""The serving calibration against a real `wideserve serve` (calibrate_pd.py): a request's
latency outside the engine's steps, measured one request at a time."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints" / "openai"))
from oai_server_utils import free_port, write_tiny_model  # noqa: E402


def test_request_latency_is_the_client_time_less_the_engine_step(tmp_path):
    from wideserve.sim.calibrate_pd import (measure_request, server_args, start_server,
                                            stop_server)
    model = write_tiny_model(tmp_path / "m")
    proc, url = start_server(str(model), free_port(),
                             server_args({"load_format": "dummy", "dtype": "float32"}, [1]),
                             timeout=180)
    try:
        got = measure_request(url, prompt_len=16, reps=3, vocab=300)
    finally:
        stop_server(proc)
    assert len(got["reps"]) == len(got["engine_s"]) == 3
    # each one-token request ran engine steps (its prefill), and the HTTP round trip,
    # hand-over and first chunk out cost something beside them
    assert all(e > 0 for e in got["engine_s"])
    assert got["s"] == pytest.approx(sorted(got["reps"])[1]) and got["s"] > 0
    assert got["prompt_len"] == 16
