"""The front end's handle on N data-parallel engine-core ranks (docs/distributed.md).

Same surface as `EngineCoreClient` (start, shutdown, add/abort, utility calls, health, stats,
the on_outputs / on_dead / on_step_times callbacks), so the server and the offline LLM drive
one rank or many alike. Each rank is an EngineCoreClient: ranks on this node are spawned here
(private ipc sockets); ranks of other nodes (`--headless` there) connect to TCP sockets bound
on `data_parallel_address` (ports in `rank_addresses`).

A request (all `n` children of it together) goes to the rank the LoadBalancer picks; aborts
follow it there. The ranks fail together: under expert parallelism no rank can step without
the others, so the first rank to die makes the whole client dead (health fails, every call
and in-flight request gets EngineDeadError) and the surviving ranks are shut down.

Every rank is watched with the same heartbeat and stall timeouts (the server's
--engine-heartbeat-timeout / --engine-stall-timeout): a hung or stopped rank makes /health
fail within the first and the whole group dead within the second (docs/reliability.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from wideserve.config import EngineConfig, ParallelConfig
from wideserve.serving.engine_client import (HEARTBEAT_TIMEOUT_S, STALL_TIMEOUT_S, EngineCoreClient,
                                             EngineDeadError, EngineStartupError)
from wideserve.disagg.connector_metrics import sum_counters
from wideserve.serving.dp_balancer import LoadBalancer

DP_ENGINE = "wideserve.engine.dp_engine:DPEngineCore"
# Summed over ranks in the aggregate stats (everything else: rank 0's, or a mean).
_SUMMED = ("num_running", "num_waiting", "prefix_queries", "prefix_hits", "num_preemptions",
           "prompt_tokens", "generation_tokens")


def rank_addresses(parallel: ParallelConfig, rank: int) -> tuple[str, str]:
    """TCP (input, output) sockets of a rank that runs on another node: bound by the front
    end on node 0 at data_parallel_rpc_port + 1 + 2 * rank (+ 1); the rendezvous store has
    data_parallel_rpc_port itself."""
    base = parallel.data_parallel_rpc_port + 1 + 2 * rank
    host = parallel.data_parallel_address
    return f"tcp://{host}:{base}", f"tcp://{host}:{base + 1}"


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    parallel = dataclasses.replace(config.parallel, data_parallel_rank=rank)
    return dataclasses.replace(config, parallel=parallel)


class DPEngineClient:
    def __init__(self, config: EngineConfig, *, heartbeat_s: float = 1.0,
                 stale_after_s: float = HEARTBEAT_TIMEOUT_S,
                 stall_timeout_s: float = STALL_TIMEOUT_S, env: dict[str, str] | None = None,
                 prefix_affinity: bool = False) -> None:
        p = config.parallel
        p.check()
        self.config = config
        self.num_ranks = p.data_parallel_size
        local = range(p.data_parallel_start_rank, p.data_parallel_start_rank + p.local_size)
        self.clients: list[EngineCoreClient] = []
        for rank in range(self.num_ranks):
            spawn = rank in local
            client = EngineCoreClient(
                rank_config(config, rank), engine_path=DP_ENGINE, heartbeat_s=heartbeat_s,
                stale_after_s=stale_after_s, stall_timeout_s=stall_timeout_s, env=env,
                spawn=spawn,
                addresses=None if spawn else rank_addresses(p, rank))
            client.on_outputs = self._outputs_handler(rank)
            client.on_dead = self._dead_handler(rank)
            client.on_step_times = self._step_times
            self.clients.append(client)
        block = config.cache.block_size         # None: the model's; the balancer's own
        self.balancer = LoadBalancer(self.num_ranks, prefix_affinity=prefix_affinity,
                                     **({} if block is None else {"affinity_block": block}))
        self.on_outputs: Callable[[list[Any]], None] = lambda outputs: None
        self.on_dead: Callable[[str], None] = lambda reason: None
        self.on_step_times: Callable[[list[float]], None] = lambda seconds: None
        self.model_info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self._owner: dict[str, int] = {}            # engine request id -> rank
        self._closed = False
        self._cleanup: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 900.0) -> dict[str, Any]:
        """Start every rank (they join their group together) and wait until all are ready."""
        results = await asyncio.gather(*(c.start(timeout_s) for c in self.clients),
                                       return_exceptions=True)
        failed = [(r, e) for r, e in enumerate(results) if isinstance(e, BaseException)]
        if failed:
            await self.shutdown()
            rank, error = failed[0]
            if not isinstance(error, Exception):
                raise error                                  # cancellation, interrupt
            raise EngineStartupError(f"data-parallel rank {rank}: {error}") from error
        self.model_info = dict(self.clients[0].model_info)
        self.model_info["data_parallel_size"] = self.num_ranks
        return self.model_info

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        # All ranks are told first (they agree on stopping), then each is waited for.
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients),
                             return_exceptions=True)

    # ------------------------------------------------------------------ liveness
    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and not self._closed

    def health(self) -> tuple[bool, str]:
        if self.dead_reason is not None:
            return False, self.dead_reason
        for rank, client in enumerate(self.clients):
            ok, detail = client.health()
            if not ok:
                return False, f"data-parallel rank {rank}: {detail}"
        return True, "ok"

    def _dead_handler(self, rank: int) -> Callable[[str], None]:
        def dead(reason: str) -> None:
            if self.dead_reason is not None:
                return
            self.dead_reason = f"data-parallel rank {rank}: {reason}"
            self._owner.clear()
            self.on_dead(self.dead_reason)
            # The others cannot step without it: stop them (they would time out anyway).
            try:
                self._cleanup = asyncio.get_running_loop().create_task(self.shutdown())
            except RuntimeError:
                pass
        return dead

    # ------------------------------------------------------------------- traffic
    def _outputs_handler(self, rank: int) -> Callable[[list[Any]], None]:
        def outputs(outs: list[Any]) -> None:
            done = 0
            for out in outs:
                if out.finished and self._owner.pop(out.request_id, None) is not None:
                    done += 1
            if done:
                self.balancer.finished(rank, done)
            self.on_outputs(outs)
        return outputs

    def _step_times(self, seconds: list[float]) -> None:
        self.on_step_times(seconds)        # set after construction (the server's metrics)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineDeadError("engine core shut down")

    def rank_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    async def add_requests(self, requests: list[Any], pending: int = -1) -> None:
        """One front-end request's engine requests (its n children): all to one rank.
        `pending` (the front end's held requests) is not passed on: the balancer spreads
        them over the ranks, so no rank can tell how many will come to it; the ranks wait
        out their arrival gap instead (engine/engine_proc.py)."""
        self._check_alive()
        if not requests:
            return
        rank = self.balancer.pick(requests[0].prompt_token_ids, self.rank_stats)
        for req in requests:
            self._owner[req.request_id] = rank
        self.balancer.sent(rank, len(requests))
        await self.clients[rank].add_requests(requests)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or not self.is_alive:
            return
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._owner.get(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            await self.clients[rank].abort_requests(ids)

    async def call_utility(self, method: str, timeout_s: float = 60.0) -> Any:
        """get_stats: the aggregate plus `per_rank`; other methods: every rank's result must
        succeed (check_integrity), rank 0's is returned."""
        self._check_alive()
        results = await asyncio.gather(*(c.call_utility(method, timeout_s)
                                         for c in self.clients))
        if method == "get_stats":
            return aggregate_stats(list(results))
        return results[0]

    # --------------------------------------------------------------------- stats
    @property
    def rank_stats(self) -> list[dict[str, Any]]:
        return [c.stats for c in self.clients]

    @property
    def stats(self) -> dict[str, Any]:
        return aggregate_stats(self.rank_stats)


def aggregate_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed over ranks, KV usage averaged, step stats of rank 0; `per_rank` keeps
    every rank's own snapshot (the per-rank /metrics come from it)."""
    present = [s for s in per_rank if s]
    if not present:
        return {}
    out: dict[str, Any] = dict(present[0])
    for key in _SUMMED:
        if all(key in s for s in present):
            out[key] = sum(s[key] for s in present)
    out["kv_usage"] = sum(float(s.get("kv_usage", 0.0)) for s in present) / len(present)
    if all(s.get("kv_transfer") for s in present):
        out["kv_transfer"] = sum_counters([s["kv_transfer"] for s in present])
    out["per_rank"] = per_rank
    return out
