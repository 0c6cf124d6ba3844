"""The KV connector of one engine: its scheduler half and worker half, wired together.

The engine core calls `start_step` after `schedule()` (the worker starts the step's pulls)
and `finish_step` before the next one (finished and failed loads reach the scheduler half).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.disagg.layout import KVLayout
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.scheduler_side import ConnectorScheduler
from wideserve.disagg.worker import KVConnectorWorker

if TYPE_CHECKING:
    import torch

    from wideserve.kv_cache.groups import KVCacheConfig
    from wideserve.types.sched_output import SchedulerOutput

# A step with nothing to compute but transfers in flight sleeps this long: a busy poll would
# starve UCX's progress (and the other processes) on a small machine. With only leases held
# (waiting for a consumer's release or the expiry) it sleeps longer.
TRANSFER_BACKOFF_S = 0.0005
LEASE_BACKOFF_S = 0.005
# With only quarantined blocks waiting for their fence (a silent producer, maybe for long),
# the worker still polls the fences, but rarely.
QUARANTINE_BACKOFF_S = 0.05

# Builds a connector's worker half: (config, layout, leases, hub) -> worker.
WorkerFactory = Callable[[KVTransferConfig, KVLayout, LeaseTable, Any], KVConnectorWorker]


def _nixl_worker(config: KVTransferConfig, layout: KVLayout, leases: LeaseTable,
                 hub: Any) -> KVConnectorWorker:
    from wideserve.disagg.nixl_worker import NixlWorker      # nixl only where it is used
    return NixlWorker(config, layout, leases)


def _loopback_worker(config: KVTransferConfig, layout: KVLayout, leases: LeaseTable,
                     hub: Any) -> KVConnectorWorker:
    from wideserve.disagg.loopback import LoopbackHub, LoopbackWorker
    if not isinstance(hub, LoopbackHub):
        raise ValueError("--kv-transfer-config: LoopbackConnector connects engines in "
                         "one process (tests); use NixlConnector between servers")
    return LoopbackWorker(config, layout, leases, hub)


# KVTransferConfig.kv_connector -> its worker half (the names config.CONNECTORS accepts).
CONNECTOR_WORKERS: dict[str, WorkerFactory] = {}


def register_connector(name: str, factory: WorkerFactory) -> None:
    """Add a connector backend (a KVConnectorWorker implementation) under `name`; the
    built-in ones are registered the same way, below."""
    if name in CONNECTOR_WORKERS:
        raise ValueError(f"KV connector {name!r} is already registered")
    CONNECTOR_WORKERS[name] = factory


register_connector("NixlConnector", _nixl_worker)
register_connector("LoopbackConnector", _loopback_worker)


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
        factory = CONNECTOR_WORKERS.get(self.config.kv_connector)
        if factory is None:
            raise ValueError(f"--kv-transfer-config: unknown kv_connector "
                             f"{self.config.kv_connector!r}; registered: "
                             f"{', '.join(sorted(CONNECTOR_WORKERS))}")
        return factory(self.config, self.layout, self.leases, hub)

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
