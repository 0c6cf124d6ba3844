"""Greedy outputs through the whole engine equal transformers' greedy generate, token for
token, under every scheduling condition that must not change them: chunked prefill at token
budgets from 16 to 4096, prefix caching on and off (with hits), and preemption."""
from __future__ import annotations

import warnings

import pytest
import torch

from oracle import hf_greedy, mixed_prompts, save_hf
from wideserve import LLM, SamplingParams
from wideserve.engine.spare_core import lend_spare_cores
from wideserve.utils.thread_governor import CpuTimes, GovernorConfig, ThreadGovernor
from wideserve.utils.threads import ThreadPlan

MAX_NEW = 8
LENGTHS = [3, 9, 17, 30, 41, 5, 64, 12, 27, 50, 8, 33, 19, 70, 2, 45]  # 16 prompts


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=160, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1e4, tie_word_embeddings=False)).eval()


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=160, hidden_size=48, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False)).eval()


def _v4(name: str):
    from models import v4_configs
    from models.v4_helpers import hf_model
    return hf_model(getattr(v4_configs, name), seed=3)


MODELS = {
    # name: (builder, block size, uses the V4 stable top-k patch)
    "llama": (_llama, 16, False),
    "qwen3_moe": (_qwen3_moe, 16, False),
    "v4_A": (lambda: _v4("A"), 16, True),
    "v4_C": (lambda: _v4("C"), 12, True),
}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    from models.v4_helpers import stable_topk
    import contextlib
    builder, block_size, v4 = MODELS[request.param]
    model = builder()
    path = save_hf(model, tmp_path_factory.mktemp(request.param))
    vocab = model.config.vocab_size
    prompts = mixed_prompts(vocab, LENGTHS, seed=1)
    shared = mixed_prompts(vocab, [4, 11, 23, 7], seed=2, shared_prefix=3 * block_size + 5)
    ctx = stable_topk if v4 else contextlib.nullcontext
    expected = hf_greedy(model, prompts, MAX_NEW, ctx)
    expected_shared = hf_greedy(model, shared, MAX_NEW, ctx)
    return dict(path=str(path), block_size=block_size, prompts=prompts, expected=expected,
                shared=shared, expected_shared=expected_shared)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(case, **kw) -> LLM:
    args = dict(dtype="float32", block_size=case["block_size"], kv_cache_memory=1 << 26,
                skip_tokenizer_init=True)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(case["path"], **args)


class _Flipping:
    """CPU counters in which other processes take a whole CPU every second window, and the
    clock a window per reading: a governor on them switches the thread count at each step."""

    def __init__(self) -> None:
        self.now, self.busy, self.n = 0.0, 0.0, 0

    def clock(self) -> float:
        self.now += 1.0
        return self.now

    def read(self) -> CpuTimes:
        self.n += 1
        self.busy += self.n % 2
        return CpuTimes(self.busy, 0.0)


def test_thread_switches_do_not_change_outputs(case):
    """LLM()'s governor lends the spare core while it is idle (utils/thread_governor.py):
    the thread count moving between steps changes no greedy token."""
    llm = _llm(case, threads=1)
    fake, before = _Flipping(), torch.get_num_threads()
    llm._governor = ThreadGovernor(1, 2, [0, 1], torch.set_num_threads,
                                   GovernorConfig(raise_after_max=1),
                                   read=fake.read, clock=fake.clock)
    try:
        assert _generate(llm, case["prompts"]) == case["expected"]
        assert llm._governor.switches >= MAX_NEW        # a switch at (about) every step
        _check_idle(llm)
        # Which engines get one: a plan with a core to lend (its first window read at once,
        # on this machine's counters); never a fixed count, nor the batch-invariant mode (a
        # bucket's kernel may differ between counts).
        torch.set_num_threads(1)                        # the plan's count, applied
        lent = lend_spare_cores(ThreadPlan(1, (), "auto", upto=2), llm.engine)
        assert isinstance(lent, ThreadGovernor) and torch.get_num_threads() == lent.threads
        assert lend_spare_cores(ThreadPlan(1, (), "--threads"), llm.engine) is None
        invariant = _llm(case, threads=1, batch_invariant=True)
        assert lend_spare_cores(ThreadPlan(1, (), "auto", upto=2), invariant.engine) is None
    finally:
        torch.set_num_threads(before)


def _check_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.usage == 0.0


@pytest.mark.parametrize("budget,caching", [(4096, False), (16, True), (37, False), (256, True)])
def test_greedy_matches_transformers(case, budget, caching):
    llm = _llm(case, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    assert _generate(llm, case["prompts"]) == case["expected"]
    _check_idle(llm)


@pytest.mark.parametrize("mode", ["keep", "replay"])
def test_prefix_hits_do_not_change_outputs(case, mode):
    llm = _llm(case, max_num_batched_tokens=64, enable_prefix_caching=True,
               prefix_window_mode=mode)
    first = _generate(llm, case["shared"][:1])
    rest = _generate(llm, case["shared"][1:])
    assert first + rest == case["expected_shared"]
    # Replay recomputes part of each hit to rebuild windows; the cache still served it.
    kv = llm.engine.kv_manager.stats
    assert kv.hits + kv.replayed >= 3 * 3 * case["block_size"], kv
    assert (kv.replayed > 0) == (mode == "replay" and case["path"].rsplit("/", 1)[-1]
                                 .startswith("v4"))
    _check_idle(llm)


def test_preemption_does_not_change_outputs(case):
    # A pool far too small for 16 concurrent requests forces preemption by recompute.
    llm = _llm(case, max_num_batched_tokens=128, num_blocks_override=14, max_num_seqs=16)
    assert _generate(llm, case["prompts"]) == case["expected"]
    assert llm.engine.get_stats().num_preemptions > 0
    _check_idle(llm)


@pytest.fixture(scope="module")
def case_b(tmp_path_factory):
    """Config B has the real ratios (CSA 4, HCA 128), window 128 and 20 Sinkhorn iterations;
    prompts cross the window and produce HCA entries, one shares a 300-token prefix."""
    from models.v4_helpers import stable_topk
    model = _v4("B")
    path = save_hf(model, tmp_path_factory.mktemp("v4_B"))
    prompts = mixed_prompts(model.config.vocab_size, [290, 150, 40], seed=4)
    prompts.append(prompts[0][:260] + mixed_prompts(model.config.vocab_size, [30], seed=5)[0])
    return dict(path=str(path), block_size=256, prompts=prompts,
                expected=hf_greedy(model, prompts, MAX_NEW, stable_topk))


@pytest.mark.parametrize("budget", [100, 4096])
def test_real_ratios_match_transformers(case_b, budget):
    llm = _llm(case_b, max_num_batched_tokens=budget, enable_prefix_caching=True,
               max_num_seqs=8, kv_cache_memory=256 << 20)
    got = _generate(llm, case_b["prompts"][:3]) + _generate(llm, case_b["prompts"][3:])
    assert got == case_b["expected"]
    assert llm.engine.get_stats().prefix_hits >= 256
    _check_idle(llm)
