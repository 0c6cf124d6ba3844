"""Host -> device transfers of the step metadata, in one place.

The engine builds per-step metadata with numpy on the host and hands the models tensors on
their device. On the CPU the tensor shares the array's memory (no copy at all); on CUDA it
is one asynchronous copy from pinned memory.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device | str,
              dtype: np.dtype | type | None = None) -> torch.Tensor:
    """`a` (made C-contiguous, writable and of `dtype` if given; a copy only when needed) as
    a tensor on `device`. On the CPU it shares `a`'s memory: do not write to `a` afterwards.
    On CUDA the array is staged in pinned memory and copied without blocking the host (the
    caching host allocator keeps the staging buffer alive until the copy has run)."""
    flags = a.flags
    if flags.c_contiguous and flags.writeable and (dtype is None or a.dtype == dtype):
        host = torch.from_numpy(a)      # the common case: np.require's checks cost more
    else:
        host = torch.from_numpy(np.require(a, dtype=dtype, requirements=["C", "W"]))
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return host
    if kind == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
