"""The kernel build and loader: per-ISA variants chosen by the CPU's flags, prebuilt libraries
used only when built from the same sources, a compile at first use that says so, an install
that survives a missing compiler, and every variant this CPU can run passing the kernel tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wideserve.kernels import build as kbuild
from wideserve.kernels import loader

REPO = Path(__file__).resolve().parents[2]
ZEN4 = frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave avx512f avx512bw avx512cd "
                 "avx512dq avx512vl avx512_bf16 avx512_vnni".split())
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}
ICE_LAKE = ZEN4 - {"avx512_bf16"}
HASWELL = frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())
# A stand-in compiler that writes its output (and ninja's depfile) at once.
FAKE_CXX = """#!/bin/sh
while [ "$#" -gt 0 ]; do
  case "$1" in -o) echo "{content}" > "$2";; -MF) : > "$2";; esac
  shift
done
"""


def _names(flags: frozenset[str]) -> list[str]:
    return [v.name for v in loader.supported_variants(flags)]


@pytest.mark.skipif(kbuild.all_variants() == (kbuild.GENERIC,), reason="x86 variants")
def test_best_variant_follows_the_cpu_flags() -> None:
    assert _names(SAPPHIRE_RAPIDS) == ["avx512bf16", "avx512", "avx2", "generic"]
    assert _names(ZEN4)[0] == "avx512bf16"
    assert _names(ICE_LAKE) == ["avx512", "avx2", "generic"]
    assert _names(HASWELL) == ["avx2", "generic"]
    assert _names(HASWELL - {"fma"}) == ["generic"]          # pre-Haswell: portable C++ only
    assert loader.supported_variants(loader.cpu_flags())[0].name == \
        loader.load().variant                                  # this machine loads its best


def test_prebuilt_is_used_only_when_built_from_these_sources(tmp_path: Path) -> None:
    variant = kbuild.X86_VARIANTS[-1]
    assert loader._prebuilt(variant, tmp_path) is None            # nothing installed
    (tmp_path / variant.filename).write_bytes(b"")
    manifest = {variant.name: {"file": variant.filename, "key": kbuild.source_key(variant)}}
    (tmp_path / kbuild.MANIFEST).write_text(json.dumps(manifest))
    assert loader._prebuilt(variant, tmp_path) == tmp_path / variant.filename
    manifest[variant.name]["key"] = "0" * 16                      # sources edited since
    (tmp_path / kbuild.MANIFEST).write_text(json.dumps(manifest))
    assert loader._prebuilt(variant, tmp_path) is None
    # The key covers every source and the torch version: editing a kernel changes it.
    other = kbuild.Variant(variant.name, variant.cflags + ("-DX",), variant.cpu_flags)
    assert kbuild.source_key(other) != kbuild.source_key(variant)


def test_install_without_a_compiler_succeeds_with_one_warning(tmp_path, monkeypatch,
                                                             capsys) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert kbuild.build_prebuilt(tmp_path / "out", tmp_path / "build") == []
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and "no C++ compiler" in err[0] and "first use" in err[0]
    assert not (tmp_path / "out").exists()


def test_install_step_builds_libraries_and_manifest(tmp_path, monkeypatch) -> None:
    # A stand-in compiler that writes its output: the ninja graph, the copy and the manifest
    # are what is checked here (the real compile is every kernel test's job).
    fake = tmp_path / "cxx"
    fake.write_text(FAKE_CXX.format(content=""))
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv(kbuild.VARIANTS_ENV, "avx2,generic")
    written = kbuild.build_prebuilt(tmp_path / "out", tmp_path / "build")
    names = sorted(p.name for p in written)
    assert names == sorted([kbuild.MANIFEST, "wideserve_cpu_ops_avx2.so",
                            "wideserve_cpu_ops_generic.so"])
    manifest = json.loads((tmp_path / "out" / kbuild.MANIFEST).read_text())
    assert manifest["avx2"]["key"] == kbuild.source_key(kbuild.X86_VARIANTS[-1])
    ninja = (tmp_path / "build" / "build.ninja").read_text()
    for src in kbuild.sources():                    # every csrc/*.cpp, in every variant
        assert f"avx2/{src.stem}.o" in ninja and f"generic/{src.stem}.o" in ninja
    monkeypatch.setenv(kbuild.VARIANTS_ENV, "avx9000")
    assert kbuild.build_prebuilt(tmp_path / "out2", tmp_path / "build2") == []


_PROBE = """
import sys
from pathlib import Path
from wideserve.kernels import loader
loader.PREBUILT = Path(sys.argv[1])
print("available", loader.cpu_ops_available())
"""


def _probe(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), WIDESERVE_KERNELS_CACHE=str(tmp_path / "c"),
                **env)
    return subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "none")],
                          capture_output=True, text=True, env=full, timeout=300)


def test_first_use_compile_says_so_and_failure_is_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "cxx"                         # "compiles" instantly, into junk
    fake.write_text(FAKE_CXX.format(content="x"))
    fake.chmod(0o755)
    out = _probe(tmp_path, {"CXX": str(fake), loader.ISA_ENV: "generic"})
    assert "available False" in out.stdout
    assert "compiling the C++ CPU kernels for generic (one time" in out.stderr
    assert "CPU kernels compiled in" in out.stderr
    warnings = [line for line in out.stderr.splitlines() if "unavailable" in line]
    assert len(warnings) == 1 and "using the torch paths" in warnings[0]


def test_no_compiler_and_nothing_installed_runs_the_torch_paths(tmp_path: Path) -> None:
    out = _probe(tmp_path, {"CXX": str(tmp_path / "none")})
    assert "available False" in out.stdout
    assert "compiling" not in out.stderr
    warnings = [line for line in out.stderr.splitlines() if "unavailable" in line]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]


# Tests that assert this machine's best variant is loaded, or that the AVX512-BF16
# micro-kernel is the path taken: true of the top variant only.
FAST_PATH_ONLY = ("not compiled_where and not built_where and not uses_the_kernel_for_bf16 "
                  "and not router_module_fast_path")
OTHER_VARIANTS = [v.name for v in loader.supported_variants(loader.cpu_flags())[1:-1]]


@pytest.mark.parametrize("variant", OTHER_VARIANTS)
def test_lower_variants_pass_the_kernel_tests(variant: str) -> None:
    """One installed copy serves an AVX512 and an AVX2 CPU: the lower variants, which this
    CPU can run too, pass the kernel tests against the torch references (prebuilt where
    installed, else compiled once into the cache)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               **{loader.ISA_ENV: variant})
    tests = [f"tests/kernels/test_{name}_kernel.py" for name in
             ("norm", "gemm", "moe", "paged_attention", "qk_norm_rope")]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", FAST_PATH_ONLY, *tests],
                         cwd=REPO, capture_output=True, text=True, env=env, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    check = ("import torch; from wideserve.kernels import loader; l = loader.load(); "
             "print(l.variant, bool(torch.ops.wideserve.moe_fast_path_compiled()), "
             "bool(torch.ops.wideserve.paged_attention_has_avx512()))")
    got = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout.split()
    assert got == [variant, str(variant == "avx512bf16"), str(variant.startswith("avx512"))]


def test_module_entry_point_reports_the_loaded_variant() -> None:
    out = subprocess.run([sys.executable, "-m", "wideserve.kernels.loader"], cwd=REPO,
                         capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"wideserve CPU kernels: {loader.load().variant} (" in out.stdout
    assert hasattr(torch.ops.wideserve, "moe_fused_experts")
