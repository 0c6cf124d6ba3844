"""In-process transport for tests: engines in one process copy pages between their tensors.

A `LoopbackHub` is the "network": engines built with the same hub reach each other by
engine id. Pulls are synchronous torch copies (chunked, so a long prompt never needs one
giant index tensor), released through the producer's LeaseTable exactly as the NIXL backend
does over its side channel, so lease and failure handling is the same code in both.

Push (push.py) is asynchronous here as over NIXL: the consumer's request claims the lease,
the producer copies into the consumer's tensors at its own next step and then notifies, so
a producer that stops stepping leaves the consumer to time out and cancel, as a dead one.
A cancelled push is known to have stopped only once the producer has stepped past it (it
then skips the copy); a consumer that gives up before that quarantines the blocks until
then, as it does over NIXL with a producer that does not answer (fencing).
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch

from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.disagg.layout import KVLayout
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.params import LoadSpec, RemoteKV
from wideserve.disagg.push import check_source_pages
from wideserve.disagg.worker import KVConnectorWorker

COPY_CHUNK_PAGES = 1024


class LoopbackHub:
    def __init__(self) -> None:
        self.workers: dict[str, LoopbackWorker] = {}
        self.secret = os.urandom(32)        # the "network's" shared KV secret


def copy_pages(dst: torch.Tensor, src: torch.Tensor, dst_ids: torch.Tensor,
               src_ids: torch.Tensor, chunk: int = COPY_CHUNK_PAGES) -> None:
    """dst[dst_ids] = src[src_ids] on [num_blocks, page_bytes] views, `chunk` pages at a time."""
    for i in range(0, len(dst_ids), chunk):
        dst.index_copy_(0, dst_ids[i:i + chunk], src.index_select(0, src_ids[i:i + chunk]))


@dataclass(slots=True)
class _Push:
    consumer: LoopbackWorker
    load: LoadSpec
    deadline: float
    cancelled: bool = False
    stopped: bool = False           # the producer has stepped past it (copied or skipped)


class LoopbackWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, leases: LeaseTable,
                 hub: LoopbackHub) -> None:
        super().__init__(config, layout, leases)
        self.hub = hub
        self.secret = hub.secret
        hub.workers[config.engine_id] = self
        self.push = config.kv_transfer_op == "push"
        self.jobs: list[_Push] = []                 # producer: pushes to do at the next poll
        self.waiting: dict[str, _Push] = {}         # consumer: pushes not yet notified
        self.notified: list[str] = []               # consumer: request ids pushed
        self.fencing: dict[str, _Push] = {}         # consumer: given up, not yet stopped
        self._fence_ids = itertools.count()

    def advertise(self) -> tuple[str, int]:
        return "loopback", 0

    def _pages(self, region: int) -> torch.Tensor:
        r = self.layout.regions[region]
        return r.tensor.view(r.num_blocks, r.page_bytes)

    def _copy(self, dst: LoopbackWorker, src: LoopbackWorker, load: LoadSpec) -> tuple[int, int]:
        nbytes = transfers = 0
        for g, loc, rem in zip(self.layout.groups, load.local_pages, load.remote_pages):
            if not len(loc):
                continue
            dst_ids, src_ids = torch.from_numpy(loc).long(), torch.from_numpy(rem).long()
            for r in g.regions.tolist():
                copy_pages(dst._pages(r), src._pages(r), dst_ids, src_ids)
                nbytes += len(loc) * self.layout.regions[r].page_bytes
                transfers += 1
        return nbytes, transfers

    def start_load(self, load: LoadSpec) -> None:
        peer = self.hub.workers.get(load.remote.remote_engine_id)
        if peer is None:
            self._load_failed(load.request_id, f"unknown prefill engine "
                                               f"{load.remote.remote_engine_id!r}")
            return
        if self.push:
            self._ask_push(peer, load)
            return
        why = peer.leases.open(load.remote.lease_ref())
        if why:
            self._load_failed(load.request_id, f"the prefill instance refused the pull: {why}")
            return
        nbytes, transfers = self._copy(self, peer, load)
        if not peer.leases.release(load.remote.lease_ref()):
            self._load_failed(load.request_id, "the prefill instance no longer held the "
                                               "blocks (lease expired)")
            return
        self._load_succeeded(load, nbytes, transfers)

    def release(self, remote: RemoteKV) -> None:
        peer = self.hub.workers.get(remote.remote_engine_id)
        if peer is not None:
            peer.leases.release(remote.lease_ref())

    # ------------------------------------------------------------------- push
    def _ask_push(self, peer: LoopbackWorker, load: LoadSpec) -> None:
        rows, why = peer.leases.claim(load.remote.lease_ref())
        if rows is None:
            self._load_failed(load.request_id, f"the prefill instance refused the push: {why}")
            return
        why = check_source_pages(self.layout.groups, rows, load.remote_pages, load.local_pages)
        if why:
            peer.leases.finish_claim(load.remote.remote_request_id)
            self._load_failed(load.request_id, f"the prefill instance refused the push: {why}")
            return
        job = _Push(self, load, time.monotonic() + self.config.kv_load_timeout_s)
        peer.jobs.append(job)
        self.waiting[load.request_id] = job

    def poll(self) -> None:
        # Producer: do the pushes asked since the last step.
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            if not job.cancelled:
                self._copy(job.consumer, self, job.load)
                job.consumer.notified.append(job.load.request_id)
            job.stopped = True
            self.leases.finish_claim(job.load.remote.remote_request_id)
        # Consumer: pushed loads are done; late or cancelled ones are withdrawn (the copy is
        # synchronous at the producer, so a job not yet done is not started either).
        for rid in self.notified:
            job = self.waiting.pop(rid, None)
            if job is not None:
                self._load_succeeded(job.load, *self._copy_size(job.load))
        self.notified = []
        now = time.monotonic()
        for rid, job in list(self.waiting.items()):
            if job.cancelled or now > job.deadline:
                why = "cancelled" if job.cancelled else \
                    f"timed out after {self.config.kv_load_timeout_s:g}s"
                job.cancelled = True
                del self.waiting[rid]
                fence = None
                if not job.stopped:         # the producer has not seen the cancel yet
                    fence = f"loopback-{next(self._fence_ids)}"
                    self.fencing[fence] = job
                self._load_failed(rid, why, fence)
        for fence, job in list(self.fencing.items()):
            if job.stopped:
                del self.fencing[fence]
                self._fenced(fence)

    def _copy_size(self, load: LoadSpec) -> tuple[int, int]:
        nbytes = sum(len(p) * self.layout.regions[r].page_bytes
                     for g, p in zip(self.layout.groups, load.local_pages)
                     for r in g.regions.tolist())
        return nbytes, 1

    def has_pending(self) -> bool:
        return bool(self.jobs or self.waiting or self.notified or self.fencing)

    def cancel(self, request_id: str) -> None:
        job = self.waiting.get(request_id)
        if job is not None:
            job.cancelled = True
            return
        # Pulls are synchronous: nothing is ever in flight. Never reached in practice (a
        # pull finishes in the step it starts), kept for the interface.
        self._load_failed(request_id, "cancelled")

    def close(self) -> None:
        self.hub.workers.pop(self.config.engine_id, None)
