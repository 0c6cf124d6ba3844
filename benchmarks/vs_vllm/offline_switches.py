"""offline_worker.py with in-process switches, for A/B runs of one tree (BENCHMARKS.md, "KV
write in the op, lazy KV pool"). Run from benchmarks/vs_vllm with offline_worker's arguments:

  FUSED=0|1  KernelConfig.fused_kv_write (the KV write inside the attention op)
  HUGE=0|1   kv_huge_pages (CacheConfig: the KV pool on transparent huge pages)
  EAGER=1    the KV pool zeroed by torch.zeros at startup (the allocation before session 6)
"""
import functools
import os
import runpy
import sys

from wideserve.kv_cache import host_memory
from wideserve.serving import llm as llm_mod

llm_mod.LLM = functools.partial(
    llm_mod.LLM, kv_huge_pages=os.environ.get("HUGE") == "1",
    kernel_config={"fused_kv_write": os.environ.get("FUSED", "1") == "1"})
if os.environ.get("EAGER") == "1":
    host_memory.LAZY_MIN_BYTES = 1 << 62
sys.argv = ["offline_worker.py"] + sys.argv[1:]
runpy.run_path("offline_worker.py", run_name="__main__")
