"""--batch-invariant across data-parallel ranks: DEP2 (two engine-core processes, experts
sharded, all-to-all MoE) gives one process's greedy tokens in bf16, with kernels chosen by
measurement (WIDESERVE_GEMM=auto, what users run; tests/conftest.py pins the micro-kernel).
The default mode rounds a rank's expert rows by its own row counts and takes a different
experts path than one process (docs/cpu_kernels.md, "Batch invariance")."""
from __future__ import annotations

import warnings

import pytest
import torch

from dist_utils import free_port_block
from tiny_families import qwen3_moe_checkpoint
from wideserve import LLM, SamplingParams
from wideserve.kernels import choice
from wideserve.kernels.loader import cpu_ops_available

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU ops not built")


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> str:
    return qwen3_moe_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe_dep_bi"), torch.bfloat16, vocab_size=1024,
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False)


def _run(model: str, dp: int) -> list[list[int]]:
    args = dict(dtype="bfloat16", skip_tokenizer_init=True, batch_invariant=True,
                enable_prefix_caching=False)
    if dp > 1:
        args.update(data_parallel_size=dp, enable_expert_parallel=True,
                    data_parallel_rpc_port=free_port_block(2 + 2 * dp), dp_sync_timeout_s=60)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 1024, (n,), generator=gen).tolist()
               for n in (37, 5, 60, 12, 90, 3, 25, 44)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, **args)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_dep2_bf16_gives_one_process_tokens(qwen3_moe_dir, monkeypatch):
    monkeypatch.setenv(choice.ENV_FORCE, "auto")
    choice.default_choice.cache_clear()
    try:
        expected = _run(qwen3_moe_dir, 1)
        got = _run(qwen3_moe_dir, 2)
    finally:
        choice.default_choice.cache_clear()
    assert got == expected, [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
