"""Build and load the one C++ CPU extension, `wideserve_cpu_ops` (docs/cpu_kernels.md).

Every `csrc/*.cpp` is compiled into it; each file registers its own ops with
`TORCH_LIBRARY_FRAGMENT(wideserve, m)` + `TORCH_LIBRARY_IMPL(wideserve, CPU, m)`, so adding a
kernel needs no change here, and the ops are called as `torch.ops.wideserve.<op>`. The files
include only `<ATen/ATen.h>`, `<ATen/Parallel.h>` and `<torch/library.h>` (plus intrinsics), never
`<torch/extension.h>`, whose pybind headers cost more compile time than the kernels.

The build directory is named by a hash of the sources, the flags and the torch version, so
worktrees with different sources never rebuild each other's copy, and an unchanged tree loads
the cached .so in well under a second. `python -m wideserve.kernels.loader` builds it ahead
(CI runs that before pytest, so tests only load).

A build failure raises from `build()` (tests call it, so a broken kernel fails them) and makes
`cpu_ops_available()` log the error once and answer False: serving falls back to the torch
paths.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EXTENSION_NAME = "wideserve_cpu_ops"
CSRC = Path(__file__).resolve().parent / "csrc"
# -march=native: the kernels' AVX512-BF16 paths are compiled where the build machine has it
# (the .so is built on the machine that runs it); the portable paths elsewhere.
# -fopenmp: at::parallel_for is a header template whose OpenMP backend is a `#pragma omp
# parallel` compiled into the caller; without the flag every kernel ran on one thread whatever
# torch.set_num_threads said. The .so then needs libgomp.so.1, which resolves to the copy torch
# already loaded (same soname), so kernels and torch share one OpenMP thread pool.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Where the builds live: $WIDESERVE_KERNELS_CACHE, else ~/.cache/wideserve/kernels.
CACHE_ENV = "WIDESERVE_KERNELS_CACHE"


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def _build_directory() -> Path:
    # The directory of the sources is part of the key: torch's build.ninja names them by
    # absolute path, so two checkouts sharing one build directory would rebuild it in turn.
    digest = hashlib.sha256(str(CSRC).encode() + b"\0")
    for path in sources() + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(CFLAGS + LDFLAGS).encode() + torch.__version__.encode())
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "wideserve" / "kernels")
    return root / f"{EXTENSION_NAME}-{digest.hexdigest()[:16]}"


@functools.cache
def build() -> Path:
    """Compile (or find the cached build of) the extension and load it into this process;
    returns the build directory. Raises on a compiler error."""
    from torch.utils import cpp_extension

    srcs = sources()
    if not srcs:
        raise RuntimeError(f"no C++ sources in {CSRC}")
    directory = _build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file that a killed builder leaves behind, after which every
    # later build waits on it forever (seen when a test killed an engine mid-build). An flock
    # dies with its holder: under it no other builder of ours is alive, so a leftover torch
    # lock file is stale and is removed before torch looks at it.
    with open(directory / "wideserve-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        cpp_extension.load(name=EXTENSION_NAME, sources=[str(s) for s in srcs],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(directory),
                           is_python_module=False, verbose=False)
    return directory


@functools.cache
def cpu_ops_available() -> bool:
    """Whether `torch.ops.wideserve.*` can be used in this process (built and loaded once)."""
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - any build/load failure means: use the torch path
        logger.warning("wideserve C++ CPU kernels unavailable, using the torch paths: %s", exc)
        return False
    return True


if __name__ == "__main__":
    print(build())
