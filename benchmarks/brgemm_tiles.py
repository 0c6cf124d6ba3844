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

torch.set_num_threads(1)
here = os.path.dirname(os.path.abspath(__file__))
build = os.path.join(tempfile.gettempdir(), "wideserve_brgemm_tiles")
os.makedirs(build, exist_ok=True)
load("bb", [os.path.join(here, "brgemm_tiles.cpp")], extra_cflags=["-O3", "-march=x86-64-v4"],
     is_python_module=False, build_directory=build, verbose=False)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 256
for n in (1024, 2048):
    a = torch.randn(n, n).bfloat16(); b = torch.randn(n, n).bfloat16()
    torch.mm(a, b); t0 = time.thread_time(); r = 5
    for _ in range(r): torch.mm(a, b)
    print(f"peak mm {n}^3: {2*n**3*r/(time.thread_time()-t0)/1e9:.0f} GF/s", flush=True)
x = torch.randn(64, 1024).bfloat16(); wp = torch.randn(16, 512, 32, 2).bfloat16()
for mb in (0, 1):
    s = min(torch.ops.bb.run(x, wp, 4, mb, 0, 5) for _ in range(3))
    print(f"tiny call pair (alternating={mb}): {s/2000*1e9:.0f} ns per call")
for (K, N) in [(1024, 768), (384, 1024)]:
    x = torch.randn(M, K).bfloat16()
    w = (torch.randn(N, K) * 0.05).bfloat16()
    pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
    fl = 2 * M * N * K
    def t(fn, reps=20):
        fn(); t0 = time.thread_time()
        for _ in range(reps): fn()
        return (time.thread_time() - t0) / reps
    ref = t(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""))
    mm = t(lambda: torch.mm(x, w.t()))
    print(f"M={M} K={K} N={N}: onednn {fl/ref/1e9:.0f} GF/s, mm {fl/mm/1e9:.0f}")
    for nc in (32, 64, 128, 256):
        if N % nc: continue
        wp = w.view(N // nc, nc, K // 2, 2).permute(0, 2, 1, 3).contiguous()
        for v, mb, kb in [(1, 32, 0), (1, 64, 0), (1, 128, 0), (1, 256, 0), (2, 32, 0), (2, 64, 0), (3, 256, 256), (3, 256, 512), (3, 32, 256)]:
            if kb and K % kb: continue
            torch.ops.bb.run(x, wp, v, mb, kb, 2)
            s = min(torch.ops.bb.run(x, wp, v, mb, kb, 10) for _ in range(3))
            print(f"  nc={nc} v{v} mblk={mb} kblk={kb}: {fl/s/1e9:.0f} GF/s")
