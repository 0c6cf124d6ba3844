"""The front end's count of generation requests received and not yet submitted
(serving/arrivals.py), through a real ASGI stack: FastAPI behind the middleware, httpx's ASGI
transport, JSON and streaming responses. The engine's use of the count is tested in
tests/engine/test_engine_loop_arrivals.py."""
from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from wideserve.serving.arrivals import ArrivalCounter, ArrivalMiddleware


def _app(counter: ArrivalCounter, gate: asyncio.Event, seen: list[int]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        await gate.wait()
        seen.append(counter.submitting())        # as AsyncEngine.generate does
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def events():
            await gate.wait()
            seen.append(counter.submitting())    # submitted from the streaming task
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/messages")
    async def refused() -> dict:
        raise HTTPException(400, "bad request")

    @app.post("/tokenize")
    async def other() -> dict:
        return {"held": counter.held}

    app.add_middleware(ArrivalMiddleware, counter=counter)
    return app


async def _burst(path: str, n: int) -> tuple[list[int], int, int]:
    counter, gate, seen = ArrivalCounter(), asyncio.Event(), []
    app = _app(counter, gate, seen)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        sends = [asyncio.create_task(client.post(path, json={})) for _ in range(n)]
        async with asyncio.timeout(30):
            while counter.held < n:
                await asyncio.sleep(0.001)
        other = (await client.post("/tokenize")).json()["held"]   # not a generation route
        gate.set()
        done = await asyncio.gather(*sends)
        assert all(r.status_code == 200 for r in done)
    return seen, other, counter.held


def test_each_submission_counts_the_requests_still_held():
    seen, other, left = asyncio.run(_burst("/v1/completions", 3))
    assert other == 3 and sorted(seen) == [0, 1, 2] and left == 0


def test_a_streamed_request_is_released_by_its_submission_in_the_stream():
    # the streaming body runs in its own task: the ticket reaches it through the context,
    # so the first submission already sees itself released (1 held: the other one)
    seen, _, left = asyncio.run(_burst("/v1/chat/completions", 2))
    assert sorted(seen) == [0, 1] and left == 0


def test_a_request_that_fails_before_submission_is_released():
    async def run() -> int:
        counter = ArrivalCounter()
        app = _app(counter, asyncio.Event(), [])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            assert (await client.post("/v1/messages", json={})).status_code == 400
        return counter.held
    assert asyncio.run(run()) == 0


def test_submitting_outside_a_counted_request_changes_nothing():
    counter = ArrivalCounter()
    assert counter.submitting() == 0 and counter.held == 0
