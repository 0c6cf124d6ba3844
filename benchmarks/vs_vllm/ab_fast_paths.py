"""In-process A/B of the CPU fast paths (BENCHMARKS.md, "CPU kernels"): one engine, the paths
switched between alternated generate calls, so load noise hits every configuration alike.

  OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/vs_vllm/ab_fast_paths.py MODEL PROMPTS OUT_LEN [CONFIGS]

CONFIGS: comma-separated names from `configs` below (default all); "fused" is the C++
routed-experts op (wideserve/kernels), the CPU default in bf16 since session 4; "+cattn" adds
the C++ paged attention op (kernels/csrc/paged_attention.cpp), the CPU default since session 4;
"+norm" adds the C++ fused residual-add + RMS norm and greedy argmax ops (kernels/csrc/norm.cpp);
"+qkr" adds the fused q/k norm + RoPE op (kernels/csrc/qk_norm_rope.cpp); "+gemm" adds the
small-M GEMM micro-kernel for the linears, the LM head and the fused router
(kernels/csrc/linear.cpp; without it they run oneDNN and the torch router).
"""
import sys, time, random, torch
torch.set_num_threads(1)
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wideserve.serving.llm import LLM
from wideserve.types.sampling_params import SamplingParams
from wideserve.layers.attention import paged_attention_batched as pab
from wideserve.layers import linear as lin
from wideserve.layers.experts import RoutedExperts
from wideserve.config import KernelConfig
from breakdown import ForwardBreakdown
model, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
ids = [[rng.randrange(3, 8192) for _ in range(128)] for _ in range(n)]
llm = LLM(model, dtype="bfloat16", max_model_len=1024)
sp = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
def setcfg(attn_mm, experts, pack, cattn=False, fastnorm=False, qkr=False, gemm=False):
    engine = llm.engine
    engine.model.apply_kernel_config(KernelConfig(
        cpu_gemm=gemm,                  # csrc/linear.cpp: linears, LM head, router
        cpu_norm=fastnorm,              # csrc/norm.cpp ops (and the greedy argmax below)
        cpu_rope=qkr,                   # the fused q/k norm + RoPE op (csrc/qk_norm_rope.cpp)
        cpu_attention=cattn))           # the C++ paged attention op (csrc/paged_attention.cpp)
    engine.worker.cpu_argmax = engine.worker.sampler.cpu_argmax = fastnorm
    pab.MATMUL_MAX_ROWS = 16 if attn_mm else 0
    for m in llm.engine.model.modules():
        if isinstance(m, RoutedExperts):
            m.impl = experts; m._resolved.clear()
    lin.PACKED_DTYPES = (torch.bfloat16,) if pack else ()
    lin.packing_runs.cache_clear()
    for m in llm.engine.model.modules():
        for v in vars(m).values():
            if isinstance(v, lin.WeightPack): v.invalidate()
configs = {"old": (False, "grouped_mm", False), "attn": (True, "grouped_mm", False),
           "attn+pack": (True, "grouped_mm", True), "all": (True, "packed", True),
           "fused": (True, "fused", True),
           "fused+cattn": (True, "fused", True, True),
           "+norm": (True, "fused", True, True, True),
           "fused+cattn+qkr": (True, "fused", True, True, False, True),
           "+norm+qkr": (True, "fused", True, True, True, True),
           "+gemm": (True, "fused", True, True, True, True, True)}
sel = sys.argv[4].split(",") if len(sys.argv) > 4 else list(configs)
llm.generate([{"prompt_token_ids": p} for p in ids[:4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
for rnd in range(2):
    for name in sel:
        setcfg(*configs[name])
        llm.generate([{"prompt_token_ids": p} for p in ids[:2]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        probe = ForwardBreakdown(llm.engine)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
        el = time.perf_counter() - t
        r = probe.report()
        print(f"{name:10s} {n*out/el:7.0f} tok/s  fwd {r['forward']:.1f} attn {r['forward.attention']:.1f} op {r['forward.attention_op']:.1f} moe {r['forward.moe']:.1f} other {r['forward.other']:.1f} sample {r['sample']:.1f}", flush=True)
