"""Microbenchmark of the GQA paged attention op (BENCHMARKS.md, "C++ paged attention"): the
batched backend with the C++ op (`kernel`) or the torch buckets (`batched`), 8 layers of cache
(DRAM-sized), random block placement, one torch thread; ms per layer, the cache write included.

  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/paged_attention_kernel.py batched|kernel
"""
import sys, time, numpy as np, torch
torch.set_num_threads(1)
variant = sys.argv[1]
if variant == "kernel":
    from wideserve.kernels.loader import build
    build()
from wideserve.executor.forward_batch import ForwardBatch, KVGroupView
from wideserve.layers.attention import paged_attention_batched as pab
def bench(R, H, KVH, D, ctx, qlen, layers=8, dtype=torch.bfloat16, bs=64, budget_s=1.5):
    bpr = (ctx + qlen + bs - 1) // bs
    nb = R * bpr + 1
    caches = [torch.randn(nb, bs, 2*KVH*D).to(dtype) for _ in range(layers)]
    table = (torch.randperm(nb - 1) + 1)[:R*bpr].view(R, bpr).contiguous()
    qsl = np.arange(R + 1) * qlen; lens = np.full(R, ctx + qlen)
    T = R * qlen
    q = torch.randn(T, H, D).to(dtype); k = torch.randn(T, KVH, D).to(dtype); v = torch.randn(T, KVH, D).to(dtype)
    pos = torch.from_numpy(np.concatenate([np.arange(ctx, ctx + qlen)] * R))
    req = torch.from_numpy(np.repeat(np.arange(R), qlen))
    view = KVGroupView(bs, 1, table)
    view.slot_mapping = view.entry_slots(req, pos)
    names = [f"l{i}" for i in range(layers)]
    batch = ForwardBatch(torch.zeros(T, dtype=torch.long), pos, torch.from_numpy(qsl), torch.from_numpy(lens), qsl, lens,
                         dict(zip(names, caches)), [view], {n: 0 for n in names})
    pab.USE_CPU_KERNEL = variant == "kernel"
    def step():
        plans = pab.PagedAttentionPlans(batch)
        for n in names: pab.paged_attention_batched(q, k, v, batch, n, D**-0.5, None, plans)
    with torch.inference_mode():
        step(); times = []; t0 = time.perf_counter()
        while time.perf_counter() - t0 < budget_s or len(times) < 3:
            t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    best = np.median(times) / layers
    print(f"{variant:8s} R={R:3d} H={H}/{KVH} ctx={ctx:5d} q={qlen:4d}: {best*1e3:7.3f} ms/layer", flush=True)
for args in [(64,4,2,64,192,1), (64,16,4,64,192,1), (8,4,2,64,2048,1), (64,4,2,64,192,4), (4,4,2,64,0,128), (4,16,4,64,0,128), (1,16,4,64,1024,512)]:
    bench(*args)
