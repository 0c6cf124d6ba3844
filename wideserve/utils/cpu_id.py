"""Which CPU this is, as /proc/cpuinfo says: one reader for the kernel loader, the kernel
choice's cache key and the benchmark reports.

The model name alone does not tell CPU classes apart: a KVM guest on a Zen 4 and on a Zen 5
EPYC both read "AMD EPYC", and the two differ in what a kernel should do (Zen 5 runs 512-bit
products at full width). The family / model / stepping numbers do, so the label every
figure and cached table carries includes them.
"""
from __future__ import annotations

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
    """The first processor's entry of a /proc/cpuinfo text."""
    found: dict[str, str] = {}
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        if not line.strip():
            if found:
                break   # the first processor's block ends
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in _KEYS and _KEYS[key] not in found:
            found[_KEYS[key]] = value
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuId(flags=flags, **found)


def cpu_id(path: Path = CPUINFO) -> CpuId:
    """This machine's CPU; outside Linux only the processor's name (no flags)."""
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        return CpuId(model_name=platform.processor() or "unknown")
