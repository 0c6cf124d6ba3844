"""One data-parallel engine-core rank under DEP (docs/distributed.md).

With `enable_expert_parallel` the ranks form a torch.distributed group, each loads only its
routed experts, and every MoE layer is an all-to-all, so the ranks step in lock-step:

    every iteration: exchange (has work, requests, stop) with all ranks  (TimedStepSync)
      any rank wants to stop -> all stop together
      nobody has work        -> idle (the loop polls input for dp_idle_poll_ms, then again)
      else                   -> ranks with work run their step; the others a dummy batch of
                                one token (token id included: hash-routed layers need it)
                             -> finish_step(): answer peers' remaining MoE calls (a rank that
                                ran no draft forward still serves the drafts' experts)

Without expert parallelism the ranks share nothing during a step, so each is a plain engine
(no group, no lock-step) and only the front end's load balancing ties them together.
"""
from __future__ import annotations

import faulthandler
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass, replace

import torch

from wideserve.config import EngineConfig
from wideserve.engine.engine_core import EngineCore, EngineStats
from wideserve.engine.engine_proc import EngineLoop
from wideserve.engine.errors import DuplicateRequestError
from wideserve.types.messages import EngineCoreRequest
from wideserve.types.sched_output import EngineCoreOutput, SchedulerOutput
from wideserve.parallel.devices import bind_device, rank_device
from wideserve.parallel.dp_sync import HAS_WORK, NUM_REQS, STOP, TimedStepSync, choose_step_sync
from wideserve.layers.ep_dispatch import EPDispatcher, PaddedSteps, make_dispatcher
from wideserve.worker.decode_capture import capture_sizes
from wideserve.worker.eplb_balancer import EpGroup
from wideserve.worker.eplb_manager import EplbManager
from wideserve.worker.expert_shard import moe_stacks, routed_experts, stack_of
from wideserve.parallel.groups import DPGroup, DPGroupError, init_dp_group
from wideserve.worker.model_loader import load_model
from wideserve.worker.model_runner import StepRequest

DUMMY_REQUEST_ID = "__dp_dummy__"
# Request ids a rank remembers (received; final output emitted) for a front end's stall
# report, so a request lost on the way in is told from one whose final output was lost on
# the way out (serving/dp_offline.py).
HISTORY = 4096


@dataclass
class DPStepStats:
    rank: int = 0
    world_size: int = 1
    lockstep: bool = False
    dummy_steps: int = 0
    idle_syncs: int = 0
    max_reqs_last: int = 0                # the busiest rank's requests at the last step
    sync_method: str = ""
    sync_calibration_us: dict[str, float] | None = None
    sync_count: int = 0
    sync_s: float = 0.0
    sync_last_s: float = 0.0
    a2a_s: float = 0.0
    expert_s: float = 0.0
    ep_calls: int = 0
    ep_drain_calls: int = 0
    num_local_experts: int = 0            # the widest stack's
    num_local_experts_by_stack: dict[str, int] | None = None


