"""AsyncEngine and the engine-core client under faults, without a process: a stub client
delivers outputs and deaths exactly when the test says."""
from __future__ import annotations

import asyncio

import pytest

from wideserve.serving.engine_client import EngineDeadError
from wideserve.types.sched_output import EngineCoreOutput
from wideserve.serving.openai.async_engine import AsyncEngine, RequestFailed
from wideserve.types.sampling_params import SamplingParams

# A guard against a hang, not a speed bound: every awaited result is already due when it is
# awaited, and a loaded machine may hold this process off a core for seconds.
NO_HANG_S = 30


class _StubClient:
    def __init__(self) -> None:
        self.dead_reason: str | None = None
        self.added: list = []
        self.aborted: list[str] = []
        self.on_outputs = lambda outputs: None
        self.on_dead = lambda reason: None

    def health(self) -> tuple[bool, str]:
        return self.dead_reason is None, self.dead_reason or "ok"

    async def add_requests(self, requests, pending: int = -1) -> None:
        self.added.extend(requests)

    async def abort_requests(self, ids) -> None:
        self.aborted.extend(ids)


def test_output_and_death_while_consumer_is_busy_raise_instead_of_hanging():
    async def main():
        client = _StubClient()
        engine = AsyncEngine(client, None)
        params = SamplingParams(max_tokens=8)
        gen = engine.generate("r", None, [1, 2], params)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert client.added
        # The consumer is not waiting: an output, then the death, both arrive now.
        client.on_outputs([EngineCoreOutput("r", [5])])
        client.on_dead("engine core died: test")
        item = await asyncio.wait_for(first, NO_HANG_S)
        assert item.deltas[0].token_ids == [5]
        with pytest.raises(EngineDeadError, match="test"):
            await asyncio.wait_for(gen.__anext__(), NO_HANG_S)
        assert engine.num_in_flight == 0

    asyncio.run(main())


def test_an_output_that_cannot_be_processed_fails_only_its_request(monkeypatch):
    async def main():
        client = _StubClient()
        engine = AsyncEngine(client, None)
        params = SamplingParams(max_tokens=2)
        bad, good = engine.generate("bad", None, [1], params), \
            engine.generate("good", None, [1], params)
        first_bad = asyncio.ensure_future(bad.__anext__())
        first_good = asyncio.ensure_future(good.__anext__())
        await asyncio.sleep(0)
        real_apply = engine.processor._apply

        def apply(parent, child, out, now):
            if out.request_id == "bad":
                raise KeyError("corrupt output")
            return real_apply(parent, child, out, now)

        monkeypatch.setattr(engine.processor, "_apply", apply)
        client.on_outputs([EngineCoreOutput("bad", [3]), EngineCoreOutput("good", [4])])
        with pytest.raises(RequestFailed, match="corrupt output") as err:
            await asyncio.wait_for(first_bad, NO_HANG_S)
        assert err.value.internal
        assert (await asyncio.wait_for(first_good, NO_HANG_S)).deltas[0].token_ids == [4]
        await asyncio.sleep(0)
        assert "bad" in client.aborted and "good" not in client.aborted
        client.on_outputs([EngineCoreOutput("good", [5], finish_reason="length")])
        last = await asyncio.wait_for(good.__anext__(), NO_HANG_S)
        assert last.finished and last.output.outputs[0].token_ids == [4, 5]

    asyncio.run(main())


def test_a_failed_engine_step_fails_the_request_as_a_server_error():
    async def main():
        client = _StubClient()
        engine = AsyncEngine(client, None)
        gen = engine.generate("r", None, [1], SamplingParams(max_tokens=4))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        client.on_outputs([EngineCoreOutput("r", [3])])
        assert (await asyncio.wait_for(first, NO_HANG_S)).deltas[0].token_ids == [3]
        client.on_outputs([EngineCoreOutput("r", finish_reason="error", internal_error=True,
                                            error="engine step failed: boom")])
        with pytest.raises(RequestFailed, match="boom") as err:
            await asyncio.wait_for(gen.__anext__(), NO_HANG_S)
        assert err.value.internal

    asyncio.run(main())
