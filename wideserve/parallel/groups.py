"""The data-parallel process group of one engine-core rank (docs/distributed.md).

Backend chosen at run time: a CPU-only torch has no NCCL, so device tensors and control both
go over gloo; on CUDA the device group is NCCL and a second, gloo group carries host-side
control (the per-step sync), so a small integer exchange never waits behind a GPU stream.
Rendezvous is a TCPStore on node 0 (`data_parallel_address:data_parallel_rpc_port`); the same
store lets ranks publish side-channel addresses (recursive-doubling sync).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from wideserve.config import ParallelConfig

logger = logging.getLogger(__name__)


class DPGroupError(RuntimeError):
    """A peer rank is gone or silent past the timeout: the group cannot go on."""


@dataclass
class DPGroup:
    rank: int
    world_size: int
    device: torch.device
    # The groups and the store are None once destroyed: a ProcessGroup object holds the
    # store, and the store (on rank 0) its server's port, for as long as anything refers to it.
    device_group: dist.ProcessGroup | None   # collectives on the device's tensors (EP a2a)
    cpu_group: dist.ProcessGroup | None      # host-side control over gloo (step sync, choices)
    store: dist.Store | None
    timeout_s: float
    address: str                         # node 0's address, as the ranks were told
    store_generation: int = 0            # store keys of side channels built so far

    def store_prefix(self) -> str:
        """A fresh key prefix for one side channel: every rank builds its side channels in
        the same order, so the n-th one of every rank uses the same prefix (a rebuilt
        channel never reads a peer's stale address)."""
        self.store_generation += 1
        return f"g{self.store_generation}/"

    def destroy(self) -> None:
        """Leave the group and let go of the rendezvous store: every process group (the
        default one, the gloo control group) destroyed, the store client closed and, on rank
        0, its server with it (the port freed, once nothing else holds the groups: the
        engine drops its dispatcher's and EPLB's references too). Idempotent. A DP rank calls it
        when it stops (engine/dp_engine.py, LockstepLoop.close), so nothing of this group is left for a
        later group built in the same process (init_process_group refuses a second default
        group; a live store server would still hold the port).

        The store is marked closed before its server goes (`_leave_store`): a peer quicker to
        rebuild than rank 0 could otherwise reach the old server on the same port and lose it
        halfway through joining the new group."""
        if self.store is not None:
            _leave_store(self.store, self.rank, self.world_size, self.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.device_group = self.cpu_group = self.store = None


_CLOSED_KEY = "wideserve/closed"     # set by rank 0 when its store server is about to go
_LEFT_KEY = "wideserve/left"         # how many other ranks have seen that
_LEAVE_BOUND_S = 10.0                # the agreed stop brings every rank here within a step


def _leave_store(store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
    """The leaving handshake: rank 0 marks its store closed and waits (bounded) until every
    other rank has seen the mark; the others wait (bounded) for the mark and acknowledge it.
    So a rank that joins a new group on the same port (init_dp_group) and finds the mark knows
    it reached the old server and tries again. A gone rank 0 ends the wait at once (its
    server is closed); a silent peer at the bound, so a rank's exit after a fault is never
    held long."""
    timeout_s = min(timeout_s, _LEAVE_BOUND_S)
    try:
        if rank == 0:
            store.set(_CLOSED_KEY, "1")
            deadline = time.monotonic() + timeout_s
            while store.add(_LEFT_KEY, 0) < world - 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            store.wait([_CLOSED_KEY], timedelta(seconds=timeout_s))
            store.add(_LEFT_KEY, 1)
    except (RuntimeError, OSError) as e:
        logger.info("DP rank %d: leaving handshake cut short (%s)", rank, e)


def backend_for(device: torch.device) -> str:
    """nccl for CUDA tensors when torch has it, else gloo (the only CPU backend built in)."""
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def local_address_towards(address: str) -> str:
    """This host's address on the route to `address` (the interface peers can reach us on;
    inside a network namespace, the namespace's own address)."""
    if address in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))          # UDP connect sends nothing; it picks a route
        return probe.getsockname()[0]
    finally:
        probe.close()


def _connect_store(parallel: ParallelConfig, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store: rank 0 serves it, the others connect. A connection that finds
    the closed mark (DPGroup.destroy) reached the server of a group on its way out on the same
    port: dropped, and tried again until the new server answers or the timeout."""
    rank = parallel.data_parallel_rank
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if rank == 0:
            return dist.TCPStore(parallel.data_parallel_address, parallel.data_parallel_rpc_port,
                                 parallel.data_parallel_size, is_master=True,
                                 timeout=timeout, wait_for_workers=False)
        try:
            store = dist.TCPStore(parallel.data_parallel_address,
                                  parallel.data_parallel_rpc_port, parallel.data_parallel_size,
                                  is_master=False, timeout=timeout, wait_for_workers=False)
            if not store.check([_CLOSED_KEY]):
                return store
            del store
            reason = "only the store of a closed group answered"
        except (RuntimeError, OSError) as e:
            # The closing server reset the connection between connect and check: the same
            # race as finding the closed mark, one moment later.
            reason = f"the store of a closing group reset the connection ({e})"
        if time.monotonic() > deadline:
            raise RuntimeError(reason)
        time.sleep(0.02)


def init_dp_group(parallel: ParallelConfig, device: torch.device) -> DPGroup:
    """Join the group of `data_parallel_size` ranks; blocks until all have joined (or the
    timeout). Sets GLOO_SOCKET_IFNAME=lo when node 0 is this machine's loopback and nothing
    was chosen, since gloo otherwise resolves the hostname, which sandboxes often lack."""
    rank, world = parallel.data_parallel_rank, parallel.data_parallel_size
    if parallel.data_parallel_address in ("localhost", "127.0.0.1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=parallel.dp_sync_timeout_s)
    try:
        store = _connect_store(parallel, timeout)
        backend = backend_for(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
        world_group = dist.group.WORLD
        assert world_group is not None
        cpu_group = world_group if backend == "gloo" else dist.new_group(backend="gloo",
                                                                         timeout=timeout)
    except (RuntimeError, OSError) as e:
        raise DPGroupError(f"rank {rank}: cannot join the data-parallel group at "
                           f"{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}"
                           f": {e}") from e
    logger.info("DP rank %d/%d joined (%s)", rank, world, backend)
    return DPGroup(rank, world, device, world_group, cpu_group, store,
                   parallel.dp_sync_timeout_s, parallel.data_parallel_address)
