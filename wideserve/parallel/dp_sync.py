"""The per-step agreement of the data-parallel ranks (docs/distributed.md, "Lock-step").

Before every step each rank contributes a small int64 row (does it have work, how many
requests, does it want to stop) and gets every rank's row back. All ranks then take the same decision:
step (a rank without work runs a dummy batch), idle, or stop together. This exchange is on the
critical path of every step of every rank, so there are two implementations and the faster,
measured at start-up on this group, is used:

- `GlooStepSync`: one all-reduce (sum) of a [world, F] tensor in which each rank fills its row,
  on the gloo control group.
- `RecursiveDoublingSync`: an all-gather by recursive doubling over plain TCP sockets (a side
  channel beside torch.distributed): log2(world) rounds, in round k rank r swaps the 2^k rows
  it knows with rank r ^ 2^k. No framework on the path; power-of-two worlds only.

Both raise DPGroupError when a peer is gone or silent past the group timeout.
"""
from __future__ import annotations

import socket
import statistics
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from wideserve.parallel.groups import DPGroup, DPGroupError, local_address_towards

HAS_WORK, NUM_REQS, STOP = 0, 1, 2
NUM_FIELDS = 3
CALIBRATION_ROUNDS = 30


class StepSync(ABC):
    name: str

    @abstractmethod
    def exchange(self, row: np.ndarray) -> np.ndarray:
        """row [NUM_FIELDS] int64 -> [world, NUM_FIELDS] int64, every rank's row."""

    def close(self) -> None:
        pass


class GlooStepSync(StepSync):
    name = "gloo"

    def __init__(self, group: DPGroup) -> None:
        self.group = group
        self._buf = torch.zeros(group.world_size, NUM_FIELDS, dtype=torch.int64)

    def exchange(self, row: np.ndarray) -> np.ndarray:
        self._buf.zero_()
        self._buf[self.group.rank] = torch.from_numpy(row)
        try:
            dist.all_reduce(self._buf, group=self.group.cpu_group)
        except (RuntimeError, dist.DistBackendError) as e:
            raise DPGroupError(f"DP step sync (gloo) failed: {e}") from e
        return self._buf.numpy().copy()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        part = sock.recv(n - got)
        if not part:
            raise ConnectionError("peer closed the connection")
        chunks.append(part)
        got += len(part)
    return b"".join(chunks)


class RecursiveDoublingSync(StepSync):
    name = "rd"

    def __init__(self, group: DPGroup) -> None:
        world = group.world_size
        if world & (world - 1):
            raise ValueError(f"recursive doubling needs a power-of-two world, got {world}")
        self.group = group
        self.rank = group.rank
        self.rounds = world.bit_length() - 1
        self.peers: list[socket.socket] = []
        self._connect()

    def _connect(self) -> None:
        """One TCP connection per round's partner; addresses travel through the store. A rank
        connects to its higher partners (a connect completes on the peer's backlog) and then
        accepts its lower ones, in whatever order they arrive, each naming its rank."""
        g = self.group
        host = local_address_towards(g.address)
        listener = socket.create_server((host, 0), backlog=max(self.rounds, 1))
        listener.settimeout(g.timeout_s)
        prefix = g.store_prefix()
        g.store.set(f"{prefix}dp_rd_addr_{self.rank}", f"{host}:{listener.getsockname()[1]}")
        partners = [self.rank ^ (1 << k) for k in range(self.rounds)]
        by_rank: dict[int, socket.socket] = {}
        try:
            for partner in (p for p in partners if p > self.rank):
                addr = g.store.get(f"{prefix}dp_rd_addr_{partner}").decode()
                peer_host, port = addr.rsplit(":", 1)
                sock = socket.create_connection((peer_host, int(port)), timeout=g.timeout_s)
                sock.sendall(struct.pack("<q", self.rank))
                by_rank[partner] = sock
            lower = {p for p in partners if p < self.rank}
            while lower - by_rank.keys():
                sock, _ = listener.accept()
                sock.settimeout(g.timeout_s)
                (who,) = struct.unpack("<q", _recv_exact(sock, 8))
                if who not in lower or who in by_rank:
                    sock.close()
                    raise DPGroupError(f"rank {self.rank}: unexpected side-channel peer {who}")
                by_rank[who] = sock
        except (OSError, RuntimeError) as e:
            for sock in by_rank.values():
                sock.close()
            raise DPGroupError(f"rank {self.rank}: side channel setup failed: {e}") from e
        finally:
            listener.close()
        for partner in partners:
            by_rank[partner].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peers.append(by_rank[partner])

    def exchange(self, row: np.ndarray) -> np.ndarray:
        world = self.group.world_size
        rows = np.zeros((world, NUM_FIELDS), dtype=np.int64)
        rows[self.rank] = row
        try:
            for k, sock in enumerate(self.peers):
                size = 1 << k
                mine = self.rank & ~(size - 1)            # the aligned block this rank knows
                theirs = mine ^ size
                sock.sendall(rows[mine:mine + size].tobytes())
                data = _recv_exact(sock, size * NUM_FIELDS * 8)
                rows[theirs:theirs + size] = np.frombuffer(data, dtype=np.int64).reshape(
                    size, NUM_FIELDS)
        except (OSError, ConnectionError) as e:
            raise DPGroupError(f"DP step sync (side channel) failed: {e}") from e
        return rows

    def close(self) -> None:
        for sock in self.peers:
            sock.close()
        self.peers = []


@dataclass
class SyncStats:
    method: str = ""
    calibration_us: dict[str, float] = field(default_factory=dict)   # median per method
    count: int = 0
    total_s: float = 0.0
    last_s: float = 0.0


def _median_us(sync: StepSync, rounds: int) -> float:
    row = np.zeros(NUM_FIELDS, dtype=np.int64)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        sync.exchange(row)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def choose_step_sync(group: DPGroup, method: str = "auto",
                     rounds: int = CALIBRATION_ROUNDS) -> tuple[StepSync, SyncStats]:
    """Build the step sync. "auto" measures both on this group and keeps the faster; every
    rank must take the same choice, so the decision uses the slowest rank's medians."""
    stats = SyncStats()
    gloo = GlooStepSync(group)
    if method == "gloo" or (method == "auto" and group.world_size & (group.world_size - 1)):
        stats.method = "gloo"
        return gloo, stats
    rd = RecursiveDoublingSync(group)
    if method == "rd":
        stats.method = "rd"
        return rd, stats
    medians = torch.tensor([_median_us(gloo, rounds), _median_us(rd, rounds)],
                           dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group.cpu_group)
    stats.calibration_us = {"gloo": float(medians[0]), "rd": float(medians[1])}
    if medians[1] <= medians[0]:
        stats.method = "rd"
        return rd, stats
    rd.close()
    stats.method = "gloo"
    return gloo, stats


class TimedStepSync:
    """The chosen sync plus its per-step timing (exported in the engine's stats)."""

    def __init__(self, sync: StepSync, stats: SyncStats) -> None:
        self.sync = sync
        self.stats = stats

    def exchange(self, has_work: bool, num_reqs: int, stop: bool) -> np.ndarray:
        row = np.array([int(has_work), num_reqs, int(stop)], dtype=np.int64)
        start = time.perf_counter()
        rows = self.sync.exchange(row)
        took = time.perf_counter() - start
        self.stats.count += 1
        self.stats.total_s += took
        self.stats.last_s = took
        return rows

    def close(self) -> None:
        self.sync.close()
