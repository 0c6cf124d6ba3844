"""The KV connector of one engine: its scheduler half and worker half, wired together.

The engine core calls `start_step` after `schedule()` (the worker starts the step's pulls)
and `finish_step` before the next one (finished and failed loads reach the scheduler half).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from wideserve.disagg.config import KVTransferConfig
from wideserve.disagg.layout import KVLayout
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.scheduler_side import ConnectorScheduler
from wideserve.disagg.worker import KVConnectorWorker

if TYPE_CHECKING:
    import torch

    from wideserve.core.kv_cache.groups import KVCacheConfig
    from wideserve.core.sched_output import SchedulerOutput

# A step with nothing to compute but transfers in flight sleeps this long: a busy poll would
# starve UCX's progress (and the other processes) on a small machine. With only leases held
# (waiting for a consumer's release or the expiry) it sleeps longer.
TRANSFER_BACKOFF_S = 0.0005
LEASE_BACKOFF_S = 0.005
# With only quarantined blocks waiting for their fence (a silent producer, maybe for long),
# the worker still polls the fences, but rarely.
QUARANTINE_BACKOFF_S = 0.05


class KVConnector:
    def __init__(self, config: KVTransferConfig, kv_config: KVCacheConfig,
                 kv_caches: dict[str, torch.Tensor], hub: Any = None) -> None:
        self.config = config
        self.layout = KVLayout(kv_config, kv_caches)
        self.leases = LeaseTable()
        self.worker = self._make_worker(hub)
        self.scheduler = ConnectorScheduler(config, self.layout.groups, self.layout.fingerprint,
                                            self.worker.advertise(), self.leases,
                                            self.worker.secret)

    def _make_worker(self, hub: Any) -> KVConnectorWorker:
        if self.config.kv_connector == "LoopbackConnector":
            from wideserve.disagg.loopback import LoopbackHub, LoopbackWorker
            if not isinstance(hub, LoopbackHub):
                raise ValueError("--kv-transfer-config: LoopbackConnector connects engines in "
                                 "one process (tests); use NixlConnector between servers")
            return LoopbackWorker(self.config, self.layout, self.leases, hub)
        from wideserve.disagg.nixl_worker import NixlWorker
        return NixlWorker(self.config, self.layout, self.leases)

    def start_step(self, sched_out: SchedulerOutput) -> None:
        self.worker.start(sched_out.kv_connector_meta)
        if not sched_out.is_empty:
            return
        if self.worker.has_pending() or self.scheduler.num_loading:
            time.sleep(TRANSFER_BACKOFF_S)
        elif self.scheduler.has_pending():
            time.sleep(QUARANTINE_BACKOFF_S if self.scheduler.waits_only_for_fences
                       else LEASE_BACKOFF_S)

    def finish_step(self) -> None:
        self.scheduler.update(self.worker.get_finished())

    def close(self) -> None:
        self.worker.close()
