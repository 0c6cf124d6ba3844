"""The engine-core process: a busy loop around EngineCore, fed and drained over ZMQ.

    loop:  take input (block only when idle) -> step (schedule, execute, sample, update)
           -> emit outputs + stats -> check the parent is alive

Arrivals after idle. Clients that send together (a closed-loop benchmark whose requests all
finished in one step, a batch job) reach this socket a few ms apart: the front end parses
and submits them one at a time. An idle engine woken by the first would prefill it alone,
and the rest, queued behind that step, would wait for it and then for their own step: at
concurrency 16 on the 653M model that first step was ~15% of everyone's TTFT
(BENCHMARKS.md, "TTFT under load: arrivals after idle"). So an engine that wakes from idle
keeps taking input until none came for `arrival_gap_ms` (at most `arrival_wait_max_ms`), and
the burst is prefilled in one step. A busy engine never waits: new requests join its next
step as before. The front end says with each submission how many generation requests it
still holds behind it (serving/arrivals.py): with none behind a lone request (one client at
a time) the engine steps at once instead of waiting out a gap, and a burst's wait ends with
its last submission; a front end that does not count (-1) leaves the gap rule alone.

Started by `launch_engine_process` as `python -m wideserve.engine.engine_proc` (a fresh
interpreter: no fork of the front end's event loop, no pickle). The config travels as
msgspec JSON on the command line. The process exits when told to (Shutdown), on SIGTERM,
or when its parent disappears; SIGINT is ignored because a terminal's Ctrl-C reaches the
whole process group and the front end owns the orderly shutdown.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
import traceback
from typing import Any, Protocol

import msgspec
import zmq

from wideserve.config import EngineConfig
from wideserve.engine import engine_ipc as ipc
from wideserve.engine.errors import DuplicateRequestError
from wideserve.utils.procs import die_with_parent
from wideserve.engine.spare_core import lend_spare_cores
from wideserve.utils.thread_governor import ThreadGovernor, reading_now
from wideserve.utils.threads import ThreadPlan, announce_engine_plan, apply_engine_plan

DEFAULT_ENGINE = "wideserve.engine.engine_core:EngineCore"
STATS_INTERVAL_S = 0.05


class LoopEngine(Protocol):
    """What the loop drives: EngineCore, a data-parallel rank, or a test's fake engine
    (`--engine module:Class`). `loop_class`: the loop that drives it (EngineLoop; a
    data-parallel lock-step rank brings its own, wideserve/engine/dp_engine.py)."""

    model_info: Any
    loop_class: type[EngineLoop]

    def add_request(self, req: Any) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list: ...

    def get_stats(self) -> Any: ...


class EngineLoop:
    """Owns the sockets and the engine object; `run()` returns when the loop should end."""

    def __init__(self, engine: LoopEngine, input_addr: str, output_addr: str,
                 parent_pid: int | None, heartbeat_s: float = 1.0) -> None:
        self.engine = engine
        self.parent_pid = parent_pid
        self.heartbeat_s = heartbeat_s
        self.ctx = zmq.Context(io_threads=1)
        self.in_sock = self.ctx.socket(zmq.PULL)
        self.in_sock.setsockopt(zmq.RCVHWM, 0)
        self.in_sock.connect(input_addr)
        self.out_sock = self.ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 2000)
        self.out_sock.setsockopt(zmq.SNDHWM, 0)
        self.out_sock.connect(output_addr)
        self.encoder = ipc.make_encoder()
        self.decoder = ipc.make_input_decoder()
        self.running = True
        self.orphaned = False
        self.last_sent = 0.0
        self.last_stats = 0.0
        # Stats changed since the last ones sent (a step ran; or none sent yet): they go out
        # within STATS_INTERVAL_S even when the step had no outputs (a DP rank's dummy steps)
        # or the engine then went idle, so a scrape never waits a heartbeat for them.
        self.stats_dirty = True
        self.step_times: list[float] = []
        # "Arrivals after idle" (module docstring); off until set_arrival_window.
        self.arrival_gap_ms = 0.0
        self.arrival_wait_max_ms = 0.0
        # What the last AddRequests said the front end still holds (-1: not counted).
        self.front_pending = -1
        self.messages_in = 0        # messages taken off the input socket, ever
        # Lends the engine the front end's core while it idles (set by run_engine_process).
        self.governor: ThreadGovernor | None = None

    def set_arrival_window(self, gap_ms: float, max_ms: float) -> None:
        self.arrival_gap_ms, self.arrival_wait_max_ms = gap_ms, max_ms

    def close(self) -> None:
        self.in_sock.close(linger=0)
        # An orphan's queued messages have no reader: lingering on them would keep a dying
        # engine (and its KV-transfer side channel) up for seconds after its server died.
        self.out_sock.close(linger=0 if self.orphaned else None)
        self.ctx.term()

    def send(self, msg: Any) -> None:
        self.out_sock.send(self.encoder.encode(msg), copy=False)
        self.last_sent = time.monotonic()

    def send_ready(self) -> None:
        info = ipc.to_builtins(self.engine.model_info)
        self.send(ipc.Ready(model_info=info, pid=os.getpid()))

    def run(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished_requests()
            idle = not busy or not self._has_live_requests()
            before = self.messages_in
            self._take_input(timeout_ms=0 if busy else self.idle_wait_ms())
            if idle and self._has_live_requests():
                self._take_arrivals(self.messages_in - before)
            if not self.running:
                break
            outputs = []
            if self.engine.has_unfinished_requests():
                if self.governor is not None:
                    self.governor.tick()
                start = time.perf_counter()
                outputs = self.engine.step()
                self.step_times.append(time.perf_counter() - start)
                self.stats_dirty = True
            self.emit(outputs)
            self.check_parent()

    def idle_wait_ms(self) -> int:
        """How long an idle loop blocks on input: a heartbeat, or less while changed stats
        are still to be sent."""
        wait_s = STATS_INTERVAL_S if self.stats_dirty else self.heartbeat_s
        return max(1, int(wait_s * 1000))

    def emit(self, outputs: list[Any]) -> None:
        """Send the step's outputs, or a heartbeat when nothing was sent for heartbeat_s, or
        stats that changed and were not sent for STATS_INTERVAL_S."""
        now = time.monotonic()
        # Stats at most every STATS_INTERVAL_S while busy: a scrape never needs
        # fresher numbers, and get_stats() stays off the per-step path.
        fresh = now - self.last_stats >= STATS_INTERVAL_S
        if outputs or now - self.last_sent >= self.heartbeat_s or (fresh and self.stats_dirty):
            self.send(ipc.Outputs(outputs=outputs, stats=self._stats() if fresh else None,
                                  timestamp=now, step_times=self.step_times))
            self.step_times = []
            if fresh:
                self.last_stats = now
                self.stats_dirty = False

    def check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.orphaned = True                 # nobody will read our output
            self.running = False

    def _stats(self) -> dict[str, Any] | None:
        stats = ipc.to_builtins(self.engine.get_stats())
        if self.governor is not None and isinstance(stats, dict):
            # the lent core, observable (serving/openai/server_metrics.py)
            stats["torch_threads"] = self.governor.threads
            stats["thread_switches"] = self.governor.switches
        return stats

    def _take_input(self, timeout_ms: int) -> None:
        """Handle every queued message; wait up to timeout_ms for the first one."""
        if timeout_ms > 0 and not self.in_sock.poll(timeout_ms):
            return
        # EVENTS before each recv: a busy engine asks every step, and most steps nothing
        # came, which a bare NOBLOCK recv answers by raising (and building) zmq.Again.
        while self.running and self.in_sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._handle(self.in_sock.recv(zmq.NOBLOCK, copy=False).bytes)
            self.messages_in += 1

    def _has_live_requests(self) -> bool:
        """Requests running or waiting; unlike has_unfinished_requests, not the one
        bookkeeping step owed after the last request finished (an engine that owes only that
        is idle for "Arrivals after idle"). Engines without the method: the same thing."""
        live = getattr(self.engine, "has_live_requests", None)
        return bool(live()) if live is not None else self.engine.has_unfinished_requests()

    def _take_arrivals(self, woke_with: int) -> None:
        """Woken from idle by `woke_with` messages: take the requests that follow within the
        gap, up to the cap, so that they share the prefill step ("Arrivals after idle"); not
        at all, or no longer, once the front end says it holds none behind them."""
        if self.arrival_gap_ms <= 0 or self.arrival_wait_max_ms <= 0:
            return
        if self.front_pending == 0 and woke_with <= 1:
            return                          # a lone request, nobody behind it
        deadline = time.monotonic() + self.arrival_wait_max_ms / 1000
        while self.running and self.front_pending != 0:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                return
            # zmq's poll takes whole ms; a sub-ms remainder still waits one.
            if not self.in_sock.poll(max(1, round(min(self.arrival_gap_ms, left_ms)))):
                return
            self._take_input(timeout_ms=0)

    def _handle(self, data: bytes) -> None:
        try:
            msg = self.decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            # A front-end bug, not a reason to die. Requests inside an AddRequests frame are
            # decoded one by one (ipc.decode_requests) and answered by id; a frame that fails
            # here names no request to answer, so say loudly what was dropped.
            print(f"[engine] dropped an undecodable message ({e}): {len(data)} bytes "
                  f"starting {data[:200]!r}", file=sys.stderr, flush=True)
            return
        if ipc.is_add_requests(msg):
            self.front_pending = msg.pending
            requests, invalid = ipc.decode_requests(msg)
            self._add_requests(requests, invalid)
        elif isinstance(msg, ipc.AbortRequests):
            self.engine.abort_requests(list(msg.request_ids))
        elif isinstance(msg, ipc.UtilityCall):
            self.send(self._utility(msg))
        elif isinstance(msg, ipc.Shutdown):
            self.running = False

    def _add_requests(self, requests: list[Any], invalid: list[tuple[str, str]]) -> None:
        rejected = [_rejection(rid, why) for rid, why in invalid]
        for req in requests:
            try:
                self.engine.add_request(req)
            except DuplicateRequestError as e:
                # An answer under this id would end the live request's stream: log only.
                print(f"[engine] refused request: {e}", file=sys.stderr, flush=True)
            except ValueError as e:
                rejected.append(_rejection(req.request_id, str(e)))
        if rejected:
            self.send(ipc.Outputs(outputs=rejected, stats=None, timestamp=time.monotonic()))

    def _utility(self, call: ipc.UtilityCall) -> ipc.UtilityResult:
        if call.method not in ipc.UTILITY_METHODS:
            return ipc.UtilityResult(call.call_id, error=f"unknown method {call.method!r}")
        try:
            attr = getattr(self.engine, call.method)
            result = attr() if callable(attr) else attr
            return ipc.UtilityResult(call.call_id, result=ipc.to_builtins(result))
        except Exception as e:  # noqa: BLE001 - reported to the caller, loop goes on
            return ipc.UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")


def _rejection(request_id: str, message: str) -> Any:
    from wideserve.types.sched_output import EngineCoreOutput
    return EngineCoreOutput(request_id=request_id, finish_reason="error", error=message)


def _load_engine(config: EngineConfig, engine_path: str) -> LoopEngine:
    module_name, _, attr = engine_path.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    return cls(config)


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str,
                       parent_pid: int | None, engine_path: str = DEFAULT_ENGINE,
                       heartbeat_s: float = 1.0) -> int:
    """Build the engine, announce Ready, serve until told to stop. Returns an exit code.

    A crash (at load or in a step) is reported as EngineDead with the traceback's last line
    before exiting non-zero, so the front end can say why instead of just "it died"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    loop: EngineLoop | None = None
    try:
        plan = _set_torch_threads(config)
        since = reading_now(plan.watched_cpus())
        engine = _load_engine(config, engine_path)
        announce_engine_plan(plan, *_local_rank(config))
        # A data-parallel lock-step rank brings its own loop (wideserve/distributed).
        loop = engine.loop_class(engine, input_addr, output_addr, parent_pid, heartbeat_s)
        # The front end's core lent while it idles (utils/thread_governor.py).
        loop.governor = lend_spare_cores(plan, engine, since)
        loop.set_arrival_window(config.scheduler.arrival_gap_ms,
                                config.scheduler.arrival_wait_max_ms)
        loop.send_ready()
        loop.run()
        return 0
    except SystemExit:
        return 0
    except BaseException as e:  # noqa: BLE001 - report any crash, then exit non-zero
        # A bad model path or config at load time is the user's to fix and the front end
        # prints it in one line; anything else (or any crash once serving) gets a traceback.
        if loop is not None or not isinstance(e, (OSError, ValueError)):
            traceback.print_exc()
        _report_death(loop, output_addr, f"{type(e).__name__}: {e}")
        return 1
    finally:
        if loop is not None:
            loop.close()


