"""The API process's CPU per engine message, routing alone (BENCHMARKS.md, "The serving
host path per token").

A real engine-core process and ZMQ sockets, but the test suite's fake engine
(tests/entrypoints/openai/fake_engine_core.py: one token per request per step, no model),
so steps are instant and the front end's side of the IPC is all that is timed: receive,
decode, hand to `on_outputs`. One request of `--tokens` tokens per round. Instant steps
queue messages faster than they are routed (several per wake-up); `--step-ms X` makes each
step busy-wait X ms (instant_engine.py PacedFakeEngineCore), one message per wake-up as a
real decode at concurrency 1 sends them.

  PYTHONPATH=. python benchmarks/vs_vllm/output_routing.py [--tokens 20000] [--rounds 3] \
      [--step-ms 1.5]

Compare two trees by running it with PYTHONPATH pointing at each.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "tests" / "entrypoints" / "openai"))
from test_engine_proc_plumbing import _client, _env, _req  # noqa: E402

from wideserve.config import EngineConfig  # noqa: E402
from wideserve.serving.engine_client import EngineCoreClient  # noqa: E402

HERE = Path(__file__).resolve().parent


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _paced_client(step_ms: float) -> EngineCoreClient:
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), env["PYTHONPATH"]])
    env["WS_BENCH_FORWARD_MS"] = str(step_ms)
    return EngineCoreClient(EngineConfig(), engine_path="instant_engine:PacedFakeEngineCore",
                            heartbeat_s=0.2, env=env)


async def _rounds(tokens: int, rounds: int, step_ms: float) -> None:
    client = _paced_client(step_ms) if step_ms > 0 else _client()
    await client.start(timeout_s=60)
    messages = 0
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_outputs(outputs: list) -> None:
        nonlocal messages
        messages += 1
        if any(o.finish_reason for o in outputs) and not done.done():
            done.set_result(None)

    client.on_outputs = on_outputs
    try:
        for rnd in range(-1, rounds):                   # round -1 warms up
            done = asyncio.get_running_loop().create_future()
            messages = 0
            t, c = time.perf_counter(), _cpu()
            await client.add_requests([_req(f"r{rnd}", [1], tokens if rnd >= 0 else 200)])
            await done
            if rnd >= 0:
                print(f"round {rnd}: {messages} messages, wall "
                      f"{(time.perf_counter() - t) / messages * 1e6:.1f} us, API CPU "
                      f"{(_cpu() - c) / messages * 1e6:.1f} us per message", flush=True)
    finally:
        await client.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.0)
    a = ap.parse_args()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the server's loop
        runner.run(_rounds(a.tokens, a.rounds, a.step_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
