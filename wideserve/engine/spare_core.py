"""Whether an engine borrows the cores its thread plan leaves to other work while they idle
(wideserve/utils/thread_governor.py; docs/cpu_kernels.md, "Threads"): `LLM()`'s in-process
engine (the core left to the caller's other work) and a single served engine (the core kept
for its front end)."""
from __future__ import annotations

import logging
from typing import Any

from wideserve.kernels import weight_stream
from wideserve.kernels.loader import cpu_ops_available
from wideserve.utils.thread_governor import CpuTimes, ThreadGovernor
from wideserve.utils.threads import ThreadPlan

logger = logging.getLogger(__name__)


def lend_spare_cores(plan: ThreadPlan, engine: Any,
                     since: tuple[float, CpuTimes | None] | None = None
                     ) -> ThreadGovernor | None:
    """The governor of `engine` (an EngineCore, loaded under `plan`), its first window read,
    where the plan has cores to lend and nothing holds them or needs a fixed count: None for
    a set count, an accelerator, the weight-streaming helper on the spare core, the
    batch-invariant mode (a bucket's kernel may differ between counts, and with it the last
    bits). `since`: the first window's start (taken before the engine loaded)."""
    device = getattr(engine, "device", None)
    if plan.upto <= plan.threads or device is None or device.type != "cpu":
        return None
    if cpu_ops_available() and weight_stream.active():
        logger.info("threads: the spare core runs the weight-streaming helper; not lent")
        return None
    config = getattr(engine, "config", None)
    if config is not None and config.kernels.batch_invariant:
        logger.info("threads: batch-invariant mode keeps %d threads", plan.threads)
        return None
    governor = ThreadGovernor(plan.threads, plan.upto, plan.watched_cpus(),
                              set_threads=plan.set_count, since=since)
    governor.first_window()
    return governor
