"""Who may ask a prefill instance for a KV handle: the router (or a peer) holding the KV secret.

A request with `kv_transfer_params: {"do_remote_decode": true}` makes a prefill instance hold
the prompt's KV under a lease and answer with a handle signed for that prompt. Answered to
anyone, that lets a client who reaches the prefill instance obtain handles, i.e. hold KV
blocks for `kv_lease_s` each and present the handle at a decode instance itself. So such a
request must carry the header `X-Wideserve-KV-Auth: v1:<ts>:<nonce>:<mac>`, minted by the
router with the shared KV secret (`$WIDESERVE_KV_SECRET`):

    mac = HMAC-SHA256(secret, TAG | method | path | ts | nonce | SHA-256(body))

over the exact body bytes sent. The prefill instance checks, cheapest first: the header's
shape, its timestamp (within MAX_SKEW_S of its clock), that the nonce was not seen within
the window (a captured request cannot be replayed), then the MAC. Any failure is a 403 that
says which, and no request starts. Requests without `do_remote_decode` need no header.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from typing import TYPE_CHECKING, Any

from wideserve.disagg.params import wants_remote_decode

if TYPE_CHECKING:
    from wideserve.config.kv_transfer import KVTransferConfig

HEADER = "x-wideserve-kv-auth"
TAG = b"wideserve-kv-peer-v1"       # domain separation from handle and side-channel MACs
MAX_SKEW_S = 60.0
MAX_NONCES = 1 << 16                # remembered within the window (only after a valid MAC)
# Bodies from this size on are hashed on a thread (hashlib drops the GIL), not the event loop.
THREAD_HASH_BYTES = 1 << 20


def _mac(secret: bytes, method: str, path: str, ts: str, nonce: str, digest: bytes) -> str:
    msg = b"\x00".join((TAG, method.upper().encode(), path.encode(), ts.encode(),
                        nonce.encode(), digest))
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign_request(secret: bytes, method: str, path: str, body: bytes,
                 now: float | None = None) -> str:
    """The header value for one request (`body` exactly as sent, `path` as the server sees
    it)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(16).hex()
    digest = hashlib.sha256(body).digest()
    return f"v1:{ts}:{nonce}:{_mac(secret, method, path, ts, nonce, digest)}"


class PeerAuth:
    """A prefill instance's check of the router's header (one per API server)."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._seen: dict[str, float] = {}       # nonce -> when it was accepted
        self.num_refused = 0

    async def refusal(self, params: dict[str, Any] | None, header: str | None, method: str,
                      path: str, body: bytes) -> str | None:
        """Why this request may not have its KV handle (None: it asks for none, or a holder of
        the secret signed exactly this request, recently, once)."""
        if not wants_remote_decode(params):
            return None
        if len(body) >= THREAD_HASH_BYTES:
            digest = (await asyncio.to_thread(hashlib.sha256, body)).digest()
        else:
            digest = hashlib.sha256(body).digest()
        return self.problem(header, method, path, digest)

    def problem(self, header: str | None, method: str, path: str, digest: bytes
                ) -> str | None:
        """As `refusal`, for a request whose body has the SHA-256 `digest`."""
        why = self._check(header, method, path, digest)
        if why is not None:
            self.num_refused += 1
            return ("kv_transfer_params.do_remote_decode: only a P/D router (or peer) holding "
                    f"this instance's KV secret may ask for a KV handle: {why}")
        return None

    def _check(self, header: str | None, method: str, path: str, digest: bytes) -> str | None:
        if not header:
            return f"the request has no {HEADER} header"
        parts = header.split(":")
        if len(parts) != 4 or parts[0] != "v1" or len(header) > 256:
            return f"malformed {HEADER} header"
        _, ts_text, nonce, mac = parts
        try:
            ts = float(ts_text)
        except ValueError:
            return f"malformed {HEADER} header"
        now = time.time()
        if not abs(now - ts) <= MAX_SKEW_S:
            return f"the {HEADER} header is stale (or the clocks differ by > {MAX_SKEW_S:g} s)"
        if nonce in self._seen:
            return f"the {HEADER} header was already used (a replay)"
        expected = _mac(self.secret, method, path, ts_text, nonce, digest)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return f"the {HEADER} header does not verify (another secret, or another body)"
        self._remember(nonce, now)
        return None

    def _remember(self, nonce: str, now: float) -> None:
        if len(self._seen) >= MAX_NONCES:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * MAX_SKEW_S}
            # A window this busy (> MAX_NONCES signed requests): the oldest nonce is
            # forgotten (replayable until its timestamp goes stale) rather than the router
            # refused.
            while len(self._seen) >= MAX_NONCES:
                self._seen.pop(next(iter(self._seen)))
        self._seen[nonce] = now


def peer_auth_for(config: KVTransferConfig) -> PeerAuth | None:
    """A producer's check of who may ask it for KV handles (the router, holding the
    secret), else None."""
    return PeerAuth(config.secret()) if config.is_producer else None
