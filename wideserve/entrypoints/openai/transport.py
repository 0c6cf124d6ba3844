"""HTTP transport limits uvicorn lacks: a deadline for a request's headers.

Stock uvicorn waits forever for the headers of a new request, so a client that opens
connections and sends nothing, or half a header, holds them indefinitely (400 such connections
were held for good in issue 15's probe). This protocol closes a connection whose request
headers have not all arrived `header_timeout` seconds after the connection opened or after its
first byte of a new request. Idle keep-alive connections are uvicorn's timeout_keep_alive; the
body has its own deadline in the handlers (serving.read_body).

It is uvicorn's httptools protocol (the C parser vLLM's server also runs on), not its pure
Python h11 one: parsing a request and framing each streamed chunk in Python cost a measurable
part of the time to first token and of the front end's per-token work (BENCHMARKS.md, "TTFT
breakdown").
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("wideserve.server")


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_headers = True         # waiting for a request head (none parsed yet)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The first byte of a new request head: its headers get header_timeout from now.
        self._in_headers = True
        if self._header_timer is None and not self.transport.is_closing():
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            logger.debug("closing a connection: no complete request headers in %.1f s",
                         self.header_timeout)
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout": seconds})
