"""The scheduler half of the KV connector: plans loads and leases, never moves bytes.

Consumer (decode instance): `wants_load` / `num_external_tokens` / `start_load` admit a
request whose prompt KV comes from a producer (the scheduler gives it slots, the worker half
pulls), `take_finished_loads` hands back arrived loads (their tokens become computed) and
failed ones (the scheduler recomputes or fails them, `kv_load_failure_policy`). At most
`max_new_kv_loads_per_step` loads start per step, so a burst of arrivals never stalls the
running batch with admission work.

Producer (prefill instance): `request_finished` keeps a finished `do_remote_decode`
request's blocks under a lease and returns the handle (RemoteKV) for the response; the blocks
are freed when a consumer releases them or the lease expires, whichever comes first.

Ownership: a request's blocks belong to exactly one of the scheduler (queued/running), this
object (loading, or held under a lease), the quarantine, or nobody (freed). A load that is
aborted keeps its blocks here until the worker says the transfer has stopped; one the worker
gave up on without knowing that (a producer that does not answer) moves its blocks to the
quarantine (KVCacheManager.quarantine) until the worker reports its fence. So a late write
can never land in blocks another request already uses.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from wideserve.config.kv_transfer import KVTransferConfig
from wideserve.disagg.layout import GroupPlan, plan_pages
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.connector_metrics import LOAD_BUCKETS, observe
from wideserve.disagg.params import (ConnectorMeta, LoadSpec, RemoteKV, WorkerResult,
                                     handle_problem, prompt_digest, sign_handle,
                                     wants_remote_decode, wants_remote_prefill)
from wideserve.types.request import RequestStatus

# The KV manager key a quarantined load's blocks are held under (+ the fence id).
QUARANTINE_KEY = "kv-quarantine:"

if TYPE_CHECKING:
    from wideserve.kv_cache.kv_cache_manager import KVCacheManager
    from wideserve.types.multimodal import ImageInput
    from wideserve.types.request import Request


@dataclass(slots=True)
class ConnectorStats:
    loads_started: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    loads_skipped: int = 0           # remote handle given, but the local prefix cache had it all
    tokens_loaded: int = 0           # prompt tokens whose KV arrived instead of being computed
    pages_loaded: int = 0
    bytes_loaded: int = 0
    transfers: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    loads_quarantined: int = 0       # failed loads whose blocks had to wait for a fence
    quarantines_released: int = 0
    handles_refused: int = 0         # kv_transfer_params refused at admission (unsigned, forged)
    max_loads_started_per_step: int = 0
    # Completed loads' admission-to-arrival time: per-bucket counts (metrics.LOAD_BUCKETS).
    load_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    load_seconds_sum: float = 0.0


@dataclass(slots=True)
class _Load:
    request: Request
    end: int                          # num_computed_tokens once the KV has arrived
    remote: RemoteKV
    started: float = field(default_factory=time.monotonic)
    aborted: bool = False


class ConnectorScheduler:
    def __init__(self, config: KVTransferConfig, groups: list[GroupPlan], fingerprint: str,
                 advertise: tuple[str, int], leases: LeaseTable, secret: bytes) -> None:
        self.config = config
        self.secret = secret            # signs this producer's handles, checks consumers' ones
        self.groups = groups
        self.fingerprint = fingerprint
        self.host, self.port = advertise
        self.leases = leases
        self.kv: KVCacheManager | None = None
        self.stats = ConnectorStats()
        self._loads: dict[str, _Load] = {}
        self._held: dict[str, Request] = {}         # producer: leased requests
        self._done: list[tuple[Request, int]] = []
        self._failed: list[tuple[Request, str]] = []
        self._quarantine: dict[str, str] = {}       # fence id -> KV manager key
        self._meta = ConnectorMeta()
        self._started_this_step = 0

    def bind(self, kv: KVCacheManager) -> None:
        self.kv = kv

    # ------------------------------------------------------------------ validation
    def validate(self, params: dict[str, Any] | None, prompt_token_ids: Sequence[int],
                 images: Sequence[ImageInput] | None = None) -> str | None:
        """Why a request's kv_transfer_params cannot be served here (None: fine). A handle is
        admitted only when the producer's signature over it verifies for this very prompt
        (params.handle_problem): it names exactly the blocks exported for this prompt."""
        num_prompt_tokens = len(prompt_token_ids)
        if wants_remote_prefill(params):
            if not self.config.is_consumer:
                return f"kv_transfer_params.do_remote_prefill: this instance's kv_role is " \
                       f"{self.config.kv_role!r}, not a consumer"
            assert params is not None
            try:
                remote = RemoteKV.from_dict(params)
            except ValueError as e:
                return str(e)
            if remote.remote_layout != self.fingerprint:
                return "kv_transfer_params: the prefill instance's KV layout differs from " \
                       "this one's (same model and cache settings needed on both)"
            if remote.remote_num_tokens != num_prompt_tokens:
                return f"kv_transfer_params: the prefill computed {remote.remote_num_tokens} " \
                       f"tokens but the prompt has {num_prompt_tokens}"
            problem = handle_problem(self.secret, remote, prompt_token_ids, images)
            if problem is not None:
                self.stats.handles_refused += 1
                return problem
        elif wants_remote_decode(params) and not self.config.is_producer:
            return f"kv_transfer_params.do_remote_decode: this instance's kv_role is " \
                   f"{self.config.kv_role!r}, not a producer"
        return None

    # -------------------------------------------------------------------- consumer
    def wants_load(self, request: Request) -> bool:
        return wants_remote_prefill(request.kv_transfer_params)

    def can_start_load(self) -> bool:
        cap = self.config.max_new_kv_loads_per_step
        return cap == 0 or self._started_this_step < cap

    def num_external_tokens(self, request: Request, num_local: int) -> int:
        """Prompt positions after the local hit whose KV the producer has: all but the last
        prompt token, which is computed here so its logits exist."""
        return max(0, request.num_prompt_tokens - 1 - num_local)

    def start_load(self, request: Request, local_rows: list[list[int]], start: int,
                   end: int) -> None:
        remote = RemoteKV.from_dict(request.kv_transfer_params or {})
        self._started_this_step += 1
        self.stats.loads_started += 1
        self._loads[request.request_id] = _Load(request, end, remote)
        try:
            local, rem = plan_pages(self.groups, local_rows, remote.remote_block_ids,
                                    start, end)
        except ValueError as e:
            self._finish_load(request.request_id, f"KV load failed: {e}")
            return
        self._meta.loads.append(LoadSpec(request.request_id, remote, local, rem))

    def skip_load(self, request: Request) -> None:
        """Nothing to pull (or no room to): tell the producer it may free the blocks."""
        self.stats.loads_skipped += 1
        self._meta.releases.append(RemoteKV.from_dict(request.kv_transfer_params or {}))
        request.kv_transfer_params = None

    def take_finished_loads(self) -> tuple[list[tuple[Request, int]], list[tuple[Request, str]]]:
        # A request ended (aborted) after its load finished is gone: nothing to resume.
        done = [d for d in self._done if not d[0].status.finished]
        failed = [f for f in self._failed if not f[0].status.finished]
        self._done, self._failed = [], []
        for request, _ in (*done, *failed):
            request.kv_transfer_params = None       # consumed: a preemption recomputes
        return done, failed

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def _finish_load(self, request_id: str, error: str | None,
                     fence: str | None = None) -> None:
        load = self._loads.pop(request_id, None)
        if load is None:
            return
        if fence is not None:
            # The transfer may still write into these blocks: they stay held, unpublished,
            # until the worker reports the fence; the request goes on without them.
            assert self.kv is not None
            key = f"{QUARANTINE_KEY}{fence}"
            self.kv.quarantine(request_id, key)
            self._quarantine[fence] = key
            self.stats.loads_quarantined += 1
        if load.aborted:
            assert self.kv is not None
            self.kv.free(load.request)      # the request already ended; the pull has stopped
            return
        if error is None:
            elapsed = time.monotonic() - load.started
            observe(self.stats.load_seconds_buckets, elapsed)
            self.stats.load_seconds_sum += elapsed
            self.stats.loads_done += 1
            self.stats.tokens_loaded += load.end - load.request.num_computed_tokens
            self._done.append((load.request, load.end))
        else:
            self.stats.loads_failed += 1
            self._meta.releases.append(load.remote)     # let the producer free early
            self._failed.append((load.request, error))

    # -------------------------------------------------------------------- producer
    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Free a finished request's blocks, or hold them: under a lease (producer), or until
        its aborted load stops (consumer). Returns the handle for the response, if any."""
        assert self.kv is not None
        rid = request.request_id
        load = self._loads.get(rid)
        if load is not None:
            load.aborted = True
            self._meta.cancels.append(rid)
            return None
        if self.config.is_producer and wants_remote_decode(request.kv_transfer_params) \
                and request.status in (RequestStatus.FINISHED_STOPPED,
                                       RequestStatus.FINISHED_LENGTH):
            self._held[rid] = request
            # The consumer computes the last prompt token itself: only its window is needed.
            self.kv.trim_to_window(request, request.num_prompt_tokens - 1)
            rows = self.kv.block_ids(rid)
            lease = self.leases.grant(rid, self.config.kv_lease_s, rows,
                                      request.num_prompt_tokens)
            self.stats.leases_granted += 1
            return sign_handle(self.secret, RemoteKV(
                remote_engine_id=self.config.engine_id, remote_host=self.host,
                remote_port=self.port, remote_request_id=rid,
                remote_block_ids=rows,
                remote_num_tokens=request.num_prompt_tokens,
                remote_layout=self.fingerprint, remote_lease=lease,
                remote_prompt_digest=prompt_digest(request.prompt_array(),
                                                   request.images))).to_dict()
        self.kv.free(request)
        return None

    def _free_leases(self) -> None:
        assert self.kv is not None
        for rid in self.leases.take_released():
            request = self._held.pop(rid, None)
            if request is not None:
                self.stats.leases_released += 1
                self.kv.free(request)
        if self._held:
            for rid in self.leases.take_expired():
                request = self._held.pop(rid, None)
                if request is not None:
                    self.stats.leases_expired += 1
                    self.kv.free(request)

    # ---------------------------------------------------------------- step plumbing
    def build_meta(self) -> ConnectorMeta | None:
        """The worker's plan for this step (None when there is nothing to do)."""
        self._free_leases()
        self.stats.max_loads_started_per_step = max(self.stats.max_loads_started_per_step,
                                                    self._started_this_step)
        self._started_this_step = 0
        meta, self._meta = self._meta, ConnectorMeta()
        return meta if (meta.loads or meta.releases or meta.cancels) else None

    def update(self, result: WorkerResult) -> None:
        for rid in result.finished_loads:
            self._finish_load(rid, None)
        for rid, why in result.failed_loads.items():
            self._finish_load(rid, why, result.quarantined.get(rid))
        for fence in result.fenced:
            key = self._quarantine.pop(fence, None)
            if key is not None:
                assert self.kv is not None
                self.kv.release_quarantine(key)
                self.stats.quarantines_released += 1
        self.stats.bytes_loaded += result.bytes_loaded
        self.stats.transfers += result.num_transfers
        self.stats.pages_loaded += result.pages_loaded

    def has_pending(self) -> bool:
        return bool(self._loads or self._held or self._done or self._failed or self._quarantine
                    or self._meta.loads or self._meta.releases or self._meta.cancels)

    @property
    def waits_only_for_fences(self) -> bool:
        return bool(self._quarantine) and not (self._loads or self._held or self._done
                                               or self._failed or self._meta.loads
                                               or self._meta.releases or self._meta.cancels)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_quarantined(self) -> int:
        """Given-up loads whose blocks wait for their fence (they hold blocks like a
        sequence, hence count against max_num_seqs)."""
        return len(self._quarantine)

    def snapshot(self) -> dict[str, Any]:
        blocks = self.kv.num_quarantined_blocks if self.kv is not None else 0
        return {**asdict(self.stats), **self.leases.counters(),
                "loading": len(self._loads), "held": len(self._held),
                "quarantined": len(self._quarantine), "quarantined_blocks": blocks}
