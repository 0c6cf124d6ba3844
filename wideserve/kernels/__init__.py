"""C++ CPU kernels, built once per machine as one JIT extension (docs/cpu_kernels.md).

`loader.cpu_ops_available()` builds/loads `wideserve_cpu_ops` from `csrc/*.cpp`; its ops are
then reachable as `torch.ops.wideserve.<op>`. CUDA never uses them. `describe()` says which
build serves a device (the GEMM choice per shape: `choice.KernelChoice.summary()`).
"""
from __future__ import annotations

# The CPU features the C++ kernels and oneDNN choose their paths by (docs/cpu_kernels.md).
ISA_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx2")


def describe(device: str) -> str:
    """One line for logs and the startup block: the kernel build serving `device` ("cpu",
    "cuda", "cuda:1") and the CPU features it chose its paths by."""
    if not device.startswith("cpu"):
        return f"{device}: torch's kernels (the C++ CPU kernels serve the CPU only)"
    # Imported here: the package is imported by every kernel module, the loader pulls torch.
    from wideserve.kernels.loader import cpu_flags, cpu_ops_available, load
    present = cpu_flags()
    flags = " ".join(f for f in ISA_FLAGS if f in present) or "none of " + "/".join(ISA_FLAGS)
    if not cpu_ops_available():
        return f"C++ CPU kernels unavailable (see the warning above): torch paths; " \
               f"CPU features: {flags}"
    loaded = load()
    where = "installed" if loaded.prebuilt else "compiled on this machine"
    return f"C++ CPU kernels, {loaded.variant} build ({where}); CPU features: {flags}"
