"""An authenticated request/reply side channel over ZMQ (agent metadata, releases).

Both ends hold a shared secret. A request is two frames: a small header (protocol version,
kind, timestamp, random nonce, the sender's peer id, the SHA-256 of the body, MAC) and the
body; the MAC is HMAC-SHA256(secret, version | kind | ts | nonce | peer | body digest), so it
is checked over the header alone, and the body is then checked against its digest. The server
answers an unauthenticated peer with nothing but a refusal, and the reply is MAC'd over the
request's nonce, so the client knows it came from a holder of the secret too. Everything is
msgspec msgpack: nothing is ever unpickled.

Junk costs the server as little as possible, and never a legitimate peer's service: every
check before the body's digest reads only the header (at most 1 KiB: size, version, kind,
timestamp, replayed nonce, then the header's MAC), so a request without the secret costs O(1)
whatever its body. A request is charged to the peer id its MAC proves, else to its source
address (`PeerLimit` buckets, spent by refused requests only): a key whose bucket is empty
has its messages dropped unanswered until it refills. Junk from an address therefore gets at
most a burst of refusals, and cannot make a legitimate peer's requests from the same address
(a shared host, NAT, loopback) be dropped. Authentic requests spend nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

logger = logging.getLogger(__name__)

VERSION = 2            # 2: the MAC covers the header, which carries the peer id and body digest
MAX_SKEW_S = 60.0
MAX_MESSAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 1024


class Header(msgspec.Struct, array_like=True):
    version: int
    kind: str
    ts: float
    nonce: bytes
    peer: str               # the sender's id (its engine id): its rate-limit key once proven
    digest: bytes           # SHA-256 of the body
    mac: bytes


class Reply(msgspec.Struct, array_like=True):
    ok: bool
    nonce: bytes
    body: bytes
    error: str
    mac: bytes


class SideChannelError(RuntimeError):
    pass


@dataclass(slots=True)
class PeerLimit:
    """Per key (a proven peer id, else a source address): refused requests allowed in a
    burst, and refilled per second."""

    burst: float = 32.0
    refill_per_s: float = 8.0


class PeerBuckets:
    """Token buckets by key, spent by refused requests only."""

    MAX_PEERS = 4096

    def __init__(self, limit: PeerLimit) -> None:
        self.limit = limit
        self._buckets: dict[str, tuple[float, float]] = {}     # peer -> (tokens, at)

    def _tokens(self, peer: str, now: float) -> float:
        tokens, at = self._buckets.get(peer, (self.limit.burst, now))
        return min(self.limit.burst, tokens + (now - at) * self.limit.refill_per_s)

    def allowed(self, peer: str, now: float) -> bool:
        return self._tokens(peer, now) >= 1.0

    def spend(self, peer: str, now: float) -> None:
        if len(self._buckets) >= self.MAX_PEERS:       # forget the peers that are full again
            self._buckets = {p: (t, a) for p, (t, a) in self._buckets.items()
                             if t + (now - a) * self.limit.refill_per_s < self.limit.burst}
        self._buckets[peer] = (self._tokens(peer, now) - 1.0, now)


def _mac(secret: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for i, part in enumerate(parts):
        if i:
            h.update(b"\x00")
        h.update(part)
    return h.digest()


def _request_mac(secret: bytes, head: Header) -> bytes:
    return _mac(secret, b"req", str(head.version).encode(), head.kind.encode(),
                repr(head.ts).encode(), head.nonce, head.peer.encode(), head.digest)


def make_header(secret: bytes, kind: str, peer: str, body: bytes | memoryview) -> Header:
    """A fresh, signed header for `body`."""
    head = Header(VERSION, kind, time.time(), os.urandom(16), peer,
                  hashlib.sha256(body).digest(), b"")
    head.mac = _request_mac(secret, head)
    return head


def _reply_mac(secret: bytes, ok: bool, nonce: bytes, body: bytes, error: str) -> bytes:
    return _mac(secret, b"rep", b"1" if ok else b"0", nonce, body, error.encode())


Handler = Callable[[bytes], bytes]


class SideChannelServer:
    """A ROUTER socket served by one daemon thread; `handlers[kind](body) -> reply body`."""

    def __init__(self, secret: bytes, host: str, port: int, handlers: dict[str, Handler],
                 limit: PeerLimit | None = None) -> None:
        self.secret = secret
        self.handlers = handlers
        self.num_refused = 0            # answered with a refusal
        self.num_dropped = 0            # dropped unanswered: their key's bucket was empty
        self.num_header_checked = 0     # requests whose header MAC was computed (O(1) each)
        self.num_mac_checked = 0        # requests whose body was hashed (authentic headers)
        self.junk = PeerBuckets(limit or PeerLimit())       # by source address
        self.peers = PeerBuckets(limit or PeerLimit())      # by proven peer id
        self._seen: dict[bytes, float] = {}
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Header)
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            parts = [f.buffer for f in frames[1:]]
            head, why = self._check_header(dec, parts)
            proven = head if why is None else None
            # Charged to the peer its MAC proves, else to its address: junk never empties a
            # legitimate peer's bucket, wherever it comes from.
            buckets, key = ((self.peers, proven.peer) if proven is not None
                            else (self.junk, frames[1].get("Peer-Address") or "?"))
            now = time.monotonic()
            if not buckets.allowed(key, now):
                self.num_dropped += 1
                continue
            reply = (self._answer(proven, parts[1]) if proven is not None
                     else self._refuse(head.nonce if head is not None else b"", why or ""))
            if not reply.mac:               # refused: the sender pays
                buckets.spend(key, now)
            self._sock.send_multipart([frames[0], enc.encode(reply)])

    def _check_header(self, dec: msgspec.msgpack.Decoder, parts: list[memoryview]
                      ) -> tuple[Header | None, str | None]:
        """The header, and why it is refused (None: its MAC proves the secret). Reads only
        the header frame (at most MAX_HEADER_BYTES), cheapest checks first."""
        if len(parts) != 2 or len(parts[0]) > MAX_HEADER_BYTES:
            return None, "malformed message"
        try:
            head = dec.decode(parts[0])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None, "malformed message"
        if head.version != VERSION:
            return head, (f"unsupported side-channel version {head.version} "
                          f"(this instance speaks {VERSION})")
        if head.kind not in self.handlers:
            return head, f"unknown request kind {head.kind[:64]!r}"
        if abs(time.time() - head.ts) > MAX_SKEW_S or head.nonce in self._seen:
            return head, "unauthenticated"      # stale or replayed: no MAC spent on it
        self.num_header_checked += 1
        if not hmac.compare_digest(_request_mac(self.secret, head), head.mac):
            return head, "unauthenticated"
        return head, None

    def _answer(self, head: Header, body: memoryview) -> Reply:
        """An authentic header's request: its body must match the digest it signed."""
        self.num_mac_checked += 1
        if not hmac.compare_digest(hashlib.sha256(body).digest(), head.digest):
            return self._refuse(head.nonce, "unauthenticated (the body does not match its "
                                            "signed digest)")
        now = time.time()
        self._seen[head.nonce] = now
        if len(self._seen) > 4096:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * MAX_SKEW_S}
        try:
            return self._reply(True, head.nonce, self.handlers[head.kind](bytes(body)), "")
        except Exception as e:  # noqa: BLE001 - reported to the peer, the server goes on
            logger.exception("side-channel handler %s failed", head.kind)
            return self._reply(False, head.nonce, b"", f"{type(e).__name__}: {e}")

    def _refuse(self, nonce: bytes, why: str) -> Reply:
        self.num_refused += 1
        logger.warning("side channel refused a request: %s", why)
        return Reply(False, nonce, b"", why, b"")

    def _reply(self, ok: bool, nonce: bytes, body: bytes, error: str) -> Reply:
        return Reply(ok, nonce, body, error, _reply_mac(self.secret, ok, nonce, body, error))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


