"""The P/D side channel under junk (docs/disaggregation.md, "The side channel"): cheap
rejections (version, kind, stale timestamp, replayed nonce, oversized header) never reach the
HMAC; a flood of junk from one address is rate-limited per address, so a legitimate peer's
request waits behind at most a burst of MAC checks, and its own requests are never limited."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from wideserve.disagg.side_channel import (VERSION, Header, PeerLimit, SideChannelClient,
                                           SideChannelServer, _request_mac)

SECRET = b"s" * 32
BURST = 8


@pytest.fixture
def server():
    seen: list[int] = []
    srv = SideChannelServer(SECRET, "127.0.0.1", 0, {}, PeerLimit(burst=BURST, refill_per_s=0.001))
    # The MAC checks the server had done when it served the legitimate request.
    srv.handlers["ping"] = lambda body: (seen.append(srv.num_mac_checked), body)[1]
    srv.seen = seen
    try:
        yield srv
    finally:
        srv.close()


def _send(sock: zmq.Socket, head: Header, body: bytes = b"") -> None:
    sock.send_multipart([msgspec.msgpack.encode(head), body])


def _reply(sock: zmq.Socket) -> list:
    assert sock.poll(5000)
    return msgspec.msgpack.decode(sock.recv())


def test_cheap_rejections_come_before_the_hmac(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        now = time.time()
        good = Header(VERSION, "ping", now, b"a" * 16, b"")
        good.mac = _request_mac(SECRET, good, b"x")
        cases = {
            "unsupported side-channel version": Header(VERSION + 1, "ping", now, b"b" * 16, b""),
            "unknown request kind": Header(VERSION, "nope", now, b"c" * 16, b""),
            "unauthenticated": Header(VERSION, "ping", now - 3600, b"d" * 16, b""),   # stale
        }
        for why, head in cases.items():
            _send(sock, head, b"x" * (1 << 20))
            assert why in _reply(sock)[3]
        sock.send_multipart([b"\x93" + b"\x00" * 2000, b""])        # oversized header
        assert _reply(sock)[3] == "malformed message"
        assert server.num_mac_checked == 0                           # none cost a MAC
        _send(sock, good, b"x")
        assert _reply(sock)[:3] == [True, b"a" * 16, b"x"]
        _send(sock, good, b"x")                                      # replayed
        assert _reply(sock)[3] == "unauthenticated"
        assert server.num_mac_checked == 1 and server.num_refused == 5
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_junk_flood_from_one_peer_does_not_hold_up_another(server):
    """Many connections from 127.0.0.2 each send a well-formed request with a 256 KiB body and
    a bad MAC (the most expensive junk); then a legitimate peer (127.0.0.1) calls. The server
    MACs at most a burst of the junk before serving the legitimate request, drops the rest
    unread, and keeps serving the legitimate peer without limit."""
    ctx = zmq.Context()
    junk = []
    n = 200
    try:
        for i in range(n):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.2:0;127.0.0.1:{server.port}")
            head = Header(VERSION, "ping", time.time(), i.to_bytes(16, "big"), b"\0" * 32)
            _send(sock, head, b"j" * (1 << 18))
            junk.append(sock)
        # Every junk message is in the server's hands (answered or dropped) or queued ahead.
        deadline = time.monotonic() + 30
        while server.num_refused + server.num_dropped < BURST and time.monotonic() < deadline:
            time.sleep(0.01)
        client = SideChannelClient(SECRET)
        try:
            assert client.call("127.0.0.1", server.port, "ping", b"hi", 10) == b"hi"
            # Behind at most the burst of junk MAC checks (+ the legitimate one itself).
            assert server.seen[0] <= BURST + 1, (server.seen, server.num_dropped)
            # The junk peer's bucket is empty: the rest of its flood was dropped unread ...
            deadline = time.monotonic() + 30
            while server.num_refused + server.num_dropped < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.num_refused == BURST and server.num_dropped == n - BURST
            # ... while the legitimate peer is never limited (authentic requests spend nothing).
            for i in range(3 * BURST):
                assert client.call("127.0.0.1", server.port, "ping", b"%d" % i, 10) == b"%d" % i
            assert server.num_mac_checked == BURST + 1 + 3 * BURST
        finally:
            client.close()
    finally:
        for sock in junk:
            sock.close(linger=0)
        ctx.term()
