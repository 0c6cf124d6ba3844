"""HTTP transport limits uvicorn lacks: a deadline for a request's headers, and a cap on
their size.

Stock uvicorn waits forever for the headers of a new request, so a client that opens
connections and sends nothing, or half a header, holds them indefinitely (400 such connections
were held for good in issue 15's probe). This protocol closes a connection whose request
headers have not all arrived `header_timeout` seconds after the connection opened or after its
first byte of a new request. Idle keep-alive connections are uvicorn's timeout_keep_alive; the
body has its own deadline in the handlers (serving.read_body).

The httptools parser also has no size limit on a request's head (h11's is 16 KiB): a 32 MB
header was buffered and accepted (issue 25). Past `max_header_bytes` of request line and
headers the connection gets 431 and is closed; bytes still arriving meanwhile are discarded
for a moment so the client can read the answer instead of a reset.

It is uvicorn's httptools protocol (the C parser vLLM's server also runs on), not its pure
Python h11 one: parsing a request and framing each streamed chunk in Python cost a measurable
part of the time to first token and of the front end's per-token work (BENCHMARKS.md, "TTFT
breakdown").
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("wideserve.server")
# How long a rejected connection keeps reading (and discarding) before it is closed.
_DRAIN_S = 0.5


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout: float = 30.0
    max_header_bytes: int = 64 << 10

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_headers = True         # waiting for a request head (none parsed yet)
        self._head_bytes = 0            # bytes received while in headers (an upper bound)
        self._rejected = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return                      # draining until the connection closes
        super().data_received(data)
        if self._in_headers and not self._rejected:
            # The head has not ended within these bytes, so all of them belong to it (give
            # or take the tail of the previous request in the same read).
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._reject_head(self._head_bytes)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The first byte of a new request head: its headers get header_timeout from now.
        self._in_headers = True
        if self._header_timer is None and not self.transport.is_closing():
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._head_bytes = 0
        self._disarm()
        # A head that arrived within one read is measured exactly here.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.max_header_bytes:
            self._reject_head(size)
            # Stops the parser (httptools raises HttpParserCallbackError, which uvicorn
            # answers with send_400_response, a no-op once rejected).
            raise ValueError("request head too large")
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._rejected:
            super().send_400_response(msg)

    def _reject_head(self, size: int) -> None:
        self._rejected = True
        self._disarm()
        body = json.dumps({"error": {
            "message": f"The request line and headers exceed this server's limit of "
                       f"{self.max_header_bytes} bytes (got at least {size}; "
                       f"--max-header-bytes)",
            "type": "invalid_request_error", "param": None,
            "code": "request_header_fields_too_large"}}).encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                             b"content-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n"
                             b"connection: close\r\n\r\n" + body)
        self.loop.call_later(_DRAIN_S, self.transport.close)

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


def protocol_with_header_timeout(seconds: float, max_header_bytes: int = 64 << 10
                                 ) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline and head cap."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout": seconds, "max_header_bytes": max_header_bytes})
