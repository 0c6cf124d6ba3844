"""The NIXL (UCX) transport: one-sided transfers of KV pages between engines.

Setup (once per engine): a NIXL agent named by engine id registers the KV slabs (DRAM on CPU,
VRAM on GPU) and prepares the local descriptor list, one descriptor per (slab, block).
A producer also serves its agent metadata and region table on the authenticated side channel.

Pull (`kv_transfer_op: "pull"`, the default), per peer (once): fetch the metadata over the side channel,
check the layout fingerprint, `add_remote_agent`, prepare the remote descriptor list. Per
load: "open" the lease (the producer checks it names exactly a held lease, once: leases.py),
one prepared READ over all the request's page descriptors (NIXL merges adjacent ones;
"packed", the default) or one READ per descriptor ("per_block", for the benchmark), then the
release/confirm call to the producer.

Push (`"push"`, opt-in; protocol in push.py, producer half in nixl_push.py): per peer
the consumer sends its own metadata ("hello"); per load it asks the producer to WRITE into
the blocks it allocated and waits for the producer's notification.

Side-channel calls run on a small thread pool. A load past `kv_load_timeout_s` is stopped
(pull: its READ handles released once no longer in flight; push: the producer confirms on
`cancel` that its write has stopped) before it is reported failed; where that cannot be
known within CANCEL_TIMEOUT_S it fails anyway, with its blocks quarantined until the fence
(fence.py), so its blocks are never written after they are freed.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.disagg.layout import KVLayout, descriptor_indices, descriptor_table, region_bases
from wideserve.disagg.leases import LeaseRef, LeaseTable
from wideserve.disagg.nixl_agent import import_nixl, new_agent
from wideserve.disagg.fence import Fence, FenceTable
from wideserve.disagg.nixl_push import (UNKNOWN_CONSUMER, CancelReply, PushProducer, try_release,
                                        xfer_states)
from wideserve.disagg.params import LoadSpec, RemoteKV
from wideserve.disagg.push import PushRequest, new_token, pages_to_wire, parse_notification
from wideserve.disagg.side_channel import SideChannelClient, SideChannelServer
from wideserve.disagg.worker import KVConnectorWorker

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
# A push not confirmed stopped this long after its cancel fails with its blocks quarantined
# (fence.py): the request goes on, the blocks wait for the fence.
CANCEL_TIMEOUT_S = 2.0
CANCEL_RETRY_S = 0.01


# NIXL's memory type for a torch device type: the KV slabs are registered where they live.
MEMORY_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}


def memory_type(layout: KVLayout, requested: str) -> str:
    """NIXL's memory type of the KV slabs, chosen from their device (never from an import of
    a device runtime); `requested` (kv_buffer_device) must agree with it, if not "auto"."""
    kinds = {r.tensor.device.type for r in layout.regions}
    if len(kinds) != 1 or next(iter(kinds)) not in MEMORY_TYPES:
        raise ValueError(f"--kv-transfer-config: NixlConnector registers the KV cache in "
                         f"place and needs it on one of {sorted(MEMORY_TYPES)}; it is on "
                         f"{sorted(kinds)}")
    kind = next(iter(kinds))
    if requested not in ("auto", kind):
        raise ValueError(f"--kv-transfer-config: kv_buffer_device is {requested!r} but the KV "
                         f"cache is on {kind!r} (it is registered where it lives: use 'auto')")
    return MEMORY_TYPES[kind]


class AgentInfo(msgspec.Struct, array_like=True):
    agent_name: str
    agent_metadata: bytes
    fingerprint: str
    regions: list[tuple[int, int, int, int]]    # (addr, page_bytes, num_blocks, device)
    incarnation: bytes = b""    # random per process: a restarted producer has a new one


@dataclass(slots=True)
class _Peer:
    agent_name: str
    dlist: Any
    base: np.ndarray
    num_blocks: list[int]
    incarnation: bytes = b""


@dataclass(slots=True)
class _InFlight:
    load: LoadSpec
    deadline: float
    handles: list[Any] = field(default_factory=list)
    open: Future | None = None      # pull: the producer's answer to "open" (before the READ)
    confirm: Future | None = None
    nbytes: int = 0
    num_transfers: int = 0
    cancelled: bool = False
    # push: the token naming the write, the push call, the cancel call and why it failed
    token: bytes = b""
    accept: Future | None = None
    cancel: Future | None = None
    why: str = ""
    stopped: bool = False           # the producer's notification came: its write has stopped
    cancel_until: float = 0.0       # give up waiting for the cancel's "stopped" then: fence
    fence: str | None = None        # failed with its blocks quarantined (fence.py)
    incarnation: bytes = b""        # push: the producer process it was asked of


class NixlWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, leases: LeaseTable) -> None:
        super().__init__(config, layout, leases)
        self.mem = memory_type(layout, config.kv_buffer_device)
        secret = self.secret = config.secret()
        self.mode = str(config.kv_connector_extra_config.get("transfer_mode", "packed"))
        self.push = config.kv_transfer_op == "push"
        # Strict: the producer's side-channel thread posts push WRITEs (nixl_push.py).
        self.agent = new_agent(config.engine_id, config.kv_progress_poll_us,
                               sync_mode=import_nixl().nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._reg = self.agent.register_memory([r.tensor for r in layout.regions])
        self.local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descriptor_table(layout.region_info()), self.mem)
        self.client = SideChannelClient(secret, peer=config.engine_id)
        # Blocking side-channel calls: a silent producer holds a thread per call for up to
        # its timeout, so there are a few (handshakes, push, cancel and fence calls).
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="kv-side-client")
        self.peers: dict[str, _Peer] = {}
        self.handshakes: dict[str, Future] = {}
        self.waiting: dict[str, _InFlight] = {}      # for their peer's handshake
        self.inflight: dict[str, _InFlight] = {}     # transferring or confirming
        self.zombies: list[tuple[Any, str]] = []     # handles that refused to abort
        self.by_token: dict[bytes, _InFlight] = {}   # push loads awaiting their notification
        self.fences = FenceTable(self.agent, self.pool, self._cancel_call, CANCEL_TIMEOUT_S)
        incarnation = os.urandom(8)
        info = AgentInfo(config.engine_id, self.agent.get_agent_metadata(), layout.fingerprint,
                         layout.region_info(), incarnation)
        self._info = msgspec.msgpack.encode(info)
        self.pusher = PushProducer(self.agent, layout, leases, self.local_dlist, self.mem,
                                   self._info, AgentInfo, incarnation) \
            if config.is_producer else None
        self.server = SideChannelServer(secret, config.kv_ip, config.kv_port, {
            "metadata": lambda _body: self._info,
            "open": self._serve_open,
            "release": self._serve_release,
            **self.pusher.handlers(),
        }) if self.pusher is not None else None

    # ------------------------------------------------------------------ producer
    def advertise(self) -> tuple[str, int]:
        if self.server is None:
            return self.config.kv_ip, 0
        return self.server.host, self.server.port

    def _serve_open(self, body: bytes) -> bytes:
        return msgspec.msgpack.encode(self.leases.open(msgspec.msgpack.decode(body,
                                                                              type=LeaseRef)))

    def _serve_release(self, body: bytes) -> bytes:
        refs = msgspec.msgpack.decode(body, type=list[LeaseRef])
        return msgspec.msgpack.encode([self.leases.release(ref) for ref in refs])

    # ------------------------------------------------------------------ consumer
    def start_load(self, load: LoadSpec) -> None:
        f = _InFlight(load, time.monotonic() + self.config.kv_load_timeout_s)
        engine = load.remote.remote_engine_id
        if n := self.fences.blocks_loads_from(engine):
            self._load_failed(load.request_id, f"the prefill instance has not confirmed that "
                              f"{n} earlier transfer(s) from it stopped (their blocks are "
                              f"quarantined); no loads from it until it does")
            return
        if engine in self.peers:
            self._post(f)
            return
        if engine not in self.handshakes:
            r = load.remote
            kind, body = ("hello", self._info) if self.push else ("metadata", b"")
            self.handshakes[engine] = self.pool.submit(
                self.client.call, r.remote_host, r.remote_port, kind, body,
                min(HANDSHAKE_TIMEOUT_S, self.config.kv_load_timeout_s))
        self.waiting[load.request_id] = f

    def _add_peer(self, engine: str, body: bytes) -> _Peer:
        info = msgspec.msgpack.decode(body, type=AgentInfo)
        if info.fingerprint != self.layout.fingerprint:
            raise ValueError("the prefill instance's KV layout differs from this one's")
        nb = [n for _, _, n, _ in info.regions]
        for fence in self.fences.saw_incarnation(engine, info.incarnation):
            self._fenced(fence)
        if self.push:       # the producer writes: it needs us, not we it
            peer = self.peers[engine] = _Peer(info.agent_name, None, region_bases(nb), nb,
                                              info.incarnation)
            return peer
        name = self.agent.add_remote_agent(info.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        dlist = self.agent.prep_xfer_dlist(name, descriptor_table(info.regions), self.mem)
        peer = _Peer(name, dlist, region_bases(nb), nb, info.incarnation)
        self.peers[engine] = peer
        return peer

    def _post(self, f: _InFlight) -> None:
        load, peer = f.load, self.peers[f.load.remote.remote_engine_id]
        groups = self.layout.groups
        for g, rem in zip(groups, load.remote_pages):
            if len(rem) and int(rem.max()) >= min(peer.num_blocks[r] for r in g.regions):
                self._load_failed(load.request_id, "remote block ids out of range")
                return
        f.nbytes = sum(len(p) * self.layout.regions[r].page_bytes
                       for g, p in zip(groups, load.local_pages) for r in g.regions.tolist())
        if self.push:
            self._ask_push(f)
            return
        r = load.remote
        f.open = self.pool.submit(self._call, r, "open", msgspec.msgpack.encode(r.lease_ref()),
                                  max(0.0, min(HANDSHAKE_TIMEOUT_S, f.deadline - time.monotonic())))
        self.inflight[load.request_id] = f

    def _opened(self, f: _InFlight, now: float) -> str | None:
        """A pull waiting for its lease to open: "" once the READ is posted, None while
        waiting, else why it failed (nothing was read)."""
        assert f.open is not None
        if f.cancelled or now > f.deadline:
            return "cancelled" if f.cancelled else \
                f"timed out after {self.config.kv_load_timeout_s:g}s"
        if not f.open.done():
            return None
        try:
            why = f.open.result()
        except Exception as e:  # noqa: BLE001 - no answer: nothing was read
            return f"the prefill instance did not open the lease: {e}"
        f.open = None
        if why:
            return f"the prefill instance refused the pull: {why}"
        return self._read(f)

    def _read(self, f: _InFlight) -> str:
        """Post the pull's READ(s): "" when posted, else why not (handles stopped)."""
        load, peer = f.load, self.peers.get(f.load.remote.remote_engine_id)
        if peer is None:
            return "the prefill instance was dropped (a transfer from it failed)"
        groups = self.layout.groups
        local = descriptor_indices(groups, self.layout.base, load.local_pages)
        remote = descriptor_indices(groups, peer.base, load.remote_pages)
        try:
            if self.mode == "packed":
                chunks = [(local, remote)]
            else:
                chunks = [(local[i:i + 1], remote[i:i + 1]) for i in range(len(local))]
            for loc, rem in chunks:
                h = self.agent.make_prepped_xfer("READ", self.local_dlist, loc, peer.dlist, rem)
                f.handles.append(h)
                f.num_transfers += 1
                if self.agent.transfer(h) == "ERR":
                    raise RuntimeError("NIXL refused to post the transfer")
        except Exception as e:  # noqa: BLE001 - nixl raises its own error types
            self._stop(f)
            self._drop_peer(load.remote.remote_engine_id)
            return f"transfer failed to start: {e}"
        return ""

    # ------------------------------------------------------------- consumer, push
    def _ask_push(self, f: _InFlight) -> None:
        load, r = f.load, f.load.remote
        f.token = new_token()
        f.incarnation = self.peers[r.remote_engine_id].incarnation
        f.num_transfers = 1 if self.mode == "packed" else \
            sum(len(p) * len(g.regions) for g, p in zip(self.layout.groups, load.local_pages))
        left = max(0.0, f.deadline - time.monotonic())
        req = PushRequest(self.config.engine_id, f.token, r.lease_ref(),
                          pages_to_wire(load.local_pages), pages_to_wire(load.remote_pages),
                          time.time() + left, self.mode == "per_block")
        f.accept = self.pool.submit(self._call, r, "push", msgspec.msgpack.encode(req),
                                    min(HANDSHAKE_TIMEOUT_S, left + 0.1))
        self.by_token[f.token] = f
        self.inflight[load.request_id] = f

    def _call(self, r: RemoteKV, kind: str, body: bytes, timeout_s: float) -> Any:
        return msgspec.msgpack.decode(
            self.client.call(r.remote_host, r.remote_port, kind, body, timeout_s))

    def _poll_notifications(self) -> None:
        fenced = self.fences.tokens
        if not (self.by_token or fenced):
            return
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                parsed = parse_notification(msg)
                if parsed and parsed[1] in fenced:   # a given-up write has stopped
                    self._fenced(*self.fences.stopped([fenced.pop(parsed[1])],
                                                      "its notification came"))
                    continue
                f = self.by_token.get(parsed[1]) if parsed else None
                if f is None or f.stopped:
                    continue
                assert parsed is not None
                f.stopped = True            # either way: nothing left to cancel
                f.why = "ok" if parsed[0] else f"the prefill instance stopped the write: " \
                    f"{parsed[2]}"

    def _push_state(self, f: _InFlight, now: float) -> str | None:
        """None while in progress, "ok", or why it failed (the write has stopped)."""
        if f.stopped:
            return f.why
        if f.cancel is not None:
            return self._cancel_state(f)
        if f.accept is not None and f.accept.done():
            try:
                refused = f.accept.result()
            except Exception as e:  # noqa: BLE001 - unknown whether it was posted: cancel
                self._start_cancel(f, f"the push request failed: {e}")
                return None
            f.accept = None
            if refused:
                if refused == UNKNOWN_CONSUMER:       # it dropped us: hello again next time
                    self._drop_peer(f.load.remote.remote_engine_id)
                return f"the prefill instance refused the push: {refused}"
        if f.cancelled or now > f.deadline:
            self._start_cancel(f, "cancelled" if f.cancelled else
                               f"timed out after {self.config.kv_load_timeout_s:g}s")
        return None

    def _cancel_call(self, r: RemoteKV, tokens: list[bytes]) -> tuple[list[bool], bytes]:
        reply = msgspec.msgpack.decode(self.client.call(
            r.remote_host, r.remote_port, "cancel", msgspec.msgpack.encode(tokens),
            CANCEL_TIMEOUT_S), type=CancelReply)
        return reply.stopped, reply.incarnation

    def _start_cancel(self, f: _InFlight, why: str, delay_s: float = 0.0) -> None:
        f.why = why
        if not f.cancel_until:
            f.cancel_until = time.monotonic() + CANCEL_TIMEOUT_S
        f.cancel = self.pool.submit(self._delayed, delay_s, self._cancel_call, f.load.remote,
                                    [f.token])

    @staticmethod
    def _delayed(delay_s: float, fn: Any, *args: Any) -> Any:
        if delay_s:
            time.sleep(delay_s)
        return fn(*args)

    def _cancel_state(self, f: _InFlight) -> str | None:
        """The cancel's answer: the write stopped (f.why), still writing (ask again, until
        cancel_until), or no answer: fail now, with the blocks quarantined until the fence."""
        assert f.cancel is not None
        if not f.cancel.done():
            return None
        incarnation = f.incarnation
        try:
            stopped, answered_by = f.cancel.result()
            if stopped[0] or answered_by != incarnation:
                return f.why
        except Exception as e:  # noqa: BLE001 - no answer: stalled, partitioned or gone
            f.why = f"{f.why}; the prefill instance did not answer the cancel ({e})"
            return self._quarantine(f, incarnation)
        if time.monotonic() >= f.cancel_until:
            return self._quarantine(f, incarnation)
        self._start_cancel(f, f.why, CANCEL_RETRY_S)        # still writing: ask again
        return None

    def _quarantine(self, f: _InFlight, incarnation: bytes) -> str:
        fence = Fence(f.token.hex(), f.load.remote.remote_engine_id, f.load.remote,
                      incarnation, token=f.token)
        f.fence = self.fences.add(fence, f.why)
        return f.why

    # -------------------------------------------------------------------- common
    def poll(self) -> None:
        now = time.monotonic()
        self._poll_handshakes()
        if self.pusher is not None:
            self.pusher.poll()
        self._poll_notifications()
        for rid, f in list(self.inflight.items()):
            state = self._push_state(f, now) if f.token else self._state(f, now)
            if state is None:
                continue
            del self.inflight[rid]
            self.by_token.pop(f.token, None)
            if state == "ok":
                self._load_succeeded(f.load, f.nbytes, f.num_transfers)
            else:
                self._load_failed(rid, state, f.fence)
        for fence in self.fences.poll():
            self._fenced(fence)
        self.zombies = [(h, rid) for h, rid in self.zombies if not try_release(self.agent, h)]

    def _poll_handshakes(self) -> None:
        now = time.monotonic()
        for engine, fut in list(self.handshakes.items()):
            if not fut.done():
                continue
            del self.handshakes[engine]
            error = None
            try:
                self._add_peer(engine, fut.result())
            except Exception as e:  # noqa: BLE001 - any handshake failure fails the loads
                error = f"handshake with the prefill instance failed: {e}"
            for rid, f in list(self.waiting.items()):
                if f.load.remote.remote_engine_id == engine:
                    del self.waiting[rid]
                    if error is None:
                        self._post(f)
                    else:
                        self._load_failed(rid, error)
        for rid, f in list(self.waiting.items()):
            if f.cancelled or now > f.deadline:
                del self.waiting[rid]
                self._load_failed(rid, "cancelled" if f.cancelled else "handshake timed out")

    def _state(self, f: _InFlight, now: float) -> str | None:
        """None while in progress, "ok", or why it failed (handles already released)."""
        if f.open is not None:
            why = self._opened(f, now)
            if why != "":           # still opening (None), or failed before any READ
                return why
        if f.cancelled or now > f.deadline:
            self._stop(f)
            return "cancelled" if f.cancelled else \
                f"timed out after {self.config.kv_load_timeout_s:g}s"
        if f.confirm is None:
            states = xfer_states(self.agent, f.handles)
            if "ERR" in states:
                self._stop(f)
                self._drop_peer(f.load.remote.remote_engine_id)
                return "transfer error (the prefill instance is gone?)"
            if "PROC" in states:
                return None
            self._stop(f)
            r = f.load.remote
            f.confirm = self.pool.submit(self._confirm, r)
            return None
        if not f.confirm.done():
            return None
        try:
            held = f.confirm.result()
        except Exception as e:  # noqa: BLE001
            return f"the prefill instance did not confirm the pull: {e}"
        return "ok" if held else "the prefill instance no longer held the blocks (lease expired)"

    def _confirm(self, r: RemoteKV) -> bool:
        body = self.client.call(r.remote_host, r.remote_port, "release",
                                msgspec.msgpack.encode([r.lease_ref()]),
                                self.config.kv_load_timeout_s)
        return bool(msgspec.msgpack.decode(body, type=list[bool])[0])

    def _stop(self, f: _InFlight) -> None:
        """Release a pull's READ handles; ones still in flight (a stalled producer over tcp)
        go to a fence instead: their blocks are quarantined until they are done (fence.py)."""
        if "PROC" in xfer_states(self.agent, f.handles):
            f.fence = self.fences.add(Fence(
                f"read-{id(f):x}-{time.monotonic_ns()}", f.load.remote.remote_engine_id,
                f.load.remote, b"", handles=f.handles), "its read was still in flight")
            f.handles = []
            return
        for h in f.handles:
            if not try_release(self.agent, h):
                self.zombies.append((h, f.load.request_id))
        f.handles = []

    def _drop_peer(self, engine: str) -> None:
        peer = self.peers.pop(engine, None)
        if peer is not None and peer.dlist is not None:
            try:
                self.agent.release_dlist_handle(peer.dlist)
                self.agent.remove_remote_agent(peer.agent_name)
            except Exception:  # noqa: BLE001 - a dead peer may refuse; a new handshake redoes it
                logger.warning("could not remove NIXL peer %s", peer.agent_name)

    def release(self, remote: RemoteKV) -> None:
        self.pool.submit(self._release_quietly, remote)

    def _release_quietly(self, r: RemoteKV) -> None:
        try:
            self.client.call(r.remote_host, r.remote_port, "release",
                             msgspec.msgpack.encode([r.lease_ref()]), HANDSHAKE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the lease expiry frees it anyway
            logger.info("release of %s on %s:%s failed: %s", r.remote_request_id,
                        r.remote_host, r.remote_port, e)

    def cancel(self, request_id: str) -> None:
        f = self.inflight.get(request_id) or self.waiting.get(request_id)
        if f is not None:
            f.cancelled = True

    def has_pending(self) -> bool:
        return bool(self.inflight or self.waiting or self.handshakes or self.zombies
                    or (self.pusher is not None and self.pusher.has_pending()))

    def close(self) -> None:
        # Writes first: once the side channel's port refuses, consumers take this process as
        # gone (fence.py).
        if self.pusher is not None:
            self.pusher.close()
        if self.server is not None:
            self.server.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for f in [*self.inflight.values()]:
            self._stop(f)
        self.client.close()
