"""Compile the C++ CPU kernels (`csrc/*.cpp`) into one shared library per x86 ISA level.

`pip install` runs this through setup.py (every variant, into `_prebuilt/`); the loader runs it
at first use only for a variant that is not installed or whose sources changed (an editable
tree being worked on), into the cache. One ninja graph holds every variant, so all cores stay
busy to the end, and ninja prints one short line per step ("[3/24] avx2 linear.cpp").

This module imports nothing from wideserve (setup.py loads it by path, before the package is
installed) and imports torch only inside functions.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LIBRARY = "wideserve_cpu_ops"
CSRC = Path(__file__).resolve().parent / "csrc"
PREBUILT = Path(__file__).resolve().parent / "_prebuilt"
MANIFEST = "manifest.json"
# Build-time choice of variants (comma-separated names); default: every variant of this arch.
VARIANTS_ENV = "WIDESERVE_KERNEL_VARIANTS"

# -fopenmp: at::parallel_for is a header template whose OpenMP backend is a `#pragma omp
# parallel` compiled into the caller; without the flag every kernel ran on one thread whatever
# torch.set_num_threads said. The library then needs libgomp.so.1, which resolves to the copy
# torch already loaded (same soname), so kernels and torch share one OpenMP thread pool.
COMMON_CFLAGS = ("-O3", "-fPIC", "-std=c++20", "-fopenmp")
LDFLAGS = ("-shared", "-fopenmp")

# /proc/cpuinfo names of what -march=x86-64-v3 / -v4 assume.
_X86_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of every source: the compiler flags, and the CPU flags it needs to run."""
    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]

    @property
    def filename(self) -> str:
        return f"{LIBRARY}_{self.name}.so"


# Best first. The sources guard their fast paths with __AVX512BF16__ / __AVX512F__, so each
# variant compiles exactly the paths its CPUs have; "generic" is the portable C++ alone.
X86_VARIANTS = (
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), _X86_V4 | {"avx512_bf16"}),
    Variant("avx512", ("-march=x86-64-v4",), _X86_V4),
    Variant("avx2", ("-march=x86-64-v3",), _X86_V3),
)
GENERIC = Variant("generic", (), frozenset())


