"""Which CPU this is, as /proc/cpuinfo says: one reader for the kernel loader, the kernel
choice's cache key and the benchmark reports.

The model name alone does not tell CPU classes apart: a KVM guest on a Zen 4 and on a Zen 5
EPYC both read "AMD EPYC", and the two differ in what a kernel should do (Zen 5 runs 512-bit
products at full width). The family / model / stepping numbers do, so the label every
figure and cached table carries includes them.
"""
from __future__ import annotations

import dataclasses
import functools
import platform
from dataclasses import dataclass, field
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuId:
    model_name: str = "unknown"
    vendor: str = ""
    family: str = ""
    model: str = ""
    stepping: str = ""
    flags: frozenset[str] = field(default_factory=frozenset)

    def label(self) -> str:
        """"AMD EPYC (family 26 model 2 stepping 1)": the name and, where known, the numbers."""
        nums = " ".join(f"{k} {v}" for k, v in (("family", self.family), ("model", self.model),
                                                ("stepping", self.stepping)) if v)
        return f"{self.model_name} ({nums})" if nums else self.model_name


_KEYS = {"model name": "model_name", "vendor_id": "vendor", "cpu family": "family",
         "model": "model", "stepping": "stepping"}


def parse_cpuinfo(text: str) -> CpuId:
    """The first processor's entry of a /proc/cpuinfo text (it ends at the first blank line)."""
    found: dict[str, str] = {}
    flags: frozenset[str] = frozenset()
    for line in text.strip().split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in _KEYS:
            found[_KEYS[key]] = value
        elif key == "flags":
            flags = frozenset(value.split())
    return CpuId(flags=flags, **found)


@functools.cache
def cpu_id(path: Path = CPUINFO) -> CpuId:
    """This machine's CPU (read once). Where /proc/cpuinfo names no model (Arm) or is absent
    (outside Linux), the name is the platform's processor string."""
    try:
        found = parse_cpuinfo(path.read_text())
    except OSError:
        found = CpuId()
    if found.model_name == "unknown":
        found = dataclasses.replace(found, model_name=platform.processor() or "unknown")
    return found
