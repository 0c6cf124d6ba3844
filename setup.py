"""`pip install` / `pip install -e .` compiles wideserve's C++ CPU kernels (every ISA variant,
wideserve/kernels/build.py) against the torch that will run them (docs/cpu_kernels.md,
"Build"). Everything else about the package is in pyproject.toml.

The kernels link against libtorch, so they must be compiled with the torch of the environment
they are installed into. pip's build isolation hides that environment, and listing torch in
[build-system] would make pip fetch some other torch (the newest on the index, a CUDA build of
several GB) into the throwaway build environment. So the target environment's site-packages
are put back at the end of sys.path here, after the build environment's own packages. Where
torch is not installed yet, or no compiler is found, the install still succeeds, prints one
warning line, and the kernels are compiled at first use (or the torch paths run).
"""
from __future__ import annotations

import importlib.util
import sys
import sysconfig
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _kernel_build_module():
    spec = importlib.util.spec_from_file_location(
        "wideserve_kernel_build", ROOT / "wideserve" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _torch_importable() -> bool:
    for path in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]):
        if path not in sys.path:
            sys.path.append(path)        # the target environment, after the build env's
    return importlib.util.find_spec("torch") is not None


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries: a platform wheel, and build_ext runs."""

    def has_ext_modules(self) -> bool:
        return True


class BuildKernels(build_ext):
    """Compiles the kernel libraries into wideserve/kernels/_prebuilt (in the source tree for
    an editable install, which setuptools marks `inplace`; in build_lib for a wheel)."""

    def run(self) -> None:
        package = ROOT if self.inplace else Path(self.build_lib)
        target = package / "wideserve" / "kernels" / "_prebuilt"
        if not _torch_importable():
            print("wideserve: warning: torch is not installed, so the C++ CPU kernels are "
                  "compiled at first use (install torch first to build them now)",
                  file=sys.stderr)
            self._written = []
            return
        try:
            with warnings.catch_warnings():    # numpy is installed after the build: torch
                warnings.simplefilter("ignore")  # warns that it is missing, harmlessly
                import torch  # noqa: F401
            kernels = _kernel_build_module()
        except Exception as exc:  # noqa: BLE001 - a broken build script must not fail install
            print(f"wideserve: warning: C++ CPU kernels not built at install ({exc}); they "
                  f"are compiled at first use, or the torch paths run", file=sys.stderr)
            self._written = []
            return
        self._written = kernels.build_prebuilt(target, Path(self.build_temp) / "kernels")

    def get_outputs(self) -> list[str]:
        return [str(p) for p in getattr(self, "_written", [])]

    def get_output_mapping(self) -> dict[str, str]:
        return {}


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildKernels})
