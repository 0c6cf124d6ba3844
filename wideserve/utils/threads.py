"""How many torch threads an engine runs, and on which cores (docs/cpu_kernels.md, "Threads").

On the CPU every GEMM, attention and MoE op runs on torch's OpenMP pool. Left alone, an
engine process spawned by `wideserve serve` runs one OpenMP thread per core while the API
server, its tokenizer workers and the engine's own Python thread want the same cores; the
OpenMP threads spin at every barrier waiting for a thread that was descheduled, and a step
takes 10-40x longer than with one thread (measured on 2 cores, BENCHMARKS.md). The plan:

- the cores are those this process may run on (`os.sched_getaffinity`, so `taskset` and
  container CPU sets are honoured), one logical CPU per physical core (SMT siblings share
  a core's matrix and vector units, which a GEMM already fills);
- an engine with a front end in another process (serve, data-parallel ranks) leaves one core
  to it when there are more cores than ranks (a single automatic engine borrows it while the
  front end idles: `upto` below);
- the rest is split into contiguous, disjoint slices, one per local data-parallel rank; each
  rank runs one torch thread per core of its slice and is bound to it;
- `--threads N` / `LLM(threads=N)`, else `OMP_NUM_THREADS`, fixes the count; a single
  engine is then left unbound (several servers on one machine, each with its count, share the
  cores as the OS schedules them; `taskset` gives each its own CPUs, which the plan honours),
  data-parallel ranks get N-core slices where there are enough cores, unbound where not.

The in-process engine of `LLM()` is the caller's own process: it is never bound, and the
automatic count (one core fewer than the process may use, as for a served engine) only lowers
torch's thread count, never raises one the caller set. An OpenMP team as wide as the machine
collapses as soon as anything else runs on it (offline on 2 cores beside other work: 2 threads
7-16 tok/s against 420-800 for 1 thread, benchmarks/threads_default.py), while one thread
fewer costs up to 1/N on an idle machine (2 idle cores: 2 threads ~1.27x of 1 on a Zen 4,
1.4-1.8x on a Zen 5). So the plan's `upto` is the full count (never above the caller's),
and `LLM()` lends the spare core to its engine while no other process uses it
(utils/thread_governor.py). A single served engine with an automatic plan borrows the core
kept for its front end the same way, bound to it while lent: when the front end works (at
every request, every streamed token), the reading says so within a window.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

THREADS_ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    threads: int                   # torch intra-op threads
    cpus: tuple[int, ...]          # the CPUs the process is bound to; () = left unbound
    source: str                    # "--threads", "OMP_NUM_THREADS" or "auto"
    note: str = ""                 # why these cores, for the log line
    spare: tuple[int, ...] = ()    # bound plans: the usable cores left to other work
    upto: int = 0                  # an automatic single engine's plan: the count it may run
                                   # while the spare cores idle (utils/thread_governor.py)

    def describe(self) -> str:
        where = f"bound to CPU {_ranges(self.cpus)}" if self.cpus else "not bound"
        lent = f" ({self.upto} while no other process uses the spare core)" \
            if self.upto > self.threads else ""
        return (f"{self.threads} torch thread{'s' * (self.threads != 1)}{lent}, {where} "
                f"({self.source}{'; ' + self.note if self.note else ''})")

    def set_count(self, threads: int) -> None:
        """Run `threads` torch threads (the plan's count, or more on lent cores, up to
        `upto`); a bound plan is bound to its own CPUs plus as many spare ones as the extra
        threads (utils/thread_governor.py)."""
        import torch
        if self.cpus:
            bind_process(self.cpus + self.spare[:max(0, threads - self.threads)])
        torch.set_num_threads(threads)

    def watched_cpus(self) -> tuple[int, ...]:
        """The CPUs whose load decides a loan: a bound plan's own and spare ones, else those
        the process may use."""
        return tuple(sorted(self.cpus + self.spare)) if self.cpus else \
            tuple(sorted(os.sched_getaffinity(0)))

    def apply(self) -> None:
        """Bind every thread of this process to `cpus` (threads created later inherit it),
        then size torch's pool."""
        import torch
        global _applied
        if self.cpus:
            bind_process(self.cpus)
        torch.set_num_threads(self.threads)
        _applied = self


# The plan this process last applied (what it did, as torch.get_num_threads() tells its
# count): the engine reads the cores it left free from it (worker/weight_streaming.py).
_applied: ThreadPlan | None = None


def applied_plan() -> ThreadPlan | None:
    return _applied


def bind_process(cpus: Sequence[int]) -> None:
    # os.sched_setaffinity(0, ...) moves only the calling thread; the threads already running
    # (zmq's I/O thread, an OpenMP pool started by an import) are moved one by one.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass                                    # a thread that just ended


