"""The prep pool (request preparation off the event loop): bounded by slots that are freed
only when the work has really ended, and the per-request deadline that answers 503."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from wideserve.serving.openai.limits import RequestLimits
from wideserve.serving.openai.serving import ApiError, PrepPool, ServingContext


def test_a_slot_is_held_until_the_work_ends_even_after_its_request_gave_up():
    async def main() -> None:
        pool = PrepPool(1)
        gate, ran = threading.Event(), []
        first = asyncio.ensure_future(pool.run(gate.wait, 30))
        await asyncio.sleep(0.05)
        first.cancel()                      # the request is gone; its thread is not
        second = asyncio.ensure_future(pool.run(ran.append, "second"))
        await asyncio.sleep(0.2)
        assert not second.done() and ran == []      # still waiting for the one slot
        gate.set()
        await asyncio.wait_for(second, 10)
        assert ran == ["second"]
        pool.close()

    asyncio.run(main())


def test_preparation_past_the_deadline_is_a_503_naming_the_flag():
    ctx = SimpleNamespace(request_limits=RequestLimits(prep_timeout_s=0.1))

    async def main() -> None:
        with pytest.raises(ApiError) as err:
            await ServingContext.within_deadline(ctx, asyncio.sleep(5))
        assert err.value.status == 503 and err.value.code == "preparation_timeout"
        assert "--request-prep-timeout" in err.value.message
        assert await ServingContext.within_deadline(ctx, asyncio.sleep(0, "ok")) == "ok"

    asyncio.run(main())
