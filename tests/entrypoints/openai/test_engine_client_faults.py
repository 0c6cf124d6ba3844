"""Faults at the engine-core process boundary (fake engine, real process and sockets): a bad
output handler, bad frames and requests, duplicate ids."""
from __future__ import annotations

import asyncio
import os
import signal

import msgspec

from test_engine_proc_plumbing import FAKE, _client, _collect, _env, _req
from wideserve.config import EngineConfig
from wideserve.serving.engine_client import EngineCoreClient


def test_a_failing_output_handler_does_not_stop_routing(caplog):
    async def main():
        client = _client()
        await client.start(timeout_s=30)
        try:
            got, wait = await _collect(client, {"a", "b"})
            collect = client.on_outputs
            calls = []

            def flaky(outputs):
                calls.append(len(outputs))
                if len(calls) == 1:
                    raise RuntimeError("handler bug")
                collect(outputs)

            client.on_outputs = flaky
            await client.add_requests([_req("a", [5], 3), _req("b", [7], 3)])
            await wait                      # later messages still reached the handler
            assert client.is_alive and client.health()[0]
            assert [t for o in got["b"] for t in o.new_token_ids][-1] == 10
        finally:
            await client.shutdown()

    asyncio.run(main())
    assert "routing goes on" in caplog.text and "handler bug" in caplog.text


def test_a_dead_output_loop_is_reported_at_once():
    async def main():
        client = _client()
        await client.start(timeout_s=30)
        reasons: list[str] = []
        client.on_dead = reasons.append
        try:
            client._out_sock.close(linger=0)        # the loop's next recv fails
            for _ in range(50):
                if reasons:
                    break
                await asyncio.sleep(0.02)
            assert reasons and "engine-output failed" in reasons[0]
            assert not client.health()[0] and client.proc.poll() is None
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_bad_requests_are_answered_or_logged(capfd):
    async def main():
        client = _client()
        await client.start(timeout_s=30)
        try:
            got, wait = await _collect(client, {"bad-params", "after"})
            good = msgspec.to_builtins(_req("x", [1], 2))
            frame = ["AddRequests", [
                {**good, "request_id": "bad-params", "sampling_params": {"max_tokens": -3}},
                {**good, "request_id": 12345},          # no string id: cannot be answered
            ]]
            await client._in_sock.send(msgspec.msgpack.encode(frame))
            await client._in_sock.send(msgspec.msgpack.encode(["AddRequests", "garbage"]))
            await client.add_requests([_req("after", [1], 2)])
            await wait
            assert got["bad-params"][-1].finish_reason == "error"
            assert "invalid request" in got["bad-params"][-1].error
            assert got["after"][-1].finish_reason == "length"      # still serving
        finally:
            await client.shutdown()

    asyncio.run(main())
    err = capfd.readouterr().err
    assert "without a string request_id" in err and "12345" in err
    assert "dropped an undecodable message" in err and "garbage" in err


def test_a_duplicate_id_does_not_end_the_live_request(capfd):
    async def main():
        client = _client()
        await client.start(timeout_s=30)
        try:
            got, wait = await _collect(client, {"live"})
            await client.add_requests([_req("live", [5], 10**6)])
            await client.add_requests([_req("live", [500], 2)])
            await asyncio.sleep(0.2)
            await client.abort_requests(["live"])
            await wait
            outs = got["live"]
            tokens = [t for o in outs for t in o.new_token_ids]
            assert tokens == [t % 1000 for t in range(6, 6 + len(tokens))] and len(tokens) > 2
            assert outs[-1].finish_reason == "abort" and all(o.error is None for o in outs)
        finally:
            await client.shutdown()

    asyncio.run(main())
    assert "refused request" in capfd.readouterr().err


def test_stale_heartbeat_fails_health_recovers_then_stall_kills():
    async def main():
        client = EngineCoreClient(EngineConfig(), engine_path=FAKE, heartbeat_s=0.2,
                                  stale_after_s=0.6, stall_timeout_s=1.5, env=_env())
        await client.start(timeout_s=30)
        reasons: list[str] = []
        client.on_dead = reasons.append
        pid = client.proc.pid
        try:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(1.0)
            ok, why = client.health()
            assert not ok and "silent" in why and not reasons      # unhealthy, not dead
            os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(0.5)
            assert client.health() == (True, "ok")                 # a long step, say
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(2.2)
            assert reasons and "no heartbeat" in reasons[0] and "killed" in reasons[0]
            assert client.proc.poll() == -signal.SIGKILL
        finally:
            if client.proc.poll() is None:
                os.kill(pid, signal.SIGKILL)
            await client.shutdown()

    asyncio.run(main())