def all_variants() -> tuple[Variant, ...]:
    """The variants this machine's architecture has, best first."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return X86_VARIANTS + (GENERIC,)
    return (GENERIC,)


def install_variants() -> tuple[Variant, ...]:
    """What `pip install` builds: $WIDESERVE_KERNEL_VARIANTS, else every x86 level (one
    installed copy serves an AVX512-BF16, an AVX512 and an AVX2 machine; older x86 CPUs and
    other architectures compile "generic" at first use)."""
    by_name = {v.name: v for v in all_variants()}
    wanted = os.environ.get(VARIANTS_ENV)
    if not wanted:
        return tuple(v for v in all_variants() if v is not GENERIC) or (GENERIC,)
    unknown = [n for n in wanted.split(",") if n.strip() not in by_name]
    if unknown:
        raise ValueError(f"{VARIANTS_ENV}: unknown variant(s) {unknown}; "
                         f"known: {sorted(by_name)}")
    return tuple(by_name[n.strip()] for n in wanted.split(","))


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def source_key(variant: Variant) -> str:
    """What a library was built from: every source and header, the flags, the torch version.
    A prebuilt library whose key differs from the tree's is stale."""
    import torch
    digest = hashlib.sha256()
    for path in sources() + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(COMMON_CFLAGS + variant.cflags + LDFLAGS).encode() + b"\0")
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def compiler() -> str | None:
    """The C++ compiler ($CXX, else c++ / g++ / clang++), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


def ninja_binary() -> str | None:
    found = shutil.which("ninja")
    if found:
        return found
    try:                                 # the `ninja` PyPI package's binary, not on PATH
        import ninja  # type: ignore[import-not-found]
        path = Path(ninja.BIN_DIR) / "ninja"
        return str(path) if path.exists() else None
    except ImportError:
        return None


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu",
                                                                  "-ltorch"]
    return includes + [abi], libs


def write_ninja(build_dir: Path, variants: tuple[Variant, ...], cxx: str) -> Path:
    """One ninja file compiling every source for every variant, objects under
    build_dir/<variant>/, libraries build_dir/<LIBRARY>_<variant>.so."""
    cflags, libs = _torch_flags()
    q = shlex.quote
    lines = ["ninja_required_version = 1.3", f"cxx = {q(cxx)}", "",
             "rule cxx",
             "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
             "  depfile = $out.d", "  deps = gcc", "  description = $variant $name", "",
             "rule link", "  command = $cxx $in $ldflags -o $out",
             "  description = link $out", ""]
    for variant in variants:
        objects = []
        flags = " ".join(q(f) for f in (*COMMON_CFLAGS, *variant.cflags, *cflags))
        for src in sources():
            obj = f"{variant.name}/{src.stem}.o"
            objects.append(obj)
            lines += [f"build {obj}: cxx {q(str(src))}", f"  cflags = {flags}",
                      f"  variant = {variant.name}", f"  name = {src.name}"]
        lines += [f"build {variant.filename}: link {' '.join(objects)}",
                  f"  ldflags = {' '.join(q(f) for f in (*LDFLAGS, *libs))}", ""]
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines))
    return path


def jobs() -> int:
    """Parallel compiles: $MAX_JOBS (torch's convention), else the cores this process may use."""
    if os.environ.get("MAX_JOBS", "").isdigit() and int(os.environ["MAX_JOBS"]) > 0:
        return int(os.environ["MAX_JOBS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def compile_variants(build_dir: Path, variants: tuple[Variant, ...], *,
                     quiet: bool = False) -> dict[str, Path]:
    """Build the variants' libraries in build_dir; returns {variant name: library} for those
    that built (ninja -k 0: one variant's compiler error does not stop the others). Raises
    RuntimeError when none built, with the compiler's last lines."""
    cxx, ninja = compiler(), ninja_binary()
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++; or set $CXX)")
    if ninja is None:
        raise RuntimeError("ninja not found (pip install ninja)")
    write_ninja(build_dir, variants, cxx)
    for variant in variants:             # relinked below (~1 s): a library left from an
        (build_dir / variant.filename).unlink(missing_ok=True)   # older build is not "built"
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    tail: list[str] = []
    with subprocess.Popen([ninja, "-C", str(build_dir), "-k", "0", "-j", str(jobs())],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:         # ninja's progress, streamed as it comes
            tail = (tail + [line.rstrip()])[-20:]
            if not quiet:
                print(line.rstrip(), file=sys.stderr, flush=True)
    built = {v.name: build_dir / v.filename for v in variants
             if (build_dir / v.filename).exists()}
    if proc.returncode != 0:
        missing = [v.name for v in variants if v.name not in built]
        if not built:
            raise RuntimeError(f"compiling the CPU kernels failed ({', '.join(missing)})"
                               + ":\n" + "\n".join(tail))
        print(f"wideserve: warning: CPU kernel variant(s) {', '.join(missing)} failed to "
              f"compile; built {', '.join(built)}", file=sys.stderr)
    return built


def build_prebuilt(target: Path, build_dir: Path) -> list[Path]:
    """The install step (setup.py): compile the install variants in build_dir, copy the
    libraries to target with a manifest of their source keys; returns the files written.
    Never raises: without a compiler (or torch) the install goes on, the loader compiles at
    first use, and the torch paths run where that fails too."""
    try:
        variants = install_variants()
        print(f"wideserve: compiling the C++ CPU kernels for {', '.join(v.name for v in variants)}"
              f" ({jobs()} jobs)", file=sys.stderr, flush=True)
        built = compile_variants(build_dir, variants)
    except Exception as exc:  # noqa: BLE001 - any failure: install without prebuilt kernels
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"wideserve: warning: C++ CPU kernels not built at install ({first}); they "
              f"are compiled at first use, or the torch paths run", file=sys.stderr)
        return []
    target.mkdir(parents=True, exist_ok=True)
    written = []
    by_name = {v.name: v for v in variants}
    for name, library in built.items():
        shutil.copy2(library, target / library.name)
        written.append(target / library.name)
    manifest = {name: {"file": by_name[name].filename, "key": source_key(by_name[name])}
                for name in built}
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return written + [target / MANIFEST]
