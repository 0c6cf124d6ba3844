"""Load the C++ CPU extension built for this CPU (docs/cpu_kernels.md, "Build").

Every `csrc/*.cpp` is compiled into one library per ISA variant (`kernels/build.py`:
avx512bf16, avx512, avx2; "generic" elsewhere); each file registers its own ops with
`TORCH_LIBRARY_FRAGMENT(wideserve, m)` + `TORCH_LIBRARY_IMPL(wideserve, CPU, m)`, so adding a
kernel needs no change here, and the ops are called as `torch.ops.wideserve.<op>`. The files
include only `<ATen/ATen.h>`, `<ATen/Parallel.h>` and `<torch/library.h>` (plus intrinsics),
never `<torch/extension.h>`, whose pybind headers cost more compile time than the kernels.

`pip install` builds the variants into `_prebuilt/` with a manifest of what each was built
from. At run time the best variant the CPU supports is loaded from there when its sources
and torch version match; otherwise (an editable tree whose sources changed, an install that
could not compile, a CPU no installed variant fits) that variant is compiled once into the
cache, `$WIDESERVE_KERNELS_CACHE` or ~/.cache/wideserve/kernels, with a progress line.
`$WIDESERVE_KERNELS_ISA` forces a variant (A/B runs, tests). `python -m
wideserve.kernels.loader` loads (building if needed) and says which variant runs.

A build failure raises from `build()` (tests call it, so a broken kernel fails them) and makes
`cpu_ops_available()` log one line and answer False: serving falls back to the torch paths.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from wideserve.kernels.build import (CSRC, LIBRARY, MANIFEST, PREBUILT, Variant, all_variants,
                                     compile_variants, compiler, source_key)
from wideserve.utils.cpu_id import cpu_id

logger = logging.getLogger(__name__)

ISA_ENV = "WIDESERVE_KERNELS_ISA"
CACHE_ENV = "WIDESERVE_KERNELS_CACHE"


@dataclass(frozen=True, slots=True)
class LoadedKernels:
    variant: str
    path: Path             # the library loaded into this process
    prebuilt: bool         # installed by pip (False: compiled into the cache)

    def describe(self) -> str:
        where = "installed" if self.prebuilt else "compiled at first use"
        return f"wideserve CPU kernels: {self.variant} ({where}, {self.path})"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them; outside Linux, torch's detected
    capability mapped onto the flags the variants need."""
    flags = cpu_id().flags
    if flags:
        return flags
    capability = torch.backends.cpu.get_cpu_capability()
    fits = [v for v in all_variants() if v.name == capability.lower()]
    return fits[0].cpu_flags if fits else frozenset()


def supported_variants(flags: frozenset[str]) -> list[Variant]:
    """The variants a CPU with these flags can run, best first ("generic" always fits)."""
    return [v for v in all_variants() if v.cpu_flags <= flags]


def _forced(variants: list[Variant]) -> list[Variant]:
    name = os.environ.get(ISA_ENV)
    if not name:
        return variants
    match = [v for v in all_variants() if v.name == name]
    if not match:
        raise ValueError(f"{ISA_ENV}={name!r}: known variants are "
                         f"{[v.name for v in all_variants()]}")
    if match[0] not in variants:
        raise ValueError(f"{ISA_ENV}={name!r}: this CPU lacks "
                         f"{sorted(match[0].cpu_flags - cpu_flags())}")
    return match


def _prebuilt(variant: Variant, prebuilt_dir: Path) -> Path | None:
    """The installed library of this variant when it was built from the sources and torch
    in use, else None."""
    try:
        entry = json.loads((prebuilt_dir / MANIFEST).read_text())[variant.name]
    except (OSError, ValueError, KeyError):
        return None
    path = prebuilt_dir / entry["file"]
    return path if path.exists() and entry["key"] == source_key(variant) else None


def _cache_directory(variant: Variant) -> Path:
    # The sources' directory is part of the key: ninja names them by absolute path, so two
    # checkouts sharing one build directory would rebuild it in turn.
    digest = hashlib.sha256(f"{CSRC}\0{source_key(variant)}".encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "wideserve" / "kernels")
    return root / f"{LIBRARY}-{variant.name}-{digest}"


def _compile_into_cache(variant: Variant) -> Path:
    if compiler() is None:
        raise RuntimeError("not installed prebuilt for this CPU/torch and no C++ compiler "
                           "to build them (c++, g++ or clang++; or set $CXX)")
    directory = _cache_directory(variant)
    directory.mkdir(parents=True, exist_ok=True)
    done = directory / f"{variant.filename}.ok"
    # An flock dies with its holder: a builder killed mid-build blocks nobody, and the next
    # one finds ninja's partial work and finishes it.
    with open(directory / "wideserve-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not done.exists():
            print(f"wideserve: compiling the C++ CPU kernels for {variant.name} (one time, "
                  f"~1-2 min; `pip install` builds them ahead) into {directory}",
                  file=sys.stderr, flush=True)
            start = time.monotonic()
            compile_variants(directory, (variant,))
            done.touch()
            print(f"wideserve: CPU kernels compiled in {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return directory / variant.filename


@functools.cache
def load() -> LoadedKernels:
    """Load the best variant for this CPU into the process (once); raises on a compiler
    error or when the library does not load."""
    variants = _forced(supported_variants(cpu_flags()))
    for variant in variants:
        path = _prebuilt(variant, PREBUILT)
        if path is not None:
            torch.ops.load_library(str(path))
            return LoadedKernels(variant.name, path, prebuilt=True)
    path = _compile_into_cache(variants[0])
    torch.ops.load_library(str(path))
    return LoadedKernels(variants[0].name, path, prebuilt=False)


def build() -> Path:
    """Load (compiling first if needed) the extension; returns the loaded library. Raises on
    a compiler error: the kernel tests call this, so a broken kernel fails them."""
    return load().path


@functools.cache
def cpu_ops_available() -> bool:
    """Whether `torch.ops.wideserve.*` can be used in this process (built and loaded once)."""
    try:
        loaded = load()
    except Exception as exc:  # noqa: BLE001 - any build/load failure means: use the torch path
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        logger.warning("wideserve C++ CPU kernels unavailable, using the torch paths: %s",
                       first)
        return False
    logger.info(loaded.describe())
    return True


if __name__ == "__main__":
    print(load().describe())
