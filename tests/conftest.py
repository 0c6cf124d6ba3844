import os

# One torch thread per process: on this 2-core machine two threads beside any other busy
# process are ~10x slower (measured on the 2-core CI machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One GEMM kernel for every row count, in this process and every engine/server it starts.
# In auto mode the kernel per token bucket is picked by timing on the machine at hand
# (wideserve/kernels/choice.py), and kernels round bf16 differently: greedy text would then
# depend on the CI machine and its load, and the suite compares bf16 outputs across batch
# shapes and processes and against texts shown in README.md. The choice itself is tested with
# injected timings (tests/kernels/test_kernel_choice.py, tests/layers/test_linear_dispatch.py),
# and every kernel against the reference op under an explicit KernelPolicy.
os.environ.setdefault("WIDESERVE_GEMM", "micro")

import torch  # noqa: E402

torch.set_num_threads(1)


# --- The suite leaves no process behind (issue 25) ------------------------------------------
# Every process a test starts inherits this marker in its environment (and pytest's
# PYTEST_CURRENT_TEST, naming the test that started it); orphans keep both after they are
# reparented, so they are found by marker as well as by ancestry. At the end of the session
# whatever is still running is reported, killed, and fails the run.
import signal as _signal  # noqa: E402
import time as _time  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

import pytest as _pytest  # noqa: E402

_LEAK_MARKER = "WIDESERVE_TEST_SESSION"
_LEAK_GRACE_S = 10.0              # processes still shutting down when the last test ended
# The top pytest process's pid: an xdist worker keeps its controller's (which checks).
os.environ.setdefault(_LEAK_MARKER, str(os.getpid()))


def _proc_table() -> dict[int, tuple[int, str, bytes, bytes]]:
    """pid -> (ppid, state, cmdline, environ) of every readable process."""
    table = {}
    for entry in _Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        table[int(entry.name)] = (int(stat[1]), stat[0], cmdline, environ)
    return table


