"""The real engine core with the forward and the sampler skipped (host_path.py
--instant-forward): scheduler, KV cache manager, step timer, engine loop and IPC all run, and
each scheduled request gets "previous token + 1", so what a streamed token then costs is the
serving host path alone. $WS_BENCH_FORWARD_MS (default 0) makes each step busy-wait that long
instead, a forward that holds a core like the real one (a sleep would give the core away). Imported by the engine process (`--engine
instant_engine:InstantForwardEngineCore`), with this folder on PYTHONPATH."""
from __future__ import annotations

import os
import time
from typing import Any

from wideserve.engine.engine_core import EngineCore


class InstantForwardEngineCore(EngineCore):
    forward_s = float(os.environ.get("WS_BENCH_FORWARD_MS", "0")) / 1e3

    def _execute(self, sched_out: Any) -> tuple[dict[str, list[int]], None]:
        end = time.perf_counter() + self.forward_s
        while time.perf_counter() < end:
            pass
        # Every request here finishes its prompt in one step (128-token prompts within the
        # 2048-token budget), so each scheduled request samples.
        return {s.request_id: [(s.request.all_token_ids[-1] + 1) % 1000]
                for s in sched_out.scheduled}, None


def _fake_engine_class() -> type:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "entrypoints"
                           / "openai"))
    from fake_engine_core import FakeEngineCore
    return FakeEngineCore


class PacedFakeEngineCore(_fake_engine_class()):  # type: ignore[misc]
    """The test suite's fake engine (no model), each step busy-waiting $WS_BENCH_FORWARD_MS:
    output_routing.py --step-ms, one message per step as a real decode sends them."""
    step_s = float(os.environ.get("WS_BENCH_FORWARD_MS", "0")) / 1e3

    def step(self) -> list[Any]:
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            pass
        return super().step()