def _report_death(loop: EngineLoop | None, output_addr: str, reason: str) -> None:
    try:
        if loop is not None:
            loop.send(ipc.EngineDead(reason=reason))
            return
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(output_addr)
        sock.send(ipc.make_encoder().encode(ipc.EngineDead(reason=reason)))
        sock.close()
        ctx.term()                  # waits (up to the linger) until the message is out
    except zmq.ZMQError:
        pass


def _local_rank(config: EngineConfig) -> tuple[int, int]:
    """(this rank's index among the node's ranks, the node's ranks)."""
    parallel = config.parallel
    return parallel.data_parallel_rank - parallel.data_parallel_start_rank, parallel.local_size


def _set_torch_threads(config: EngineConfig) -> ThreadPlan:
    return apply_engine_plan(config.parallel.threads, *_local_rank(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wideserve-engine-core")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--input-addr", required=True)
    parser.add_argument("--output-addr", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--engine", default=DEFAULT_ENGINE)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        # Before the config or the model: a parent that was SIGKILLed meanwhile or later
        # leaves no engine behind (the loop's own check_parent needs a running loop).
        die_with_parent(args.parent_pid)
    config = msgspec.json.decode(args.config_json, type=EngineConfig)
    return run_engine_process(config, args.input_addr, args.output_addr, args.parent_pid,
                              args.engine, args.heartbeat_s)


if __name__ == "__main__":
    code = main()
    # Sockets are closed and nothing else holds state worth flushing: skip the interpreter's
    # teardown (seconds with torch loaded) so a shutdown is not held up by it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
