"""Microbenchmarks of the GQA paged attention op (BENCHMARKS.md, "C++ paged attention").

  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/paged_attention_kernel.py batched|kernel
  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/paged_attention_kernel.py op [--small-pages]
  OMP_NUM_THREADS=N PYTHONPATH=. python benchmarks/paged_attention_kernel.py fused --threads N [--huge]
  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/paged_attention_kernel.py roofline [--threads N] [--huge]

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

fused: one layer's attention as paged_attention_batched runs it in the engine, the 11M decode
shape at N torch threads, q/k/v as views of one qkv tensor, blocks laid out as the engine's
allocator hands them out (each request's prompt blocks consecutive, later blocks interleaved
over the batch): "write+op" = torch.cat + index_copy_ of the step's entries then the op,
"fused" = paged_attention_write (the write inside the op), "op" = the op alone, "op-rand" =
the op alone over blocks drawn at random from the pool; --huge: the pool on huge pages
(host_memory.zeros(huge_pages=True), CacheConfig.kv_huge_pages in the engine). ms per call, the median of rounds:
thread CPU time at one thread, wall time at more (thread CPU time misses the other threads).

roofline: the op on the 653M Qwen3-MoE's decode shape (64 requests, 16 q / 4 KV heads, head
dim 64, bf16, block 64, contexts 129-257 as in the 128 -> 128 offline run), one torch thread,
thread CPU ms per layer call (median of rounds) in three forms, alternating: "cold" cycles 8
layers' caches (~100 MB of KV read per pass, as between two layers of a decode step, where
the experts' weights evict it), "hot" points every request at the same 5 blocks (320 KB, in
L2: the op's arithmetic alone), and "read" a one-thread `sum` over 256 MiB, whose rate gives the time
to read one call's KV at the core's streaming bandwidth. `--threads N`: wall time instead;
`--huge`: the caches on 2 MiB pages (CacheConfig.kv_huge_pages).
A/B of two trees: run this file with PYTHONPATH set to each (the op comes from that tree).
"""
import sys, time, numpy as np, torch
threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
torch.set_num_threads(threads)
variant = sys.argv[1]
if variant in ("kernel", "op", "fused", "roofline"):
    from wideserve.kernels.loader import build
    build()
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
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
    config = pab.PagedAttentionConfig(cpu_kernel=variant == "kernel")
    def step():
        plans = pab.PagedAttentionPlans(batch, config=config)
        for n in names: pab.paged_attention_batched(q, k, v, batch, n, D**-0.5, None, plans)
    with torch.inference_mode():
        step(); times = []; t0 = time.perf_counter()
        while time.perf_counter() - t0 < budget_s or len(times) < 3:
            t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    best = np.median(times) / layers
    print(f"{variant:8s} R={R:3d} H={H}/{KVH} ctx={ctx:5d} q={qlen:4d}: {best*1e3:7.3f} ms/layer", flush=True)
