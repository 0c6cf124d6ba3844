"""The offline DP engine's stall report: what `LLM(data_parallel_size=N)` says when no rank
produced output in time (each rank's last known load and how long ago it was heard)."""
from __future__ import annotations

from types import SimpleNamespace

from wideserve.serving.dp_offline import stall_report


def test_stall_report_names_each_ranks_load_and_silence():
    clients = [SimpleNamespace(stats={"num_running": 2, "num_waiting": 1}, last_heard=95.0),
               SimpleNamespace(stats={}, last_heard=40.0)]
    assert stall_report(clients, 100.0) == (
        "rank 0: 2 running, 1 waiting, last heard 5.0 s ago; "
        "rank 1: no stats yet, last heard 60.0 s ago")