def _leftovers() -> dict[int, tuple[int, str, bytes, bytes]]:
    me = os.getpid()
    table = _proc_table()
    marker = f"{_LEAK_MARKER}={me}".encode()
    ours = {pid for pid, (_, _, _, env) in table.items() if marker in env.split(b"\0")}
    todo = [me]
    while todo:                                   # descendants (started without the marker)
        parent = todo.pop()
        for pid, (ppid, *_) in table.items():
            if ppid == parent and pid not in ours:
                ours.add(pid)
                todo.append(pid)
    # Not leaks: ourselves, zombies, and helpers of this very process that end with it:
    # multiprocessing's resource tracker, torch inductor's compile workers (more cores).
    from multiprocessing import resource_tracker
    keep = {me, getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {pid: table[pid] for pid in ours if pid not in keep and table[pid][1] != "Z"
            and b"torch._inductor.compile_worker" not in table[pid][2]}


def _describe(pid: int, info: tuple[int, str, bytes, bytes]) -> str:
    ppid, _, cmdline, environ = info
    test = next((v.split(b"=", 1)[1].decode(errors="replace")
                 for v in environ.split(b"\0") if v.startswith(b"PYTEST_CURRENT_TEST=")),
                "(started outside a test)")
    cmd = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
    return f"pid {pid} (ppid {ppid}) from {test}: {cmd}"


@_pytest.hookimpl(trylast=True)           # after the session fixtures' teardown
def pytest_sessionfinish(session: _pytest.Session, exitstatus: int) -> None:
    if os.environ[_LEAK_MARKER] != str(os.getpid()):
        return          # an xdist worker (or a pytest run by a test): the top process checks
    deadline = _time.monotonic() + _LEAK_GRACE_S
    leaks = _leftovers()
    while leaks and _time.monotonic() < deadline:
        _time.sleep(0.2)
        leaks = _leftovers()
    if not leaks:
        return
    lines = [_describe(pid, info) for pid, info in sorted(leaks.items())]
    for pid in leaks:
        try:
            os.kill(pid, _signal.SIGKILL)
        except OSError:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    header = f"{len(lines)} process(es) left behind by the tests (killed now)"
    if reporter is not None:
        reporter.line("")
        reporter.write_sep("=", header, red=True, bold=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print(header, *lines, sep="\n")
    session.exitstatus = _pytest.ExitCode.TESTS_FAILED


# --- Parallel runs (pytest-xdist; pyproject.toml's addopts: `-n auto --dist loadfile`) --------
# One worker per core: on the 2-core machine 4 workers were no faster than 2 (551 s vs 531 s
# for the whole suite) and the latency-bound schemathesis test took 298 s instead of 97 s.
# `--dist loadfile` makes each test module
# one unit of work, so a module-scoped fixture (a server, a loaded model) is built once (a
# module of SPLIT_MODULES: each test is a unit). The units start longest first, so a long
# module never starts last and holds the run up alone.
# (Not `--dist loadgroup`: with pytest 9 xdist 3.8 no longer tags the node ids with the
# group, and every test would become its own unit.)
import pytest  # noqa: E402

# Seconds per module from `--durations` on the shared 2-core machine (serially per directory;
# tests/{assets,bench,engine,kernels,kv_cache,layers,structured_outputs,tools,worker} and the
# top-level modules from a 4-worker run). Only the order matters; a module not listed here
# (under 10 s) is treated as short.
MODULE_SECONDS: dict[str, float] = {
    "tests/entrypoints/openai/test_server_fuzz_soak.py": 511,
    "tests/test_readme_servers.py": 250,
    "tests/test_readme.py": 100,
    "tests/spec_decode/test_spec_greedy.py": 470,
    "tests/entrypoints/openai/test_server_smollm2.py": 227,
    "tests/entrypoints/openai/test_server_agentic.py": 187,
    "tests/spec_decode/test_spec_bundled.py": 177,
    "tests/entrypoints/openai/test_server_lifecycle.py": 175,
    "tests/models/test_deepseek_v41.py": 164,
    "tests/parallel/test_dep_engine.py": 136,
    "tests/assets/test_bundled_model.py": 132,
    "tests/entrypoints/test_generate_cli.py": 125,
    "tests/entrypoints/openai/test_server_engine_faults.py": 114,
    "tests/bench/test_serve_e2e.py": 110,
    "tests/entrypoints/test_info.py": 110,
    "tests/disagg/test_pd_dep.py": 110,
    "tests/assets/test_bundled_v41.py": 107,
    "tests/parallel/eplb/test_eplb_dep.py": 103,
    "tests/parallel/eplb/test_eplb_dep_dspark.py": 60,
    "tests/parallel/test_host_read_budget_dep.py": 55,
    "tests/models/test_decode_fullgraph.py": 50,
    "tests/models/test_v4_cuda_decode_path.py": 25,
    "tests/test_batch_invariant.py": 55,
    "tests/kernels/test_batch_invariant_kernels.py": 25,
    "tests/engine/test_v4_decode_capture.py": 25,
    "tests/parallel/test_dp_group_lifecycle.py": 15,
    "tests/layers/test_quant_experts.py": 30,
    "tests/entrypoints/test_info_v41.py": 103,
    "tests/spec_decode/test_spec_sampled.py": 103,
    "tests/models/test_deepseek_v4_backends.py": 101,
    "tests/disagg/test_nixl.py": 101,
    "tests/entrypoints/openai/test_server_bundled.py": 84,
    "tests/engine/test_decode_capture.py": 75,
    "tests/disagg/test_router_e2e.py": 73,
    "tests/models/test_gguf.py": 70,
    "tests/entrypoints/openai/test_server_images.py": 70,
    "tests/entrypoints/openai/test_anthropic_messages.py": 70,
    "tests/parallel/test_dep_multinode.py": 67,
    "tests/entrypoints/openai/test_server_api.py": 67,
    "tests/parallel/test_ep_dispatch.py": 58,
    "tests/spec_decode/test_dspark.py": 60,
    "tests/entrypoints/openai/test_server_reliability.py": 55,
    "tests/parallel/eplb/test_eplb_weight_moves.py": 55,
    "tests/engine/test_engine_greedy.py": 52,
    "tests/parallel/test_dep_server.py": 49,
    "tests/spec_decode/test_draft_depth.py": 39,
    "tests/entrypoints/openai/test_server_bad_inputs.py": 37,
    "tests/spec_decode/test_dspark_sampled.py": 33,
    "tests/models/test_deepseek_v4.py": 25,
    "tests/engine/test_deepseek_v41_engine.py": 25,
    "tests/parallel/eplb/test_eplb_engine.py": 21,
    "tests/parallel/test_dp_sync.py": 21,
    "tests/engine/test_engine_behaviour.py": 20,
    "tests/models/test_deepseek_v4_fp8.py": 16,
    "tests/kv_cache/test_kv_simulation.py": 15,
    "tests/worker/test_small_batch.py": 25,
    "tests/worker/test_decode_batch.py": 15,
    "tests/kv_cache/test_kv_hashing.py": 15,
    "tests/disagg/test_pd_loopback.py": 14,
    "tests/entrypoints/openai/test_engine_proc_plumbing.py": 13,
    "tests/entrypoints/openai/test_engine_client_faults.py": 12,
    "tests/models/test_deepseek_v41_vision.py": 12,
    "tests/entrypoints/openai/test_server_images.py": 11,
    "tests/bench/test_throughput.py": 11,
}

# Modules whose tests are units of their own: their tests are long and their module fixture is
# short (a small checkpoint), so spreading them over the workers shortens the run more than
# the fixture built once per worker costs.
SPLIT_MODULES = {"tests/spec_decode/test_spec_greedy.py", "tests/test_readme_servers.py"}

MAX_AUTO_WORKERS = 8          # each worker may hold a server or DP ranks: bounded memory


@pytest.hookimpl(optionalhook=True)         # pytest -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per usable core, at most MAX_AUTO_WORKERS;
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides, as in plain xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_AUTO_WORKERS, cores or 1))


def _unit_of_work(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return nodeid if path in SPLIT_MODULES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, except that each test of SPLIT_MODULES is a unit of its own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of_work(nodeid)

    return ModuleScheduling(config, log)


GPU_SKIP = "gpu: no CUDA device on this machine (benchmarks/gpu/check.sh runs it on one)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked `gpu` are reported as skipped for want of a GPU, never silently dropped.
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP))
    if not hasattr(config, "workerinput"):            # only on xdist workers
        return
    # xdist hands out modules in this order (`--no-loadscope-reorder`); every worker sorts
    # the same way, as xdist requires. Stable: a module's own order is kept.
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0))
