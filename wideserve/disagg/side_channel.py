"""An authenticated request/reply side channel over ZMQ (agent metadata, releases).

Both ends hold a shared secret. A request carries a timestamp, a random nonce and
HMAC-SHA256(secret, kind | ts | nonce | body); the server refuses a bad MAC, a stale
timestamp or a replayed nonce, and answers an unauthenticated peer with nothing but
"unauthenticated". The reply is MAC'd over the request's nonce, so the client knows it came
from a holder of the secret too. Everything is msgspec msgpack: nothing is ever unpickled.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

logger = logging.getLogger(__name__)

MAX_SKEW_S = 60.0
MAX_MESSAGE_BYTES = 64 << 20


class Envelope(msgspec.Struct, array_like=True):
    kind: str
    ts: float
    nonce: bytes
    body: bytes
    mac: bytes


class Reply(msgspec.Struct, array_like=True):
    ok: bool
    nonce: bytes
    body: bytes
    error: str
    mac: bytes


class SideChannelError(RuntimeError):
    pass


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\x00".join(parts), hashlib.sha256).digest()


def _request_mac(secret: bytes, kind: str, ts: float, nonce: bytes, body: bytes) -> bytes:
    return _mac(secret, b"req", kind.encode(), repr(ts).encode(), nonce, body)


def _reply_mac(secret: bytes, ok: bool, nonce: bytes, body: bytes, error: str) -> bytes:
    return _mac(secret, b"rep", b"1" if ok else b"0", nonce, body, error.encode())


Handler = Callable[[bytes], bytes]


class SideChannelServer:
    """A ROUTER socket served by one daemon thread; `handlers[kind](body) -> reply body`."""

    def __init__(self, secret: bytes, host: str, port: int, handlers: dict[str, Handler]) -> None:
        self.secret = secret
        self.handlers = handlers
        self.num_refused = 0
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
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Envelope)
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) < 2:
                continue
            reply = self._answer(dec, frames[-1])
            self._sock.send_multipart([*frames[:-1], enc.encode(reply)])

    def _answer(self, dec: msgspec.msgpack.Decoder, data: bytes) -> Reply:
        try:
            msg = dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._refuse(b"", "malformed message")
        if not self._authentic(msg):
            return self._refuse(msg.nonce, "unauthenticated")
        handler = self.handlers.get(msg.kind)
        if handler is None:
            return self._reply(False, msg.nonce, b"", f"unknown request kind {msg.kind!r}")
        try:
            return self._reply(True, msg.nonce, handler(msg.body), "")
        except Exception as e:  # noqa: BLE001 - reported to the peer, the server goes on
            logger.exception("side-channel handler %s failed", msg.kind)
            return self._reply(False, msg.nonce, b"", f"{type(e).__name__}: {e}")

    def _authentic(self, msg: Envelope) -> bool:
        expected = _request_mac(self.secret, msg.kind, msg.ts, msg.nonce, msg.body)
        if not hmac.compare_digest(expected, msg.mac):
            return False
        now = time.time()
        if abs(now - msg.ts) > MAX_SKEW_S or msg.nonce in self._seen:
            return False
        self._seen[msg.nonce] = now
        if len(self._seen) > 4096:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * MAX_SKEW_S}
        return True

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

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._ctx = zmq.Context(io_threads=1)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)

    def call(self, host: str, port: int, kind: str, body: bytes, timeout_s: float) -> bytes:
        ts, nonce = time.time(), os.urandom(16)
        msg = Envelope(kind, ts, nonce, body, _request_mac(self.secret, kind, ts, nonce, body))
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send(self._enc.encode(msg))
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
