"""torch's `at::native::cpublas::brgemm` (oneDNN's ukernel, AMX where present) in loops over
one expert of the 653M model (256 rows; gate/up K 1,024 x N 768, down K 384 x N 1,024), one
thread, thread CPU time: GFLOP/s per call layout (columns per packed group `nc`, rows per call
`mblk`, loop order v1 groups outside / v2 row blocks outside / v3 K split), the per-call cost
(same shape, alternating shapes), against oneDNN's linear and torch.mm (BENCHMARKS.md, "Intel
Xeon: session 12"). Needs a CPU whose bf16 brgemm runs (AVX512-BF16 / AMX).

  OMP_NUM_THREADS=1 python benchmarks/brgemm_tiles.py [rows]
"""
import os
import sys
import tempfile
import time

import torch
from torch.utils.cpp_extension import load


LAYOUTS = [  # (loop order, rows per call, K per call; 0: all of K)
    (1, 32, 0), (1, 64, 0), (1, 128, 0), (1, 256, 0), (2, 32, 0), (2, 64, 0),
    (3, 256, 256), (3, 256, 512), (3, 32, 256)]


def seconds(fn, reps: int = 20) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t0) / reps


def build() -> None:
    """Compile the loops (brgemm_tiles.cpp) into torch.ops.bb."""
    out = os.path.join(tempfile.gettempdir(), "wideserve_brgemm_tiles")
    os.makedirs(out, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    load("bb", [os.path.join(here, "brgemm_tiles.cpp")],
         extra_cflags=["-O3", "-march=x86-64-v4"], is_python_module=False,
         build_directory=out, verbose=False)


def main() -> None:
    torch.set_num_threads(1)
    build()
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    for n in (1024, 2048):
        a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
        print(f"peak torch.mm {n}^3: {2 * n ** 3 / seconds(lambda: torch.mm(a, b), 5) / 1e9:.0f}"
              " GFLOP/s", flush=True)
    x, wp = torch.randn(64, 1024).bfloat16(), torch.randn(16, 512, 32, 2).bfloat16()
    for alternating in (0, 1):
        s = min(torch.ops.bb.run(x, wp, 4, alternating, 0, 5) for _ in range(3))
        print(f"tiny calls (alternating shapes: {alternating}): {s / 2000 * 1e9:.0f} ns per call")
    for k, n in [(1024, 768), (384, 1024)]:       # gate/up, down
        x = torch.randn(rows, k).bfloat16()
        w = (torch.randn(n, k) * 0.05).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        flops = 2 * rows * n * k
        onednn = seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                     [], ""))
        mm = seconds(lambda: torch.mm(x, w.t()))
        print(f"M={rows} K={k} N={n}: oneDNN {flops / onednn / 1e9:.0f} GFLOP/s, "
              f"torch.mm {flops / mm / 1e9:.0f}")
        for nc in (32, 64, 128, 256):
            # groups of nc columns in brgemm's VNNI layout [K/2, nc, 2]
            wg = w.view(n // nc, nc, k // 2, 2).permute(0, 2, 1, 3).contiguous()
            for v, mb, kb in LAYOUTS:
                if kb and k % kb:
                    continue
                torch.ops.bb.run(x, wg, v, mb, kb, 2)
                s = min(torch.ops.bb.run(x, wg, v, mb, kb, 10) for _ in range(3))
                print(f"  nc={nc} v{v} rows/call={mb} K/call={kb or k}: "
                      f"{flops / s / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
