"""In-process transport for tests: engines in one process copy pages between their tensors.

A `LoopbackHub` is the "network": engines built with the same hub reach each other by
engine id. Pulls are synchronous torch copies (chunked, so a long prompt never needs one
giant index tensor), released through the producer's LeaseTable exactly as the NIXL backend
does over its side channel, so lease and failure handling is the same code in both.
"""
from __future__ import annotations

import torch

from wideserve.disagg.config import KVTransferConfig
from wideserve.disagg.layout import KVLayout
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.params import LoadSpec, RemoteKV
from wideserve.disagg.worker import KVConnectorWorker

COPY_CHUNK_PAGES = 1024


class LoopbackHub:
    def __init__(self) -> None:
        self.workers: dict[str, LoopbackWorker] = {}


def copy_pages(dst: torch.Tensor, src: torch.Tensor, dst_ids: torch.Tensor,
               src_ids: torch.Tensor, chunk: int = COPY_CHUNK_PAGES) -> None:
    """dst[dst_ids] = src[src_ids] on [num_blocks, page_bytes] views, `chunk` pages at a time."""
    for i in range(0, len(dst_ids), chunk):
        dst.index_copy_(0, dst_ids[i:i + chunk], src.index_select(0, src_ids[i:i + chunk]))


class LoopbackWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, leases: LeaseTable,
                 hub: LoopbackHub) -> None:
        super().__init__(config, layout, leases)
        self.hub = hub
        hub.workers[config.engine_id] = self

    def advertise(self) -> tuple[str, int]:
        return "loopback", 0

    def _pages(self, region: int) -> torch.Tensor:
        r = self.layout.regions[region]
        return r.tensor.view(r.num_blocks, r.page_bytes)

    def start_load(self, load: LoadSpec) -> None:
        peer = self.hub.workers.get(load.remote.remote_engine_id)
        if peer is None:
            self._load_failed(load.request_id, f"unknown prefill engine "
                                               f"{load.remote.remote_engine_id!r}")
            return
        nbytes = transfers = 0
        for g, loc, rem in zip(self.layout.groups, load.local_pages, load.remote_pages):
            if not len(loc):
                continue
            dst_ids, src_ids = torch.from_numpy(loc).long(), torch.from_numpy(rem).long()
            for r in g.regions.tolist():
                copy_pages(self._pages(r), peer._pages(r), dst_ids, src_ids)
                nbytes += len(loc) * self.layout.regions[r].page_bytes
                transfers += 1
        if not peer.leases.release(load.remote.remote_request_id):
            self._load_failed(load.request_id, "the prefill instance no longer held the "
                                               "blocks (lease expired)")
            return
        self._load_succeeded(load, nbytes, transfers)

    def release(self, remote: RemoteKV) -> None:
        peer = self.hub.workers.get(remote.remote_engine_id)
        if peer is not None:
            peer.leases.release(remote.remote_request_id)

    def cancel(self, request_id: str) -> None:
        # Loads are synchronous: nothing is ever in flight. Never reached in practice (a load
        # finishes in the step it starts), kept for the interface.
        self._load_failed(request_id, "cancelled")

    def close(self) -> None:
        self.hub.workers.pop(self.config.engine_id, None)