class SideChannelClient:
    """Blocking calls (run them off the engine's thread); one socket per call, so a peer
    that never answers costs a timeout and nothing else."""

    def __init__(self, secret: bytes, peer: str = "") -> None:
        """peer: this end's id (its engine id), the key the server limits it by."""
        self.secret = secret
        self.peer = peer
        self._ctx = zmq.Context(io_threads=1)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)

    def call(self, host: str, port: int, kind: str, body: bytes, timeout_s: float) -> bytes:
        head = make_header(self.secret, kind, self.peer, body)
        nonce = head.nonce
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send_multipart([self._enc.encode(head), body])
            if not sock.poll(int(timeout_s * 1000)):
                raise SideChannelError(f"no answer from {host}:{port} in {timeout_s:g}s")
            reply = self._dec.decode(sock.recv())
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SideChannelError(f"malformed reply from {host}:{port}: {e}") from None
        finally:
            sock.close(linger=0)
        if reply.nonce != nonce or not hmac.compare_digest(
                reply.mac, _reply_mac(self.secret, reply.ok, nonce, reply.body, reply.error)):
            raise SideChannelError(f"{host}:{port} refused or could not prove the shared "
                                   f"secret: {reply.error or 'bad reply MAC'}")
        if not reply.ok:
            raise SideChannelError(f"{host}:{port}: {reply.error}")
        return reply.body

    def close(self) -> None:
        self._ctx.term()