class DPEngineCore(EngineCore):
    """EngineCore plus the group, the EP dispatcher and the lock-step `dp_step`."""

    # Class-level defaults: `shutdown` runs on a rank whose start failed part way.
    dispatcher: EPDispatcher | None = None
    sync: TimedStepSync | None = None
    eplb: EplbManager | None = None
    warm_up_at_start = False    # its forward needs the group and dispatcher, set up after

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        parallel.check()
        # Each rank on its own device (devices.py): not --device as given, which would put
        # every rank of a node on cuda:0.
        device = rank_device(parallel, config.load.device)
        bind_device(device)
        config = replace(config, load=replace(config.load, device=device))
        if config.kv_transfer is not None:      # P/D: each rank loads its own requests' KV
            config = replace(config, kv_transfer=config.kv_transfer.for_dp_rank(
                parallel.data_parallel_rank))
        self.parallel = parallel
        self.group: DPGroup | None = None
        self.dispatcher: EPDispatcher | None = None
        self.sync: TimedStepSync | None = None
        self.group_busy = False
        self._received: deque[str] = deque(maxlen=HISTORY)
        self._ended: deque[str] = deque(maxlen=HISTORY)
        self.dp = DPStepStats(rank=parallel.data_parallel_rank,
                              world_size=parallel.data_parallel_size)
        loaded = None
        # A hung group is diagnosed from the ranks' stacks: `kill -USR1 <pid>` prints them.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        if parallel.enable_expert_parallel and parallel.enabled:
            self.group = init_dp_group(parallel, torch.device(device))
        try:
            if self.group is not None:
                redundant = config.eplb.num_redundant_experts if config.eplb else 0
                loaded = load_model(config.load, (parallel.data_parallel_size,
                                                  parallel.data_parallel_rank, redundant))
            super().__init__(config, loaded)     # installs the dispatcher (before capture)
            if self.group is not None:
                self.sync = TimedStepSync(*choose_step_sync(self.group,
                                                            parallel.dp_sync_method))
                self.dp.lockstep = True
                self.dp.sync_method = self.sync.stats.method
                self.dp.sync_calibration_us = dict(self.sync.stats.calibration_us) or None
        except BaseException:
            self.shutdown()          # a failed start leaves no group behind either
            raise

    @property
    def lockstep(self) -> bool:
        return self.group is not None

    @property
    def loop_class(self) -> type[EngineLoop]:
        """The engine-proc loop for this rank (run_engine_process asks)."""
        return LockstepLoop if self.lockstep else EngineLoop

    def _ep_group(self) -> EpGroup:
        if self.group is None:
            return EpGroup()
        nodes = self.parallel.data_parallel_size // self.parallel.local_size
        return EpGroup(self.group.rank, self.group.world_size, self.group.device_group, nodes)

    def _enable_decode_capture(self) -> None:
        """The dispatcher first: a captured decode graph records its EP exchange."""
        if self.group is not None:
            self._install_dispatcher()
        super()._enable_decode_capture()

    def _install_dispatcher(self) -> None:
        assert self.group is not None
        layers = routed_experts(self.model)
        if not layers:
            raise ValueError("--enable-expert-parallel: the model has no routed experts")
        # Each MoE stack (the target's layers, a DSpark / MTP draft's) is sharded on its own
        # terms (worker/expert_shard.py): one dispatcher serves them all, its count header
        # as wide as the stack with the most experts per rank (layers/ep_dispatch.py).
        per_rank = max(m.num_local_experts for _, m in layers)
        # Steps of at most max_num_seqs tokens per rank (decode) exchange fixed-capacity
        # buffers, padded to a decode capture size, with no host read and the step header
        # exchanged by the runner before the forward (layers/ep_dispatch.py); not with
        # drafts, whose MoE calls differ between ranks.
        seqs = self.scheduler_config.max_num_seqs
        # Module order puts the target's layers first (expert_shard.routed_experts); without
        # speculation a forward calls exactly those.
        target = [m for name, m in layers if stack_of(name) == "target"]
        assert [m for _, m in layers[:len(target)]] == target, "target MoE layers come first"
        padded = None if self.spec is not None else PaddedSteps(
            capture_sizes(seqs, max_size=seqs), int(self.model.config.num_experts_per_tok),
            max(m.hidden for _, m in layers), self.loaded.dtype, num_layers=len(target))
        self.dispatcher = make_dispatcher(
            self.parallel.ep_dispatcher, self.group.device_group, self.group.rank,
            self.group.world_size, per_rank, self.device, control_group=self.group.cpu_group,
            padded=padded)
        for _, experts in layers:
            self.dispatcher.register(experts)
        if self.dispatcher.capturable:
            self.runner.step_sync = self.dispatcher
        self.dp.num_local_experts = per_rank
        self.dp.num_local_experts_by_stack = {
            stack: layers_of[0].num_local_experts
            for stack, layers_of in moe_stacks(self.model).items() if layers_of}

    # ------------------------------------------------------------------------- step
    def dp_step(self, stop: bool) -> list[EngineCoreOutput] | None:
        """One lock-step iteration; None once the ranks agreed to stop."""
        assert self.sync is not None
        local = self.has_unfinished_requests()
        rows = self.sync.exchange(local, self._num_requests(), stop)
        if rows[:, STOP].any():
            return None
        self.group_busy = bool(rows[:, HAS_WORK].any())
        if not self.group_busy:
            self.dp.idle_syncs += 1
            return []
        self.dp.max_reqs_last = int(rows[:, NUM_REQS].max())
        outputs = self.step() if local else self._dummy_step()
        self._ended.extend([o.request_id for o in outputs if o.finish_reason is not None])
        assert self.dispatcher is not None
        self.dispatcher.finish_step()
        if self.eplb is not None:
            # Every rank, same step, after all MoE calls: the counters agree, and the
            # rebalance's collectives never interleave with a peer's dispatch.
            self.eplb.step(dummy=not local)
        return outputs

    def _fail_step(self, sched_out: SchedulerOutput, error: Exception
                   ) -> list[EngineCoreOutput]:
        """A failed collective is the group's failure, never one step's: re-raise (the rank
        exits and reports it). Any other failure fails this rank's requests as usual, and
        finish_step() still pairs the MoE calls the failed forward did not make."""
        if isinstance(error, DPGroupError):
            raise error
        return super()._fail_step(sched_out, error)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._received.append(req.request_id)
        try:
            super().add_request(req)
        except DuplicateRequestError:
            raise                       # logged by the loop; no answer is sent for it
        except ValueError:
            self._ended.append(req.request_id)      # the loop answers it with the error
            raise

    def request_history(self) -> dict[str, list[str]]:
        """The ids of the last HISTORY requests this rank received and of those it emitted a
        final output for (or refused), oldest first: a stall report's evidence."""
        return {"received": list(self._received), "ended": list(self._ended)}

    def _num_requests(self) -> int:
        """This rank's running + waiting requests: every rank sees every rank's load."""
        return self.scheduler.num_running + self.scheduler.num_waiting

    def _dummy_step(self) -> list[EngineCoreOutput]:
        """One token at position 0 through the whole model, writing only the null block."""
        self.dp.dummy_steps += 1
        null_tables = [[0] for _ in self.kv_config.groups]
        self.runner.forward([StepRequest(DUMMY_REQUEST_ID, [0], 0, null_tables, sample=False,
                                         is_new=True)])
        self.runner.drop([DUMMY_REQUEST_ID])        # its block-table row is not kept
        return []

    def shutdown(self) -> None:
        """Leave the DP group when this rank stops: the step sync's side-channel sockets
        closed, every process group destroyed and the rendezvous store let go (rank 0: its
        server and port), so a later engine in this process, or on these ports, starts
        from nothing of ours. Idempotent; called by LockstepLoop.close on every exit path
        (the agreed stop, an error) and by a start that failed after joining the group."""
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        # Everything that refers to the process groups lets go of them first: a group
        # object keeps the store, and rank 0's store its port, alive.
        if self.dispatcher is not None:
            self.dispatcher.close()
        if self.eplb is not None:
            self.eplb.close()
        if self.group is not None:
            self.group.destroy()
            self.group = None

    # ------------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        stats = super().get_stats()
        dp = self.dp
        if self.sync is not None:
            s = self.sync.stats
            dp.sync_count, dp.sync_s, dp.sync_last_s = s.count, s.total_s, s.last_s
        if self.dispatcher is not None:
            e = self.dispatcher.stats
            dp.a2a_s, dp.expert_s = e.a2a_s, e.expert_s
            dp.ep_calls, dp.ep_drain_calls = e.calls, e.drain_calls
        stats.dp = asdict(dp)
        return stats


