"""The engine-core process and its async ZMQ client, driven with a fake engine object.

Checks the plumbing only (spawn, Ready, add/abort/utility round trips, heartbeat, shutdown,
death reporting, orphan exit); the real engine is exercised by the server tests.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from wideserve.config import EngineConfig
from wideserve.serving.engine_client import EngineCoreClient, EngineDeadError, EngineStartupError
from wideserve.types.messages import EngineCoreRequest
from wideserve.types.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
FAKE = "fake_engine_core:FakeEngineCore"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env.pop("OMP_NUM_THREADS", None)          # the fake needs no torch; keep the child light
    return env


def _client(engine: str = FAKE) -> EngineCoreClient:
    return EngineCoreClient(EngineConfig(), engine_path=engine, heartbeat_s=0.2, env=_env())


def _req(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(max_tokens=max_tokens))


async def _collect(client: EngineCoreClient, want_finished: set[str], timeout: float = 10.0):
    got: dict[str, list] = {}
    done: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_outputs(outputs):
        for out in outputs:
            got.setdefault(out.request_id, []).append(out)
        finished = {rid for rid, outs in got.items() if outs[-1].finish_reason is not None}
        if want_finished <= finished and not done.done():
            done.set_result(None)

    client.on_outputs = on_outputs
    return got, asyncio.wait_for(done, timeout)


def test_round_trip_abort_utility_and_shutdown():
    async def main():
        client = _client()
        info = await client.start(timeout_s=30)
        assert info["name"] == "fake" and info["vocab_size"] == 1000
        got, wait = await _collect(client, {"a", "b", "too-long"})
        await client.add_requests([_req("a", [5, 6], 4), _req("b", [1], 10**9),
                                   _req("too-long", list(range(200)), 4)])
        await asyncio.sleep(0.05)
        await client.abort_requests(["b"])
        await wait
        assert [t for o in got["a"] for t in o.new_token_ids] == [7, 8, 9, 10]
        assert got["a"][-1].finish_reason == "length"
        assert got["b"][-1].finish_reason == "abort"
        assert got["too-long"][-1].finish_reason == "error"
        assert "maximum context length" in got["too-long"][-1].error
        assert await client.call_utility("check_integrity") is None
        stats = await client.call_utility("get_stats")
        assert stats["num_running"] == 0 and stats["num_steps"] > 0
        with pytest.raises(RuntimeError, match="unknown method"):
            await client.call_utility("add_request")
        # Heartbeats keep stats fresh while idle (every 0.2 s here; waited for, not slept
        # for: a loaded machine may hold the idle engine off a core for longer).
        before = client.last_heard
        deadline = time.monotonic() + 30
        while client.last_heard == before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert client.last_heard > before and client.health() == (True, "ok")
        proc = client.proc
        await client.shutdown()
        assert proc.wait(5) == 0
        with pytest.raises(EngineDeadError):
            await client.add_requests([_req("c", [1], 1)])

    asyncio.run(main())


def test_killed_engine_is_reported_and_fails_calls():
    async def main():
        client = _client()
        await client.start(timeout_s=30)
        reasons: list[str] = []
        client.on_dead = reasons.append
        os.kill(client.proc.pid, signal.SIGKILL)
        for _ in range(50):
            if reasons:
                break
            await asyncio.sleep(0.1)
        assert reasons and "signal 9" in reasons[0]
        assert client.health()[0] is False
        with pytest.raises(EngineDeadError):
            await client.add_requests([_req("x", [1], 1)])
        with pytest.raises(EngineDeadError):
            await client.call_utility("get_stats")
        await client.shutdown()

    asyncio.run(main())


def test_engine_crash_in_step_reports_reason():
    async def main():
        client = _client()
        await client.start(timeout_s=30)
        reasons: list[str] = []
        client.on_dead = reasons.append
        await client.add_requests([_req("boom", [999], 4)])
        for _ in range(300):             # the engine process must run to crash: up to 30 s
            if reasons:
                break
            await asyncio.sleep(0.1)
        assert reasons and "fake engine crashed on purpose" in reasons[0]
        assert client.proc.wait(5) == 1
        await client.shutdown()

    asyncio.run(main())


def test_engine_that_fails_to_load_raises_startup_error():
    async def main():
        client = _client("fake_engine_core:DoesNotExist")
        with pytest.raises(EngineStartupError, match="DoesNotExist"):
            await client.start(timeout_s=30)
        await client.shutdown()

    asyncio.run(main())


def test_engine_exits_when_its_parent_dies():
    # A parent process that starts the engine, prints its pid, then is SIGKILLed (no chance
    # to clean up): the orphaned engine must notice and exit on its own.
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(HERE)!r})
        from test_engine_proc_plumbing import _client
        async def main():
            client = _client()
            await client.start(timeout_s=30)
            print(client.proc.pid, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              env=_env(), text=True)
    try:
        engine_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(engine_pid):
        time.sleep(0.1)
    assert not _alive(engine_pid), "orphaned engine process kept running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (already exited, not yet reaped by init) counts as gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_burst_queued_while_the_loop_was_busy_is_routed_whole_and_in_order(monkeypatch):
    """The output loop drains queued messages per wake-up, DRAIN_BATCH at a time: a burst of
    several batches, sent while the event loop is blocked, still arrives complete and in
    order, and other tasks run between the batches. The watchdog's tick (which also wakes
    the loop) is slowed to 60 s, so a loop that waited for the FD with messages still
    queued would stall here: the engine sends nothing more once the burst is out."""
    from wideserve.serving import engine_client
    from wideserve.serving.engine_client import DRAIN_BATCH
    monkeypatch.setattr(engine_client, "WATCH_S", 60.0)

    async def main():
        client = _client()
        await client.start(timeout_s=30)
        try:
            got, wait = await _collect(client, {"burst"})
            calls = []
            handler = client.on_outputs

            def counting(outputs):
                calls.append(len(outputs))
                handler(outputs)

            client.on_outputs = counting
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            n = 5 * DRAIN_BATCH
            await client.add_requests([_req("burst", [7], n)])
            time.sleep(1.0)                 # the loop is blocked: the engine's messages queue
            tick_task = asyncio.create_task(ticker())
            await wait
            tick_task.cancel()
            tokens = [t for o in got["burst"] for t in o.new_token_ids]
            assert tokens == [t % 1000 for t in range(8, 8 + n)]
            assert got["burst"][-1].finish_reason == "length"
            assert len(calls) >= n // 2     # one message per engine step, routed one by one
            assert ticks >= 2               # the ticker ran while the burst was drained
        finally:
            await client.shutdown()

    asyncio.run(main())