def physical_cores(cpus: Sequence[int],
                   core_id: Callable[[int], tuple[int, int]] | None = None) -> list[int]:
    """One CPU per physical core among `cpus` (the lowest-numbered sibling), in order."""
    core_id = core_id or _sysfs_core_id
    seen: dict[tuple[int, int], int] = {}
    for cpu in sorted(cpus):
        seen.setdefault(core_id(cpu), cpu)
    return sorted(seen.values())


def _sysfs_core_id(cpu: int) -> tuple[int, int]:
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (int((base / "physical_package_id").read_text()),
                int((base / "core_id").read_text()))
    except (OSError, ValueError):
        return (-1, cpu)                            # unknown topology: every CPU a core


def requested_threads(threads: int | None, env: Mapping[str, str]) -> tuple[int | None, str]:
    """The explicit count and where it came from: the flag / argument, else OMP_NUM_THREADS."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return threads, "--threads"
    value = env.get(THREADS_ENV, "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value), THREADS_ENV
    return None, "auto"


def plan_engine(threads: int | None = None, *, rank: int = 0, ranks: int = 1,
                front_end: bool = True, cpus: Sequence[int] | None = None,
                env: Mapping[str, str] | None = None,
                core_id: Callable[[int], tuple[int, int]] | None = None) -> ThreadPlan:
    """The plan of engine process `rank` of `ranks` on this node (see the module doc)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} outside [0, {ranks})")
    cores = physical_cores(cpus if cpus is not None else sorted(os.sched_getaffinity(0)),
                           core_id)
    count, source = requested_threads(threads, os.environ if env is None else env)
    if count is not None and ranks == 1:
        # A set count, one engine: unbound. Several servers on one machine (a P/D pair,
        # tests) would all be bound to the same cores and queue there; the OS spreads them.
        return ThreadPlan(count, (), source, "a set count is not bound")
    spare = 1 if front_end and len(cores) > ranks else 0
    per_rank = count or max(1, (len(cores) - spare) // ranks)
    reserve = 1 if front_end and len(cores) >= per_rank * ranks + 1 else 0
    if len(cores) < per_rank * ranks:
        if count is None:                           # more ranks than cores: share them
            cpu = cores[rank % len(cores)]
            return ThreadPlan(1, (cpu,), source, f"{ranks} ranks on {len(cores)} cores")
        return ThreadPlan(count, (), source,
                          f"{count * ranks} threads on {len(cores)} cores: oversubscribed")
    first = reserve + rank * per_rank
    note = f"{len(cores)} cores, {reserve} kept for the front end" if reserve else \
        f"{len(cores)} cores"
    own = tuple(cores[first:first + per_rank])
    spare_cores = tuple(c for c in cores[:reserve] + cores[per_rank * ranks + reserve:]
                        if c not in own)
    # One automatic engine may borrow the cores it leaves to the front end while they idle
    # (utils/thread_governor.py); data-parallel ranks keep their slices.
    upto = per_rank + len(spare_cores) if count is None and ranks == 1 and spare_cores else 0
    return ThreadPlan(per_rank, own, source,
                      note + (f", rank {rank} of {ranks}" if ranks > 1 else ""),
                      spare=spare_cores, upto=upto)


def plan_in_process(threads: int | None = None, *, current: int,
                    cpus: Sequence[int] | None = None, env: Mapping[str, str] | None = None,
                    core_id: Callable[[int], tuple[int, int]] | None = None) -> ThreadPlan:
    """The plan of `LLM()`'s in-process engine: the caller's process, never bound. `current`
    is torch's thread count now; the automatic count only lowers it."""
    count, source = requested_threads(threads, os.environ if env is None else env)
    if count is not None:
        return ThreadPlan(count, (), source)
    cores = physical_cores(cpus if cpus is not None else sorted(os.sched_getaffinity(0)),
                           core_id)
    auto = max(1, len(cores) - 1)
    threads = min(current, auto)
    return ThreadPlan(threads, (), source,
                      f"{len(cores)} cores, {len(cores) - auto} left to other work",
                      upto=max(threads, min(current, len(cores))))


def apply_engine_plan(threads: int | None, rank: int, ranks: int) -> ThreadPlan:
    """Plan and apply the threads of an engine process spawned by a front end (before the
    model loads: loading runs on them); `announce_engine_plan` logs it once the engine is up."""
    plan = plan_engine(threads, rank=rank, ranks=ranks)
    plan.apply()
    return plan


def announce_engine_plan(plan: ThreadPlan, rank: int, ranks: int) -> None:
    """One stderr line. Printed after the model loaded, so that an engine that fails to start
    leaves only its error (the front end's one-line error for a bad model path)."""
    print(f"[engine] rank {rank}: {plan.describe()}" if ranks > 1 else
          f"[engine] {plan.describe()}", file=sys.stderr, flush=True)


def _ranges(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].rsplit("-", 1)[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
