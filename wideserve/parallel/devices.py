"""Which device each data-parallel rank runs on (docs/distributed.md, "Devices per rank").

A node runs ranks `data_parallel_start_rank .. + data_parallel_size_local - 1` and sees some
accelerators (CUDA_VISIBLE_DEVICES, already applied by torch: `torch.cuda.device_count()`).
Local rank i (= rank - start rank) gets the i-th visible device, so DEP8 on one 8-GPU node puts
rank r on `cuda:r` and the second node of a DEP16 deployment puts ranks 8..15 on cuda:0..7.
Its model, KV cache and process group all follow from that one string: the group's backend
is NCCL for a CUDA device and gloo for the CPU (`groups.backend_for`).

CPU ranks share the host: every one of them is "cpu" (threads are split by threads.py).
Only the device *count* is asked of torch, and only for accelerator kinds, so nothing here
initialises CUDA or imports a CUDA-only module.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from wideserve.config import ParallelConfig

# Device kinds that hold one rank per device; anything else ("cpu", "meta") is shared.
ACCELERATORS = ("cuda", "xpu", "mps")


class DevicePlanError(ValueError):
    """The node's ranks do not fit its devices, or --device contradicts the layout."""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The devices of one node's ranks: `devices[i]` is local rank i's device."""
    kind: str                    # "cuda", "cpu", ...
    start_rank: int              # the node's first global rank
    devices: tuple[str, ...]     # one per local rank

    def device_for(self, rank: int) -> str:
        local = rank - self.start_rank
        if not 0 <= local < len(self.devices):
            raise DevicePlanError(f"rank {rank} is not on this node (ranks {self.start_rank}.."
                                  f"{self.start_rank + len(self.devices) - 1})")
        return self.devices[local]

    def table(self) -> list[tuple[int, str]]:
        """(global rank, device) for every rank of the node, for logs and `--help` output."""
        return [(self.start_rank + i, d) for i, d in enumerate(self.devices)]


def device_count(kind: str) -> int:
    """Devices of `kind` this process may use (after CUDA_VISIBLE_DEVICES); 0 if none."""
    import torch
    module = getattr(torch, kind, None)
    count = getattr(module, "device_count", None)
    return int(count()) if callable(count) else 0


def plan_devices(parallel: ParallelConfig, device: str,
                 visible: Sequence[str] | None = None) -> DevicePlan:
    """The devices of this node's ranks for `--device device`.

    `visible` lists the node's usable devices (e.g. ["cuda:0", "cuda:1"]); None asks torch
    how many there are. Refused with a message naming the flags when the node runs more ranks
    than it has devices, or when `--device cuda:N` pins one device for several local ranks.
    """
    kind, _, index = device.partition(":")
    local = parallel.local_size
    first = parallel.data_parallel_start_rank
    if kind not in ACCELERATORS:
        return DevicePlan(kind, first, (device,) * local)
    if index:
        if local > 1:
            raise DevicePlanError(
                f"--device {device} names one device but this node runs {local} ranks "
                f"(--data-parallel-size {parallel.data_parallel_size}"
                f"{_local_flag(parallel)}): give --device {kind} and each rank takes its own "
                f"(choose them with CUDA_VISIBLE_DEVICES)")
        return DevicePlan(kind, first, (device,))
    if visible is None:
        visible = [f"{kind}:{i}" for i in range(device_count(kind))]
    if local > len(visible):
        env = os.environ.get("CUDA_VISIBLE_DEVICES") if kind == "cuda" else None
        seen = f"CUDA_VISIBLE_DEVICES={env!r}: " if env is not None else ""
        raise DevicePlanError(
            f"this node runs {local} data-parallel ranks (--data-parallel-size "
            f"{parallel.data_parallel_size}{_local_flag(parallel)}) but sees {len(visible)} "
            f"{kind} device(s) ({seen}{', '.join(visible) or 'none'}); one rank per device: "
            f"lower --data-parallel-size-local (and start the other ranks on other nodes "
            f"with --headless --data-parallel-start-rank) or make more devices visible")
    return DevicePlan(kind, first, tuple(visible[:local]))


def _local_flag(parallel: ParallelConfig) -> str:
    if parallel.data_parallel_size_local is None:
        return ""
    return (f", --data-parallel-size-local {parallel.data_parallel_size_local}, "
            f"--data-parallel-start-rank {parallel.data_parallel_start_rank}")


def rank_device(parallel: ParallelConfig, device: str,
                visible: Sequence[str] | None = None) -> str:
    """This rank's (`parallel.data_parallel_rank`) device."""
    return plan_devices(parallel, device, visible).device_for(parallel.data_parallel_rank)


def bind_device(device: str) -> None:
    """Make `device` the process's current device before any group or tensor is made (NCCL
    and the caching allocator use the current device). A no-op for shared kinds."""
    kind, _, index = device.partition(":")
    if kind in ACCELERATORS and index:
        import torch
        module = getattr(torch, kind)
        if hasattr(module, "set_device"):
            module.set_device(int(index))
