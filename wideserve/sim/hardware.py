"""Hardware descriptions (plain data with a source per number) and calibration profiles.

`wideserve/sim/hardware/*.json` hold public-specification GPUs (per GPU: dense FLOP/s per
dtype, memory bandwidth and size, NVLink and NIC bandwidth and latency). A calibration
profile (`wideserve simulate calibrate`, JSON) holds what was measured on a machine: the
engine's host cost per step component, per-op times vs shape, collective latencies. A profile
can also stand as the hardware itself ("this machine": its measured tables replace the
roofline), which is how the CPU validation runs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HARDWARE_DIR = Path(__file__).resolve().parent / "hardware"


@dataclass(slots=True)
class Hardware:
    name: str
    kind: str                                  # "gpu" (roofline) or "measured" (a profile)
    flops: dict[str, float | None]             # dense FLOP/s per compute dtype
    mem_bytes_per_s: float
    mem_bytes: float
    scaleup_bytes_per_s: float                 # per direction, per GPU
    scaleup_latency_s: float
    scaleup_domain: int                        # GPUs per NVLink domain
    nic_bytes_per_s: float
    nic_latency_s: float
    kernel_gap_s: float
    host_speed: float = 1.0
    sources: dict[str, str] = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        """FLOP/s for a weight format; formats without tensor-core support run at the next
        wider one the device has (H100 has no FP4: FP4 weights compute in FP8)."""
        for d in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(dtype, (dtype,)):
            if self.flops.get(d):
                return float(self.flops[d])
        return float(self.flops.get("bf16") or self.flops.get("fp32") or 1.0)

    def link(self, ranks: int) -> tuple[float, float]:
        """(bytes/s, latency) of the fabric between `ranks` GPUs: NVLink inside a domain,
        the NIC beyond."""
        if ranks <= self.scaleup_domain:
            return self.scaleup_bytes_per_s, self.scaleup_latency_s
        return self.nic_bytes_per_s, self.nic_latency_s


def available() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def load_hardware(name_or_path: str) -> Hardware:
    """A bundled name (h100, h200, b200, gb200, gb300) or a path to a JSON file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = HARDWARE_DIR / f"{name_or_path.lower()}.json"
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: give one of {available()} "
                         f"or a JSON file")
    data = json.loads(path.read_text())
    if "profile" in data:                       # a calibration profile as hardware
        return Profile.from_dict(data).as_hardware()
    return Hardware(**{k: v for k, v in data.items() if k in Hardware.__slots__})


@dataclass(slots=True)
class Profile:
    """What `wideserve simulate calibrate` measured (see calibrate.py for how)."""

    machine: str
    host: dict[str, Any]            # base_s, per_request_s, per_token_s, jitter_s (samples)
    collectives: dict[str, Any]     # allreduce_s {ranks: s}, alltoall {alpha_s, bytes_per_s}
    ops: dict[str, Any]             # expert {rows: [...], s: [...]}, forward {...}, matmul
    mem_bytes_per_s: float
    flops_fp32: float
    sources: dict[str, str] = field(default_factory=dict)
    # P/D (calibrate_pd.py): prefill {tokens, s} on one rank, nixl {per_transfer_s,
    # bytes_per_s}, admission {tokens, s} = decode-host seconds to admit one KV load
    pd: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Profile":
        p = d["profile"]
        return Profile(**{k: p[k] for k in Profile.__slots__ if k in p})

    def to_dict(self) -> dict[str, Any]:
        return {"profile": {k: getattr(self, k) for k in Profile.__slots__}}

    def as_hardware(self) -> Hardware:
        a2a = self.collectives["alltoall"]
        nixl = self.pd.get("nixl") or {}
        return Hardware(
            name=f"this machine ({self.machine})", kind="measured",
            flops={"fp32": self.flops_fp32, "bf16": self.flops_fp32},
            mem_bytes_per_s=self.mem_bytes_per_s, mem_bytes=0.0,
            scaleup_bytes_per_s=a2a["bytes_per_s"], scaleup_latency_s=a2a["alpha_s"],
            scaleup_domain=1 << 20,
            # the KV path between servers: measured NIXL when calibrated (its per-transfer
            # time includes the software overhead), else the host collectives' link
            nic_bytes_per_s=nixl.get("bytes_per_s", a2a["bytes_per_s"]),
            nic_latency_s=nixl.get("per_transfer_s", a2a["alpha_s"]), kernel_gap_s=0.0,
            host_speed=1.0,
            sources={"all": "measured by wideserve simulate calibrate", **self.sources})


def load_profile(path: str | Path) -> Profile:
    return Profile.from_dict(json.loads(Path(path).read_text()))
