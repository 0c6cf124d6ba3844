import os

# One torch thread per process: on this 2-core machine two threads beside any other busy
# process are ~10x slower (measured on the 2-core CI machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


# --- Parallel runs (pytest-xdist; pyproject.toml's addopts: `-n auto --dist loadgroup`) -------
# Most of the suite's wall time is spent waiting on spawned servers, engine cores and DP ranks,
# so a 2-core machine runs more workers than cores. Each test module is one unit of work
# (xdist_group = its path), so a module-scoped fixture (a server, a loaded model) is built once;
# MODULE_GROUPS puts modules that share a machine-wide resource on one worker; the units start
# longest first, so a long module never starts last and holds the run up alone.
import pytest  # noqa: E402

# Seconds per module, measured serially with `--durations` on the 2-core CI machine (rounded;
# only the order matters). A module not listed here is treated as short.
MODULE_SECONDS: dict[str, float] = {
    "tests/entrypoints/openai/test_server_fuzz_soak.py": 511,
    "tests/entrypoints/openai/test_server_smollm2.py": 227,
    "tests/entrypoints/openai/test_server_agentic.py": 187,
    "tests/entrypoints/openai/test_server_lifecycle.py": 175,
    "tests/models/test_deepseek_v41.py": 164,
    "tests/distributed/test_dep_engine.py": 136,
    "tests/entrypoints/test_generate_cli.py": 125,
    "tests/entrypoints/openai/test_server_engine_faults.py": 114,
    "tests/entrypoints/test_info.py": 110,
    "tests/disagg/test_pd_dep.py": 110,
    "tests/distributed/eplb/test_eplb_dep.py": 103,
    "tests/entrypoints/test_info_v41.py": 103,
    "tests/models/test_deepseek_v4_backends.py": 101,
    "tests/disagg/test_nixl.py": 101,
    "tests/entrypoints/openai/test_server_bundled.py": 84,
    "tests/disagg/test_router_e2e.py": 73,
    "tests/models/test_gguf.py": 70,
    "tests/distributed/test_dep_multinode.py": 67,
    "tests/entrypoints/openai/test_server_api.py": 67,
    "tests/distributed/test_ep_dispatch.py": 58,
    "tests/entrypoints/openai/test_server_reliability.py": 55,
    "tests/distributed/eplb/test_eplb_weight_moves.py": 55,
    "tests/distributed/test_dep_server.py": 49,
    "tests/entrypoints/openai/test_server_bad_inputs.py": 37,
    "tests/models/test_deepseek_v4.py": 25,
    "tests/distributed/eplb/test_eplb_engine.py": 21,
    "tests/distributed/test_dp_sync.py": 21,
    "tests/models/test_deepseek_v4_fp8.py": 16,
    "tests/disagg/test_pd_loopback.py": 14,
    "tests/entrypoints/openai/test_engine_proc_plumbing.py": 13,
    "tests/entrypoints/openai/test_engine_client_faults.py": 12,
}

# Modules that must not run at the same time as each other: they share one resource of the
# machine (named network namespaces and veth devices, created and deleted by name).
MODULE_GROUPS: dict[str, str] = {
    "tests/disagg/test_nixl.py": "netns",
    "tests/distributed/test_dep_multinode.py": "netns",
}

MAX_AUTO_WORKERS = 4


@pytest.hookimpl(optionalhook=True)         # pytest -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers per core (they mostly wait on subprocesses), at most
    MAX_AUTO_WORKERS; PYTEST_XDIST_AUTO_NUM_WORKERS overrides, as in plain xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_AUTO_WORKERS, 2 * (cores or 1)))


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers it too; here for runs without xdist (`-p no:xdist`).
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker with its group")


def _module_path(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _group(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = _module_path(item)
            item.add_marker(pytest.mark.xdist_group(MODULE_GROUPS.get(path, path)))
    if not getattr(config.option, "loadgroup", False):   # only an xdist worker under loadgroup
        return
    modules: dict[str, set[str]] = {}
    for item in items:
        modules.setdefault(_group(item), set()).add(_module_path(item))
    cost = {g: sum(MODULE_SECONDS.get(m, 0.0) for m in ms) for g, ms in modules.items()}
    items.sort(key=lambda item: -cost[_group(item)])     # stable: a group stays in its order
