"""The front end's handle on the engine-core process (asyncio + ZMQ).

Owns the child process and both sockets. Outputs are handed to `on_outputs` (the front end's
output processing) on the event loop; liveness is watched two ways: the child's exit status
(polled) and the heartbeat that every Outputs message carries. Once the engine is dead every
call raises EngineDeadError and `on_dead` has been told, so no caller waits forever.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from wideserve.config import EngineConfig
from wideserve.engine import engine_ipc as ipc
from wideserve.engine.engine_proc import DEFAULT_ENGINE
from wideserve.utils.procs import child_env

OutputsHandler = Callable[[list[Any]], None]
DeadHandler = Callable[[str], None]
logger = logging.getLogger(__name__)
WATCH_S = 0.2                               # the watchdog's period
DRAIN_BATCH = 64                            # engine messages routed per event-loop turn
# The `serve` defaults of --engine-heartbeat-timeout / --engine-stall-timeout.
HEARTBEAT_TIMEOUT_S = 10.0
STALL_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; requests cannot be served."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed to load or to report ready."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, *, engine_path: str = DEFAULT_ENGINE,
                 heartbeat_s: float = 1.0, stale_after_s: float = HEARTBEAT_TIMEOUT_S,
                 stall_timeout_s: float = STALL_TIMEOUT_S, env: dict[str, str] | None = None,
                 addresses: tuple[str, str] | None = None, spawn: bool = True) -> None:
        """`addresses` (input, output) to bind instead of private ipc sockets; with
        spawn=False the engine is started elsewhere (a data-parallel rank on another node,
        wideserve/distributed) and connects to them; its liveness is then its heartbeat.

        Heartbeat (docs/reliability.md, "A hung engine"): silent for `stale_after_s`, the
        engine is unhealthy (health() fails, new requests are refused) but may recover (a long
        step); silent for `stall_timeout_s` (at least stale_after_s) it is declared dead:
        open streams get the error and a process of ours is killed."""
        if not 0 < heartbeat_s < stale_after_s:
            raise ValueError(f"the engine heartbeat timeout ({stale_after_s} s) must exceed "
                             f"the heartbeat interval ({heartbeat_s} s)")
        self.config = config
        self.engine_path = engine_path
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.stall_timeout_s = max(stall_timeout_s, stale_after_s)
        self.env = env
        self.on_outputs: OutputsHandler = lambda outputs: None
        self.on_dead: DeadHandler = lambda reason: None
        self.on_step_times: Callable[[list[float]], None] = lambda seconds: None
        self.model_info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.last_heard = 0.0
        self._silence = 0.0                 # maintained by the watchdog (_observe)
        self.proc: subprocess.Popen[bytes] | None = None
        self._ctx = zmq.asyncio.Context()
        self._tmpdir = tempfile.mkdtemp(prefix="wideserve-")
        self._in_addr, self._out_addr = addresses or (f"ipc://{self._tmpdir}/input",
                                                      f"ipc://{self._tmpdir}/output")
        self._spawn_engine = spawn
        self._in_sock = self._ctx.socket(zmq.PUSH)
        self._out_sock = self._ctx.socket(zmq.PULL)
        self._encoder = ipc.make_encoder()
        self._decoder = ipc.make_output_decoder()
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        # Set when the output socket's FD is readable (and by the watchdog's tick, so a
        # socket that failed without a wake-up is still noticed: the next recv raises).
        self._output_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout_s: float = 900.0) -> dict[str, Any]:
        """Spawn the engine and wait for Ready (model loaded, KV cache allocated)."""
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._out_sock.setsockopt(zmq.RCVHWM, 0)
        self._in_sock.bind(self._in_addr)
        self._out_sock.bind(self._out_addr)
        self.proc = self._spawn() if self._spawn_engine else None
        deadline = time.monotonic() + timeout_s
        while True:
            exited = self.proc is not None and self.proc.poll() is not None
            # After an exit, still read what it sent: EngineDead says why it failed.
            if not await self._out_sock.poll(200):
                if exited:
                    raise EngineStartupError(self._exit_message("failed to start"))
                if time.monotonic() > deadline:
                    self._kill()
                    raise EngineStartupError(f"engine core not ready after {timeout_s:.0f} s")
                continue
            msg = self._decoder.decode(await self._out_sock.recv())
            if isinstance(msg, ipc.EngineDead):
                self._wait_exit(10.0)
                raise EngineStartupError(f"engine core failed to start: {msg.reason}")
            if isinstance(msg, ipc.Ready):
                self.model_info = dict(msg.model_info)
                break
        self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-output"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        return self.model_info

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "wideserve.engine.engine_proc",
               "--config-json", msgspec.json.encode(self.config).decode(),
               "--input-addr", self._in_addr, "--output-addr", self._out_addr,
               "--parent-pid", str(os.getpid()), "--engine", self.engine_path,
               "--heartbeat-s", str(self.heartbeat_s)]
        # child_env: the engine dies with us, even SIGKILLed (wideserve/utils/procs.py).
        return subprocess.Popen(cmd, env=child_env(self.env), stdin=subprocess.DEVNULL)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to stop, then make sure it did; idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self.proc is None and self.dead_reason is None and self.last_heard:
            try:                                     # a remote engine: ask, cannot wait
                await self._in_sock.send(self._encoder.encode(ipc.Shutdown()), zmq.NOBLOCK)
                await asyncio.sleep(0.1)
            except zmq.ZMQError:
                pass
        if self.proc is not None and self.proc.poll() is None and \
                self._silent_for() > self.stale_after_s:
            # Silent past the heartbeat timeout (hung, SIGSTOPped, or a data-parallel rank
            # blocked on a hung peer): it will not read a Shutdown; SIGKILL ends even a
            # stopped process, instead of after the 15 s of asking and SIGTERM below.
            self._kill()
        if self.proc is not None and self.proc.poll() is None:
            try:
                await self._in_sock.send(self._encoder.encode(ipc.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self._wait_exit, timeout_s)
        self._fail_pending("engine core shut down")
        self._in_sock.close(linger=0)
        self._out_sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _wait_exit(self, timeout_s: float) -> None:
        assert self.proc is not None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._kill()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    # ------------------------------------------------------------------ liveness

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and not self._closed

    def health(self) -> tuple[bool, str]:
        """(ok, why not): dead, shut down, or silent past the heartbeat timeout."""
        if self.dead_reason is not None:
            return False, self.dead_reason
        if self._closed:
            return False, "engine core shut down"
        silent = self._silent_for()
        if silent > self.stale_after_s:
            return False, f"engine core silent for {silent:.0f} s (no heartbeat: busy, hung " \
                f"or stopped)"
        return True, "ok"

    def _silent_for(self) -> float:
        """Seconds the engine has been silent, as the watchdog observed it (_observe)."""
        return self._silence

    def _observe(self, elapsed: float) -> None:
        """One watchdog tick, `elapsed` seconds after the previous one. Silence grows by at
        most WATCH_S * 5 per tick: if our own event loop was blocked (a long tokenisation),
        messages the engine sent meanwhile are still unread, and that time is not the
        engine's silence. (Peeking at the socket instead would steal the edge-triggered
        wake-up the asyncio socket relies on.)"""
        now = time.monotonic()
        since = now - self.last_heard
        self._silence = since if since <= elapsed else \
            self._silence + min(elapsed, WATCH_S * 5)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._fail_pending(reason)
        self.on_dead(reason)

    def _fail_pending(self, reason: str) -> None:
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._pending_calls.clear()

    def _exit_message(self, what: str) -> str:
        assert self.proc is not None
        code = self.proc.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"engine core process {what} ({how})"

    async def _watchdog(self) -> None:
        tick = time.monotonic()
        while self.dead_reason is None:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            self._observe(now - tick)
            tick = now
            self._output_wake.set()
            if self.proc is not None and self.proc.poll() is not None:
                # Let a last EngineDead message (with the real reason) win the race.
                await asyncio.sleep(0.2)
                self._mark_dead(self._exit_message("exited"))
                continue
            silent = self._silent_for()
            if silent > self.stall_timeout_s:
                self._stalled(silent)

    def _stalled(self, silent: float) -> None:
        """No heartbeat for stall_timeout_s: hung (or SIGSTOPped). Declared dead so every
        open stream gets an error now; a process of ours is killed (SIGKILL also ends a
        stopped one) so it cannot wake later and compute for nobody."""
        ours = self.proc is not None
        self._mark_dead(f"engine core unresponsive: no heartbeat for {silent:.0f} s"
                        + (" (killed)" if ours else ""))
        if ours:
            self._kill()

    # ------------------------------------------------------------------ traffic

    async def _output_loop(self) -> None:
        """Route the engine's messages as they arrive (docs/host_path.md, "The serving
        path per token"). The socket is read without pyzmq's asyncio futures, which cost a
        Future, a reader (re)registration and a chain of callbacks per message (routing
        alone: ~18 -> ~5 us of CPU per message when messages queue,
        benchmarks/vs_vllm/output_routing.py): its FD is watched once, and each wake-up
        drains every queued message with non-blocking recvs.
        ZMQ's FD only says "something may have changed", and a recv can make several
        messages ready at once, so the loop waits for the FD only after a recv said Again."""
        loop = asyncio.get_running_loop()
        sock = zmq.Socket.shadow(self._out_sock.underlying)
        fd = sock.getsockopt(zmq.FD)
        wake = self._output_wake
        loop.add_reader(fd, wake.set)
        try:
            while True:
                if self._drain(sock) < DRAIN_BATCH:
                    await wake.wait()
                    wake.clear()
                else:
                    # More may be queued: let the HTTP handlers (and aborts) run first, or a
                    # busy engine would starve every other task of the loop.
                    await asyncio.sleep(0)
        finally:
            try:
                loop.remove_reader(fd)
            except (OSError, ValueError):   # the socket (and its FD) was closed first
                pass

    def _drain(self, sock: zmq.Socket) -> int:
        """Handle up to DRAIN_BATCH queued messages; returns how many there were."""
        for n in range(DRAIN_BATCH):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self.last_heard = time.monotonic()
            try:
                self._handle_output(data)
            except Exception:  # noqa: BLE001 - one bad message must not stop every stream
                logger.exception("engine output message could not be handled; routing goes on")
        return DRAIN_BATCH

    def _handle_output(self, data: bytes) -> None:
        msg = self._decoder.decode(data)
        if isinstance(msg, ipc.Outputs):
            if msg.stats is not None:
                self.stats = msg.stats
            if msg.step_times:
                self.on_step_times(msg.step_times)
            if msg.outputs:
                self.on_outputs(ipc.restore_outputs(msg.outputs))
        elif isinstance(msg, ipc.UtilityResult):
            fut = self._pending_calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(RuntimeError(msg.error))
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, ipc.EngineDead):
            self._mark_dead(f"engine core died: {msg.reason}")

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        """The output loop and the watchdog only end by cancellation; anything else means
        nobody is routing outputs or watching the engine: say so now, not at a timeout."""
        if task.cancelled() or self._closed or self.dead_reason is not None:
            return
        error = task.exception()
        why = f"{type(error).__name__}: {error}" if error is not None else "it returned"
        logger.error("engine client task %s ended (%s)", task.get_name(), why)
        self._mark_dead(f"engine client {task.get_name()} failed ({why})")

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineDeadError("engine core shut down")

    async def _send(self, msg: Any) -> None:
        data = self._encoder.encode(msg)
        while True:
            self._check_alive()
            try:
                # Never a blocking send: with the engine gone a PUSH socket has no peer and
                # would wait forever; Again while alive only means "not connected yet".
                await self._in_sock.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                await asyncio.sleep(0.02)

    async def add_requests(self, requests: list[Any], pending: int = -1) -> None:
        """`pending`: generation requests the front end still holds behind these (the
        engine's "Arrivals after idle"); -1 when it does not count them."""
        await self._send(ipc.AddRequests(requests=[ipc.to_wire(r) for r in requests],
                                         pending=pending))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive:
            await self._send(ipc.AbortRequests(request_ids=request_ids))

    async def call_utility(self, method: str, timeout_s: float = 60.0) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        await self._send(ipc.UtilityCall(call_id=call_id, method=method))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._pending_calls.pop(call_id, None)
