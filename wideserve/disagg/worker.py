"""The worker half of the KV connector: owns the registered KV tensors and moves bytes.

`start(meta)` begins the step's pulls (and releases / cancels), `get_finished()` reports which
loads completed or failed since the last call. A load is complete only once the producer has
confirmed it still held the blocks (leases.py); a load that fails or times out is reported
only after its transfer has stopped, so its blocks can be freed safely; or, where the
transfer cannot be known to have stopped (a producer that does not answer), with a fence:
its blocks are quarantined until the fence is reported (docs/disaggregation.md, "Fencing").
"""
from __future__ import annotations

import abc
from typing import Any

from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.disagg.layout import KVLayout
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.params import ConnectorMeta, LoadSpec, WorkerResult


class KVConnectorWorker(abc.ABC):
    # The shared KV secret: the side channel's key, and the key the scheduler half signs and
    # checks handles with (params.handle_mac). Set by each backend.
    secret: bytes = b""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, leases: LeaseTable) -> None:
        self.config = config
        self.layout = layout
        self.leases = leases
        extra = config.kv_connector_extra_config
        # Fault injection for tests and benchmarks: the next N loads fail after the pull.
        self._inject_failures = int(extra.get("inject_load_failures", 0))
        self._result = WorkerResult()

    def start(self, meta: ConnectorMeta | None) -> None:
        if meta is None:
            return
        for rid in meta.cancels:
            self.cancel(rid)
        for load in meta.loads:
            self.start_load(load)
        for remote in meta.releases:
            self.release(remote)

    def get_finished(self) -> WorkerResult:
        self.poll()
        out, self._result = self._result, WorkerResult()
        return out

    def _load_succeeded(self, load: LoadSpec, nbytes: int, num_transfers: int) -> None:
        if self._inject_failures > 0:
            self._inject_failures -= 1
            self._result.failed_loads[load.request_id] = "KV load failed: injected failure"
            return
        self._result.finished_loads.append(load.request_id)
        self._result.bytes_loaded += nbytes
        self._result.pages_loaded += load.num_pages
        self._result.num_transfers += num_transfers

    def _load_failed(self, request_id: str, why: str, fence: str | None = None) -> None:
        """`fence`: the transfer is not known to have stopped; the blocks stay quarantined
        until `_fenced(fence)`."""
        self._result.failed_loads[request_id] = f"KV load failed: {why}"
        if fence is not None:
            self._result.quarantined[request_id] = fence

    def _fenced(self, fence: str) -> None:
        self._result.fenced.append(fence)

    # ---------------------------------------------------------------- backends
    @abc.abstractmethod
    def advertise(self) -> tuple[str, int]:
        """(host, port) a consumer reaches this instance's side channel at."""

    @abc.abstractmethod
    def start_load(self, load: LoadSpec) -> None: ...

    @abc.abstractmethod
    def release(self, remote: Any) -> None:
        """Tell a producer it may free a request's blocks (no answer needed)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stop a load (aborted request); report it in get_finished once stopped."""

    def poll(self) -> None:
        """Advance in-flight loads (asynchronous backends)."""

    def has_pending(self) -> bool:
        return False

    def close(self) -> None:
        pass
