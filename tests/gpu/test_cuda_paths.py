"""Paths that only a CUDA machine exercises (marked `gpu`: skipped with that reason elsewhere;
benchmarks/gpu/check.sh runs them). Each names what the CPU suite cannot show."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wideserve.config import ParallelConfig
from wideserve.parallel.devices import plan_devices
from wideserve.parallel.groups import backend_for

pytestmark = pytest.mark.gpu


def test_device_plan_uses_the_real_devices() -> None:
    n = torch.cuda.device_count()
    plan = plan_devices(ParallelConfig(data_parallel_size=n), "cuda")
    assert plan.devices == tuple(f"cuda:{i}" for i in range(n))
    for device in plan.devices:                   # each one takes a tensor
        assert torch.ones(1, device=device).device == torch.device(device)


def test_nccl_is_the_backend_of_a_cuda_rank() -> None:
    assert backend_for(torch.device("cuda:0")) == "nccl"


def test_step_metadata_copy_is_pinned_and_asynchronous() -> None:
    from wideserve.utils.device import to_device
    a = np.arange(1 << 16, dtype=np.int64)
    torch.cuda.set_sync_debug_mode("error")       # the copy must not synchronise the host
    try:
        t = to_device(a, "cuda:0")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.from_numpy(a))


def test_tiny_v4_greedy_on_cuda_equals_cpu_fp32() -> None:
    from wideserve import LLM, SamplingParams
    from wideserve.worker.model_loader import BUNDLED_MODEL
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(2, 18))}]
    torch.backends.cuda.matmul.allow_tf32 = False
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(BUNDLED_MODEL.parent / "shakespeare-v4-tiny"), device=device,
                  dtype="float32", load_format="dummy", enforce_eager=True,
                  kv_cache_memory=1 << 26, skip_tokenizer_init=True)
        outs[device] = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
    assert outs["cuda"] == outs["cpu"]