class LockstepLoop(EngineLoop):
    """The engine-proc busy loop for a lock-step rank: every iteration meets the peers, even
    idle (then after polling input for dp_idle_poll_ms), so a request arriving at any rank
    starts a step on all of them. Stopping (Shutdown, orphaned) is agreed, never unilateral:
    a rank that left alone would leave its peers blocked in a collective."""

    engine: DPEngineCore

    def run(self) -> None:
        idle_ms = self.engine.parallel.dp_idle_poll_ms
        # SIGTERM asks for the agreed stop at the next sync (the headless launcher's stop);
        # a rank stuck in a collective is then SIGKILLed by whoever sent it.
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        while True:
            busy = self.engine.has_unfinished_requests() or self.engine.group_busy
            self._take_input(timeout_ms=0 if busy else idle_ms)
            start = time.perf_counter()
            outputs = self.engine.dp_step(stop=not self.running)
            if outputs is None:
                self.engine.shutdown()      # every rank left the loop: none is in a collective
                return
            if self.engine.group_busy:
                self.step_times.append(time.perf_counter() - start)
                self.stats_dirty = True
            self.emit(outputs)
            self.check_parent()

    def close(self) -> None:
        """The group, then the sockets (run_engine_process calls this on every exit path)."""
        try:
            self.engine.shutdown()
        finally:
            super().close()