def bench_op(R, H, KVH, D, ctx, qlen, small_pages, layers=4, pool=8192, bs=64, rounds=7):
    try:
        from wideserve.kv_cache import host_memory
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
def engine_table(R, lens, prompt, bs, pool):
    """Block ids as a fresh engine allocates them: a request's prompt blocks together, then one
    block per request each time the batch crosses a block edge (the decode steps)."""
    table, nxt = np.zeros((R, int(-(-lens.max() // bs))), np.int64), 1
    for r in range(R):
        n = -(-prompt // bs)
        table[r, :n] = np.arange(nxt, nxt + n); nxt += n
    for b in range(-(-prompt // bs), table.shape[1]):
        for r in range(R):
            if b * bs < lens[r]:
                table[r, b] = nxt; nxt += 1
    assert nxt <= pool
    return torch.from_numpy(table)
def bench_fused(R=64, H=4, KVH=2, D=64, layers=4, pool=8192, bs=64, rounds=9):
    from wideserve.kv_cache import host_memory
    huge = "--huge" in sys.argv
    rng = np.random.default_rng(0)
    lens = rng.integers(128, 257, R) + 1            # the 11M run: 128-token prompts, 128 out
    shape = (pool, bs, 2 * KVH * D)
    caches = [host_memory.zeros(int(np.prod(shape)) * 2, torch.device("cpu"), huge)
              .view(torch.bfloat16).view(shape) for _ in range(layers)]
    for c in caches: c.normal_()
    table = engine_table(R, lens, 128, bs, pool)
    qsl, sl = torch.arange(R + 1), torch.from_numpy(lens)
    pos = sl - 1
    slots = table[torch.arange(R), pos // bs] * bs + pos % bs
    qkv = torch.randn(R, (H + 2 * KVH) * D).to(torch.bfloat16)
    q, k, v = (t.view(R, -1, D) for t in torch.split(qkv, (H * D, KVH * D, KVH * D), -1))
    ops = torch.ops.wideserve
    def write_op(c):
        flat = c.view(-1, c.shape[-1])
        flat.index_copy_(0, slots, torch.cat((k.reshape(R, -1), v.reshape(R, -1)), -1))
        return ops.paged_attention(q, c, table, None, qsl, sl, D ** -0.5, 0, False)
    def fused(c):
        return ops.paged_attention_write(q, k, v, c, slots, table, None, qsl, sl, D ** -0.5, 0,
                                         False)
    def op(c):
        return ops.paged_attention(q, c, table, None, qsl, sl, D ** -0.5, 0, False)
    shuffled = torch.from_numpy(rng.permutation(pool)[:table.numel()].reshape(table.shape).copy())
    def op_random(c):      # the same reads from blocks at random places in the pool
        return ops.paged_attention(q, c, shuffled, None, qsl, sl, D ** -0.5, 0, False)
    # One thread: thread CPU time (what other processes disturb least); more: wall time.
    clock, unit = (time.thread_time, "CPU") if threads == 1 else (time.perf_counter, "wall")
    res = {}
    for rnd in range(rounds):
        for name, fn in (("write+op", write_op), ("fused", fused), ("op", op),
                         ("op-rand", op_random)):
            if fn is fused and not hasattr(ops, "paged_attention_write"):
                continue                    # a tree from before the fused write
            t0, n = clock(), 0
            while clock() - t0 < 0.15:
                for c in caches: fn(c)
                n += layers
            res.setdefault(name, []).append((clock() - t0) / n)
    kv = float(lens.sum()) * 2 * KVH * D * 2
    for name, ts in res.items():
        ms = float(np.median(ts)) * 1e3
        print(f"{name:8s} threads={threads}{' huge' if huge else ''} R={R} H={H}/{KVH} D={D} ctx~{int(lens.mean())}: "
              f"{ms:6.3f} ms/call {unit} ({kv / ms / 1e6:5.1f} GB/s of KV)", flush=True)
def bench_roofline(R=64, H=16, KVH=4, D=64, layers=8, bs=64, rounds=7):
    rng = np.random.default_rng(0)
    lens = rng.integers(128, 257, R) + 1
    mb = int(-(-lens.max() // bs))
    pool = R * mb + 1
    shape = (pool, bs, 2 * KVH * D)
    if "--huge" in sys.argv:                    # the KV pool on 2 MiB pages
        from wideserve.kv_cache import host_memory
        caches = [host_memory.zeros(int(np.prod(shape)) * 2, torch.device("cpu"), True)
                  .view(torch.bfloat16).view(shape) for _ in range(layers)]
        for c in caches: c.normal_()
    else:
        caches = [torch.randn(shape).to(torch.bfloat16) for _ in range(layers)]
    table = engine_table(R, lens, 128, bs, pool)
    qsl, sl = torch.arange(R + 1), torch.from_numpy(lens)
    q = torch.randn(R, H, D).to(torch.bfloat16)
    op = torch.ops.wideserve.paged_attention
    big = torch.ones(64 << 20)
    clock = time.thread_time if threads == 1 else time.perf_counter
    def cold():
        for c in caches: op(q, c, table, None, qsl, sl, D ** -0.5, 0, False)
    same = torch.arange(mb).repeat(R, 1)        # every request reads the same few blocks
    def hot():
        for _ in caches: op(q, caches[0], same, None, qsl, sl, D ** -0.5, 0, False)
    res = {}
    for _ in range(rounds):
        for name, fn, per in (("cold", cold, layers), ("hot", hot, layers), ("read", big.sum, 1)):
            t0, n = clock(), 0
            while clock() - t0 < 0.3:
                fn(); n += per
            res.setdefault(name, []).append((clock() - t0) / n)
    kv = float(lens.sum()) * 2 * KVH * D * 2
    read_ms = kv / (big.nbytes / float(np.median(res["read"]))) * 1e3
    for name in ("cold", "hot"):
        ms = float(np.median(res[name])) * 1e3
        print(f"{name:4s} threads={threads} R={R} H={H}/{KVH} D={D} ctx~{int(lens.mean())}: "
              f"{ms:6.3f} ms/call ({kv / ms / 1e6:5.1f} GB/s of KV, {ms / read_ms:4.2f}x the "
              f"read time)", flush=True)
    print(f"read: {big.nbytes / float(np.median(res['read'])) / 1e9:5.1f} GB/s -> {kv / 1e6:.1f} "
          f"MB of KV in {read_ms:6.3f} ms", flush=True)
if variant == "fused":
    bench_fused()
elif variant == "roofline":
    bench_roofline()
elif variant == "op":
    small = "--small-pages" in sys.argv
    for args in [(64, 4, 2, 64, 192, 1), (64, 16, 4, 64, 192, 1), (8, 4, 2, 64, 2048, 1), (64, 4, 2, 64, 192, 4)]:
        bench_op(*args, small)
else:
    for args in [(64,4,2,64,192,1), (64,16,4,64,192,1), (8,4,2,64,2048,1), (64,4,2,64,192,4), (4,4,2,64,0,128), (4,16,4,64,0,128), (1,16,4,64,1024,512)]:
        bench(*args)
