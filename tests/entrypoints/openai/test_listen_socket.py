"""The server's listening socket: accepted connections have TCP_NODELAY (no delayed-ACK wait
between the response headers and the first body write) and asyncio sees a TCP socket."""
from __future__ import annotations

import socket

from wideserve.entrypoints.api_server import _bind


def test_accepted_connections_have_nodelay() -> None:
    server = _bind("127.0.0.1", 0)
    client = socket.create_connection(server.getsockname(), timeout=5)
    try:
        conn, _ = server.accept()
        with conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert conn.proto == socket.IPPROTO_TCP       # asyncio's own nodelay check
    finally:
        client.close()
        server.close()
