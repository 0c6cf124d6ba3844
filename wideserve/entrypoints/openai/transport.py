"""HTTP transport limits uvicorn lacks: a deadline for a request's headers.

Stock uvicorn (h11) waits forever for the headers of a new request, so a client that opens
connections and sends nothing, or half a header, holds them indefinitely (400 such connections
were held for good in issue 15's probe). This protocol closes a connection whose request
headers have not all arrived `header_timeout` seconds after the connection opened or after its
first byte of a new request. Idle keep-alive connections are uvicorn's timeout_keep_alive; the
body has its own deadline in the handlers (serving.read_body).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("wideserve.server")


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Their state leaves IDLE once a whole request head has been parsed.
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None and not self.transport.is_closing():
                self._arm()
        else:
            self._disarm()

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
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closing a connection: no complete request headers in %.1f s",
                         self.header_timeout)
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout": seconds})
