"""The P/D side channel under junk (docs/disaggregation.md, "The side channel"): cheap
rejections (version, kind, stale timestamp, replayed nonce, oversized header) never reach the
HMAC, and junk never gets its body hashed (the MAC is over the header); refusals are charged
to the peer id a MAC proves, else to the source address, so a flood of junk gets at most a
burst of answers and never makes a legitimate peer's request be dropped, even from the same
address; its own requests are never limited."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from wideserve.disagg.side_channel import (VERSION, Header, PeerLimit, SideChannelClient,
                                           SideChannelServer, make_header)

SECRET = b"s" * 32
BURST = 8
DIGEST = b"\0" * 32


def _junk(kind: str, nonce: bytes, ts: float | None = None, version: int = VERSION) -> Header:
    """A well-formed header with a wrong MAC: all a sender without the secret can build."""
    return Header(version, kind, time.time() if ts is None else ts, nonce, "", DIGEST,
                  b"\0" * 32)


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
        good = make_header(SECRET, "ping", "peer-a", b"x")
        cases = {
            "unsupported side-channel version": _junk("ping", b"b" * 16, version=VERSION + 1),
            "unknown request kind": _junk("nope", b"c" * 16),
            "unauthenticated": _junk("ping", b"d" * 16, ts=now - 3600),   # stale
        }
        for why, head in cases.items():
            _send(sock, head, b"x" * (1 << 20))
            assert why in _reply(sock)[3]
        sock.send_multipart([b"\x93" + b"\x00" * 2000, b""])        # oversized header
        assert _reply(sock)[3] == "malformed message"
        assert server.num_header_checked == server.num_mac_checked == 0   # none cost a MAC
        _send(sock, good, b"x")
        assert _reply(sock)[:3] == [True, good.nonce, b"x"]
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
            _send(sock, _junk("ping", i.to_bytes(16, "big")), b"j" * (1 << 18))
            junk.append(sock)
        # Every junk message is in the server's hands (answered or dropped) or queued ahead.
        deadline = time.monotonic() + 30
        while server.num_refused + server.num_dropped < BURST and time.monotonic() < deadline:
            time.sleep(0.01)
        client = SideChannelClient(SECRET, "peer-a")
        try:
            assert client.call("127.0.0.1", server.port, "ping", b"hi", 10) == b"hi"
            # No junk body was hashed before the legitimate one (its own hash).
            assert server.seen[0] == 1, (server.seen, server.num_dropped)
            # The junk peer's bucket is empty: the rest of its flood was dropped unread ...
            deadline = time.monotonic() + 30
            while server.num_refused + server.num_dropped < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.num_refused == BURST and server.num_dropped == n - BURST
            # ... while the legitimate peer is never limited (authentic requests spend nothing).
            for i in range(3 * BURST):
                assert client.call("127.0.0.1", server.port, "ping", b"%d" % i, 10) == b"%d" % i
            assert server.num_mac_checked == 1 + 3 * BURST          # none for junk
        finally:
            client.close()
    finally:
        for sock in junk:
            sock.close(linger=0)
        ctx.term()


def _until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the server did not get that far"
        time.sleep(0.01)


def test_junk_from_a_legitimate_peers_own_address_never_drops_its_requests(server):
    """On loopback, a shared host or behind one NAT, a flooder and a decode instance share an
    address. The flood empties that address's bucket (a burst of refusals, the rest dropped
    unanswered, no junk body hashed), and the decode instance, whose MAC proves its peer id,
    is served every time, before, during and after (it was dropped with the junk when the
    bucket was the address's)."""
    ctx = zmq.Context()
    junk = []
    n = 100
    client = SideChannelClient(SECRET, "decode-1")
    try:
        assert client.call("127.0.0.1", server.port, "ping", b"before", 5) == b"before"
        for i in range(n):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            _send(sock, _junk("ping", i.to_bytes(16, "big")), b"j" * (1 << 18))
            junk.append(sock)
        _until(lambda: server.num_refused + server.num_dropped == n)
        assert server.num_refused == BURST and server.num_dropped == n - BURST
        for i in range(2 * BURST):
            assert client.call("127.0.0.1", server.port, "ping", b"%d" % i, 5) == b"%d" % i
        for sock in junk[:10]:                           # the address is still throttled
            _send(sock, _junk("ping", b"late" + bytes(12)), b"j")
        _until(lambda: server.num_dropped == n - BURST + 10)
        assert client.call("127.0.0.1", server.port, "ping", b"after", 5) == b"after"
        assert server.num_refused == BURST
        assert server.num_mac_checked == 2 * BURST + 2                 # no junk body hashed
    finally:
        client.close()
        for sock in junk:
            sock.close(linger=0)
        ctx.term()


def test_refusals_of_a_proven_peer_spend_that_peers_bucket_only(server):
    """A holder of the secret whose requests are refused after its MAC (a body that does not
    match its signed digest) spends its own peer id's bucket: then it is dropped, while
    another peer and the junk budget of their shared address are untouched."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    client = SideChannelClient(SECRET, "good-peer")
    try:
        for _ in range(BURST):
            _send(sock, make_header(SECRET, "ping", "bad-peer", b"signed"), b"swapped")
            assert "does not match its signed digest" in _reply(sock)[3]
        _send(sock, make_header(SECRET, "ping", "bad-peer", b"signed"), b"swapped")
        _until(lambda: server.num_dropped == 1)
        assert client.call("127.0.0.1", server.port, "ping", b"ok", 5) == b"ok"
        _send(sock, _junk("ping", b"j" * 16), b"j")     # the address's own bucket is full
        assert _reply(sock)[3] == "unauthenticated"
        assert server.num_refused == BURST + 1 and server.num_dropped == 1
    finally:
        client.close()
        sock.close(linger=0)
        ctx.term()
