"""The thread plan: how many torch threads an engine runs and which cores it is bound to."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from wideserve.utils.threads import ThreadPlan, physical_cores, plan_engine, plan_in_process

NO_ENV: dict[str, str] = {}


def test_served_engine_leaves_a_core_to_the_front_end() -> None:
    plan = plan_engine(cpus=[0, 1], env=NO_ENV)
    assert (plan.threads, plan.cpus, plan.source) == (1, (1,), "auto")
    plan = plan_engine(cpus=range(8), env=NO_ENV)
    assert (plan.threads, plan.cpus) == (7, tuple(range(1, 8)))


def test_only_a_single_automatic_engine_may_borrow_the_front_ends_core() -> None:
    plan = plan_engine(cpus=[0, 1], env=NO_ENV)
    assert (plan.spare, plan.upto, plan.watched_cpus()) == ((0,), 2, (0, 1))
    assert plan_engine(cpus=range(8), env=NO_ENV).upto == 8
    assert plan_engine(cpus=[3], env=NO_ENV).upto == 0                  # nothing kept
    assert plan_engine(2, cpus=range(8), env=NO_ENV).upto == 0          # a set count
    assert all(plan_engine(rank=r, ranks=2, cpus=range(8), env=NO_ENV).upto == 0
               for r in range(2))                                       # data parallel


def test_single_core_is_not_reserved() -> None:
    assert plan_engine(cpus=[3], env=NO_ENV).cpus == (3,)


def test_data_parallel_ranks_get_disjoint_cores() -> None:
    plans = [plan_engine(rank=r, ranks=2, cpus=[0, 1], env=NO_ENV) for r in range(2)]
    assert [p.cpus for p in plans] == [(0,), (1,)]          # 2 cores, 2 ranks: no reserve
    plans = [plan_engine(rank=r, ranks=2, cpus=range(8), env=NO_ENV) for r in range(2)]
    assert [p.cpus for p in plans] == [(1, 2, 3), (4, 5, 6)]
    assert all(p.threads == 3 for p in plans)
    shared = [plan_engine(rank=r, ranks=3, cpus=[0, 1], env=NO_ENV) for r in range(3)]
    assert [(p.threads, p.cpus) for p in shared] == [(1, (0,)), (1, (1,)), (1, (0,))]


def test_smt_siblings_count_as_one_core() -> None:
    def core_id(cpu: int) -> tuple[int, int]:             # CPUs 0-3 and 4-7 are siblings
        return (0, cpu % 4)
    assert physical_cores(range(8), core_id) == [0, 1, 2, 3]
    plan = plan_engine(cpus=range(8), env=NO_ENV, core_id=core_id)
    assert (plan.threads, plan.cpus) == (3, (1, 2, 3))


def test_flag_then_env_override_the_count() -> None:
    env = {"OMP_NUM_THREADS": "2"}
    assert plan_engine(cpus=range(4), env=env).threads == 2
    assert plan_engine(cpus=range(4), env=env).source == "OMP_NUM_THREADS"
    plan = plan_engine(3, cpus=range(4), env=env)
    # A set count leaves a single engine unbound: two servers on one machine, each with
    # --threads 1, must not both be bound to the one core the plan would leave them.
    assert (plan.threads, plan.cpus, plan.source) == (3, (), "--threads")
    assert plan_engine(1, cpus=[0, 1], env=NO_ENV).cpus == ()
    # Data-parallel ranks with a set count: disjoint slices after the front end's core.
    ranks = [plan_engine(2, rank=r, ranks=2, cpus=range(6), env=NO_ENV) for r in range(2)]
    assert [p.cpus for p in ranks] == [(1, 2), (3, 4)]
    # 2 ranks x 2 threads on 4 cores: no core left to reserve, all used.
    ranks = [plan_engine(2, rank=r, ranks=2, cpus=range(4), env=NO_ENV) for r in range(2)]
    assert [p.cpus for p in ranks] == [(0, 1), (2, 3)]
    # More threads than cores: as asked, left unbound (and the log says so).
    over = plan_engine(4, rank=1, ranks=2, cpus=[0, 1], env=NO_ENV)
    assert (over.threads, over.cpus) == (4, ())
    assert "oversubscribed" in over.describe()
    with pytest.raises(ValueError, match="threads must be >= 1"):
        plan_engine(0, cpus=[0, 1], env=NO_ENV)


def test_in_process_engine_is_never_bound_and_never_raised() -> None:
    assert plan_in_process(current=8, cpus=[0, 1], env=NO_ENV) == \
        ThreadPlan(1, (), "auto", "2 cores, 1 left to other work", upto=2)
    assert plan_in_process(current=8, cpus=range(8), env=NO_ENV).threads == 7
    assert plan_in_process(current=2, cpus=range(8), env=NO_ENV).threads == 2
    # The spare core may be lent (thread_governor.py), never above the caller's count.
    assert plan_in_process(current=8, cpus=range(8), env=NO_ENV).upto == 8
    assert plan_in_process(current=2, cpus=range(8), env=NO_ENV).upto == 2
    assert plan_in_process(current=1, cpus=[0, 1], env=NO_ENV).upto == 1
    assert plan_in_process(2, current=8, cpus=[0, 1], env=NO_ENV).upto == 0
    assert plan_in_process(current=4, cpus=[5], env=NO_ENV).threads == 1
    assert plan_in_process(4, current=1, cpus=[0, 1], env=NO_ENV).threads == 4
    assert plan_in_process(current=1, cpus=[0, 1], env={"OMP_NUM_THREADS": "2"}).threads == 2


def test_describe_names_cpus_and_source() -> None:
    text = ThreadPlan(3, (1, 2, 3, 6), "auto", "8 cores, 1 kept for the front end").describe()
    assert text == ("3 torch threads, bound to CPU 1-3,6 (auto; 8 cores, 1 kept for the "
                    "front end)")
    lent = ThreadPlan(1, (), "auto", "2 cores, 1 left to other work", upto=2).describe()
    assert lent == ("1 torch thread (2 while no other process uses the spare core), not "
                    "bound (auto; 2 cores, 1 left to other work)")


_ENGINE_PROBE = """
import json, os, threading
os.sched_setaffinity(0, {cpus})                    # the CPUs the probe may use
import torch
from wideserve.config import EngineConfig, ParallelConfig
from wideserve.engine.engine_proc import _local_rank, _set_torch_threads
from wideserve.utils.threads import announce_engine_plan
stop = threading.Event()
t = threading.Thread(target=stop.wait, daemon=True); t.start()   # a thread started before
config = EngineConfig(parallel=ParallelConfig({parallel}))
announce_engine_plan(_set_torch_threads(config), *_local_rank(config))
tasks = os.listdir("/proc/self/task")
print(json.dumps({{"threads": torch.get_num_threads(),
                   "affinity": sorted({{c for tid in tasks for c in os.sched_getaffinity(int(tid))}})}}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to reserve one")
def test_engine_process_applies_and_logs_its_plan() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]          # the probe runs on two CPUs
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-c", _ENGINE_PROBE.format(cpus=cpus, parallel="")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"threads": 1, "affinity": [cpus[1]]}     # every thread moved
    assert "[engine] 1 torch thread (2 while no other process uses the spare core), bound " \
        "to CPU" in out.stderr
    # A data-parallel rank: rank 1 of 2 on the two CPUs takes the second.
    cmd[-1] = _ENGINE_PROBE.format(cpus=cpus,
                                   parallel="data_parallel_size=2, data_parallel_rank=1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == \
        {"threads": 1, "affinity": [cpus[1]]}
    assert "[engine] rank 1: 1 torch thread" in out.stderr
    # OMP_NUM_THREADS fixes the count, unbound: 2 threads on the 2 CPUs the probe has.
    out = subprocess.run(cmd[:-1] + [_ENGINE_PROBE.format(cpus=cpus, parallel="")],
                         capture_output=True,
                         text=True, env=dict(env, OMP_NUM_THREADS="2"), timeout=120,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"threads": 2, "affinity": cpus}


_LEND_PROBE = """
import json, os, threading
import torch
from wideserve.utils.threads import ThreadPlan
plan = ThreadPlan(1, ({own},), "auto", spare=({spare},), upto=2)
plan.apply()
t = threading.Thread(target=threading.Event().wait, args=(60,), daemon=True); t.start()
def seen():
    tasks = os.listdir("/proc/self/task")
    return [torch.get_num_threads(),
            sorted({{c for tid in tasks for c in os.sched_getaffinity(int(tid))}})]
rows = [seen()]
plan.set_count(2); rows.append(seen())
plan.set_count(1); rows.append(seen())
print(json.dumps(rows))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to lend one")
def test_a_bound_plan_lends_its_spare_core_to_every_thread() -> None:
    own, spare = sorted(os.sched_getaffinity(0))[1], sorted(os.sched_getaffinity(0))[0]
    cmd = [sys.executable, "-c", _LEND_PROBE.format(own=own, spare=spare)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == \
        [[1, [own]], [2, sorted([own, spare])], [1, [own]]]


def test_threads_flag_reaches_the_engine_config() -> None:
    import argparse

    from wideserve.entrypoints.engine_args import (add_engine_args, engine_config_from_args,
                                                   one_line_error)
    parser = argparse.ArgumentParser(prog="wideserve serve")
    parser.error = one_line_error.__get__(parser)          # type: ignore[method-assign]
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--threads", "3"])).parallel.threads == 3
    assert engine_config_from_args(parser.parse_args([])).parallel.threads is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


def test_llm_rejects_a_bad_thread_count() -> None:
    from wideserve.config import engine_config_from_kwargs
    assert engine_config_from_kwargs(threads=2).parallel.threads == 2
    with pytest.raises(ValueError, match="threads must be >= 1"):
        engine_config_from_kwargs(threads=0)
