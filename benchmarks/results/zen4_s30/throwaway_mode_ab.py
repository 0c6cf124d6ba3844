"""In one process: the fused experts op on 8 cold layers of the 653M shapes, WS_EXP_MODE
alternating per round, with the pure read bandwidth (torch sum over 1 GB) each round."""
import os, sys, time, statistics, json
import torch
sys.path.insert(0, "/work/main/benchmarks")
import moe_decode_op as m

modes = os.environ.get("MODES", "0,1,2,3").split(",")
rounds = int(os.environ.get("ROUNDS", "40"))
tokens = [int(v) for v in os.environ.get("TOKENS", "64").split(",")]
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
cold = m.layers_of(m.E, m.LAYERS, g)
def route(t):
    ids = torch.stack([torch.randperm(m.E, generator=g)[:m.TOP_K] for _ in range(t)])
    return (torch.randn(t, m.D, generator=g).bfloat16(), ids, torch.rand(t, m.TOP_K, generator=g).softmax(-1))
routes = {t: route(t) for t in tokens}
buf = torch.ones(1 << 28)
def setmode(md):
    # "1" or "1:WS_AHEAD=4096:WS_RA_UP=6"
    parts = md.split(":")
    os.environ["WS_EXP_MODE"] = parts[0]
    for k in ("WS_AHEAD", "WS_RA_UP", "WS_RA_DN", "WS_RA_MOST"):
        os.environ.pop(k, None)
    for kv in parts[1:]:
        k, v = kv.split("=")
        os.environ["WS_" + k] = v

def bw():
    best = 0
    for _ in range(2):
        t0 = time.perf_counter(); buf.sum(); best = max(best, buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best
with torch.inference_mode():
    # bit-identity across modes
    for t, r in routes.items():
        outs = []
        for md in modes:
            setmode(md)
            outs.append(torch.cat([op(*r) for op in cold[:2]]))
        print("tokens", t, "identical across modes:", all(torch.equal(outs[0], o) for o in outs[1:]), flush=True)
    for _ in range(2):
        for md in modes:
            setmode(md)
            for r in routes.values(): m.call(cold, r)
    for rd in range(rounds):
        row = {"bw": round(bw(), 1)}
        for t, r in routes.items():
            for md in (modes if rd % 2 == 0 else modes[::-1]):
                setmode(md)
                row[f"{t}:{md}"] = round(m.call(cold, r) * 1e3, 3)
        print(json.dumps(row), flush=True)
