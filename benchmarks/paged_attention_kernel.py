"""Microbenchmarks of the GQA paged attention op (BENCHMARKS.md, "C++ paged attention").

  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/paged_attention_kernel.py batched|kernel
  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/paged_attention_kernel.py op [--small-pages]

batched|kernel: the batched backend with the C++ op (`kernel`) or the torch buckets
(`batched`), 8 layers of cache (DRAM-sized), random block placement, one torch thread; wall
ms per layer, the cache write included.

op: `torch.ops.wideserve.paged_attention` alone on decode shapes (the 11M Qwen3-MoE's first:
64 requests, 4 q / 2 KV heads, head_dim 64, bf16, block 64, ragged contexts of 96-288 tokens,
4 layers of cache in pools of 8192 blocks as the engine sizes them, blocks drawn at random
from the pool). Caches come from the KV allocator's host_memory.zeros (huge pages), or plain
4 KiB pages with --small-pages. Prints thread CPU ms per call (the median of rounds: the
machine is shared, and CPU time is what other processes disturb least) and the KV bytes read
per second of it.
"""
import sys, time, numpy as np, torch
torch.set_num_threads(1)
variant = sys.argv[1]
if variant in ("kernel", "op"):
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
def bench_op(R, H, KVH, D, ctx, qlen, small_pages, layers=4, pool=8192, bs=64, rounds=7):
    try:
        from wideserve.core.kv_cache import host_memory
    except ImportError:                     # a tree from before huge-page caches
        host_memory, small_pages = None, True
    rng = np.random.default_rng(0)
    lens = rng.integers(ctx // 2, ctx * 3 // 2 + 1, R) + qlen
    mb = int(-(-lens.max() // bs))
    shape = (pool, bs, 2 * KVH * D)
    nbytes = int(np.prod(shape)) * 2
    caches = [(torch.zeros(nbytes, dtype=torch.uint8) if small_pages else
               host_memory.zeros(nbytes, torch.device("cpu"))).view(torch.bfloat16).view(shape)
              for _ in range(layers)]
    for c in caches: c.normal_()
    table = torch.from_numpy(rng.permutation(pool)[:R * mb].reshape(R, mb).copy())
    qsl, sl = torch.arange(R + 1) * qlen, torch.from_numpy(lens)
    q = torch.randn(R * qlen, H, D).to(torch.bfloat16)
    op = torch.ops.wideserve.paged_attention
    def layer_pass():
        for c in caches: op(q, c, table, None, qsl, sl, D ** -0.5, 0, False)
    layer_pass(); cpu = []
    for _ in range(rounds):
        c0, n = time.thread_time(), 0
        while time.thread_time() - c0 < 0.25:
            layer_pass(); n += layers
        cpu.append((time.thread_time() - c0) / n)
    ms = float(np.median(cpu)) * 1e3
    kv = float(lens.sum()) * 2 * KVH * D * 2
    print(f"op{' 4K-pages' if small_pages else ''} R={R:3d} H={H}/{KVH} D={D} ctx~{ctx} q={qlen}: "
          f"{ms:6.3f} ms/call CPU ({kv / ms / 1e6:5.1f} GB/s of KV)", flush=True)
if variant == "op":
    small = "--small-pages" in sys.argv
    for args in [(64, 4, 2, 64, 192, 1), (64, 16, 4, 64, 192, 1), (8, 4, 2, 64, 2048, 1), (64, 4, 2, 64, 192, 4)]:
        bench_op(*args, small)
else:
    for args in [(64,4,2,64,192,1), (64,16,4,64,192,1), (8,4,2,64,2048,1), (64,4,2,64,192,4), (4,4,2,64,0,128), (4,16,4,64,0,128), (1,16,4,64,1024,512)]:
        bench(*args)
