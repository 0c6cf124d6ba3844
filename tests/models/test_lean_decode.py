"""The lean CPU decoder forward (models/lean_decode.py) against the module path it replaces:
bitwise the same logits and KV cache on random bf16 Qwen3-MoE and Qwen3 configs and
schedules (prefill, chunked, decode, single-token batches, sliding windows, dense layers,
biases, tied head), and the module path wherever a condition of the lean one fails."""
from __future__ import annotations

import pytest
import torch

from paged_harness import PagedHarness, schedule_steps
from wideserve.config import KernelConfig
from wideserve.kernels import choice as kernel_choice
from wideserve.kernels.choice import BUCKETS, KernelChoice, KernelPolicy
from wideserve.layers import experts as experts_mod
from wideserve.layers import linear as linear_mod
from wideserve.layers.attention import paged_attention_batched as pab
from wideserve.layers.linear import cpu_kernel_runs
from wideserve.models import lean_decode
from wideserve.models.llama.model import Qwen3Config, Qwen3ForCausalLM
from wideserve.models.qwen3_moe.model import Qwen3MoeConfig, Qwen3MoeForCausalLM

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32)
MODELS = {
    "moe-mlp-only": (Qwen3MoeForCausalLM, Qwen3MoeConfig,
                     dict(mlp_only_layers=[1], norm_topk_prob=True, attention_bias=True)),
    "moe-sparse-step-window": (Qwen3MoeForCausalLM, Qwen3MoeConfig,
                               dict(decoder_sparse_step=2, tie_word_embeddings=True,
                                    use_sliding_window=True, sliding_window=6)),
    "dense-qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16, num_hidden_layers=2)),
}
SCHEDULES = {
    "decode": [[6] + [1] * 5, [3] + [1] * 5, [9] + [1] * 5],
    "chunked": [[4, 4, 3, 1], [3, 0, 4, 1]],
    "single-decode": [[9] + [1] * 4],
}
# Whether the lean path can run here at all: it needs the bf16 GEMM micro-kernel.
LEAN_HERE = cpu_kernel_runs(torch.bfloat16)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    model_cls, config_cls, overrides = MODELS[name]
    model = model_cls(config_cls.from_dict({**BASE, **overrides})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if pname.endswith("norm.weight") else
                    0.5 * noise if pname.endswith("mlp.gate.weight") else 0.1 * noise)
    return model.to(torch.bfloat16)


class _Attention:
    """The attention family's plan, fixed (the measured one differs between machines)."""

    def __init__(self, sdpa_from: int | None) -> None:
        self.sdpa_from = sdpa_from

    def plan_attention(self, heads, kv_heads, head_dim, dtype, context=False):
        return tuple("sdpa" if self.sdpa_from is not None and lo >= self.sdpa_from else "own"
                     for lo, _ in BUCKETS)


@pytest.fixture(autouse=True)
def _attention_on_the_op(monkeypatch):
    """Whole prefills on the C++ op here unless a test says otherwise (the lean loop runs
    the op; a step the choice sends to SDPA takes the module path: tested below)."""
    monkeypatch.setattr(pab, "default_choice", lambda: _Attention(None))


@pytest.fixture
def count_lean(monkeypatch):
    calls = []
    inner = lean_decode.run_layers

    def counted(*args):
        calls.append(1)
        return inner(*args)
    monkeypatch.setattr(lean_decode, "run_layers", counted)
    return calls


def run_both(model, schedule, monkeypatch, seed=1, write_start=None):
    """The schedule through two harnesses, lean on and off; asserts equal logits per step
    and equal caches at the end."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, BASE["vocab_size"], (sum(c),), generator=g).tolist()
            for c in schedule]
    lean_h, module_h = (PagedHarness(model, max_reqs=len(seqs), max_len=40, block_size=4)
                        for _ in range(2))
    for step, slots, new in schedule_steps(schedule, seqs):
        ws = write_start(step, slots) if write_start else None
        model.model.lean_decode = True
        got = lean_h.step(slots, new, ws)
        model.model.lean_decode = False
        want = module_h.step(slots, new, ws)
        assert torch.equal(got, want), f"step {step}: logits differ"
    for name, cache in lean_h.kv_caches.items():
        assert torch.equal(cache.view(torch.int16), module_h.kv_caches[name].view(torch.int16)), \
            f"{name}: caches differ"


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(MODELS))
def test_lean_forward_is_the_module_forward_bitwise(name, schedule, monkeypatch, count_lean):
    run_both(build(name), SCHEDULES[schedule], monkeypatch)
    steps = max(len(c) for c in SCHEDULES[schedule])
    assert len(count_lean) == (steps if LEAN_HERE else 0)


def test_a_hook_on_a_bypassed_module_keeps_the_module_path(monkeypatch, count_lean):
    model = build("moe-mlp-only")
    seen = []
    handle = model.model.layers[2].self_attn.register_forward_hook(
        lambda *_: seen.append(1))
    try:
        run_both(model, SCHEDULES["single-decode"], monkeypatch)
    finally:
        handle.remove()
    assert count_lean == [] and len(seen) == 2 * 5      # both harnesses, every step


def test_a_partial_kv_write_keeps_the_module_path(monkeypatch, count_lean):
    # A bounded replay (kv_write_start) writes only the rows past it into full-attention
    # caches: the torch write, not the op's; the lean path must not take that step.
    def write_start(step, slots):
        return [2] * len(slots) if step == 0 else None
    run_both(build("moe-mlp-only"), [[7, 1, 1]], monkeypatch, write_start=write_start)
    assert len(count_lean) == (2 if LEAN_HERE else 0)


def test_fp32_weights_and_grad_mode_keep_the_module_path(count_lean):
    harness = PagedHarness(build("moe-mlp-only").float(), max_reqs=1, max_len=8, block_size=4)
    harness.step([0], [[1, 2, 3]])
    assert count_lean == []           # fp32 weights are not packed for the micro-kernel
    model = build("moe-mlp-only")
    assert torch.is_grad_enabled()
    h = torch.zeros(3, BASE["hidden_size"], dtype=torch.bfloat16)
    assert lean_decode.plan_layers(model.model, h, None, None) is None


@pytest.mark.parametrize("kernel", kernel_choice.KERNELS)
def test_lean_forward_bitwise_with_every_gemm_kernel(kernel, monkeypatch, count_lean):
    """Whichever kernel the table picks (forced here), the lean loop calls the one
    WeightPack.linear, the router and the fused experts would: bitwise the module path (and
    where nothing is packed, "torch", the module path runs)."""
    if kernel not in KernelChoice(KernelPolicy(cache_dir=None)).runnable("linear",
                                                                         torch.bfloat16):
        pytest.skip(f"{kernel} does not run on this CPU")
    forced = KernelChoice(KernelPolicy(force=kernel, cache_dir=None))
    monkeypatch.setattr(linear_mod, "default_choice", lambda: forced)
    monkeypatch.setattr(experts_mod, "default_choice", lambda: forced)
    run_both(build("moe-mlp-only"), SCHEDULES["chunked"], monkeypatch)
    # plain F.linear everywhere (nothing packed) is the module path's, as for fp32 weights
    lean = LEAN_HERE and kernel != "torch"
    assert len(count_lean) == (len(SCHEDULES["chunked"][0]) if lean else 0)


def test_sdpa_prefill_steps_take_the_module_path(monkeypatch, count_lean):
    """A step of whole prefills that the choice sends to SDPA runs the module path (which
    calls SDPA); the decode steps after it stay lean."""
    monkeypatch.setattr(pab, "default_choice", lambda: _Attention(2))
    schedule = SCHEDULES["decode"]
    run_both(build("moe-mlp-only"), schedule, monkeypatch)
    steps = max(len(c) for c in schedule)
    assert len(count_lean) == (steps - 1 if LEAN_HERE else 0)


def test_batch_invariant_decode_takes_the_lean_path_bitwise(monkeypatch, count_lean):
    """--batch-invariant (issue 27): the lean loop runs the mode's per-row expert path (its
    0.79x on Qwen3-MoE 11M was partly decode falling back to the module path), bitwise the
    module path in the mode."""
    model = build("moe-mlp-only")
    model.apply_kernel_config(KernelConfig(batch_invariant=True))
    run_both(model, SCHEDULES["decode"], monkeypatch)
    steps = max(len(c) for c in SCHEDULES["decode"])
    assert len(count_lean) == (steps if LEAN_HERE else 0)


@pytest.mark.skipif(not LEAN_HERE, reason="the lean path needs the bf16 GEMM micro-kernel")
def test_weight_streaming_queues_the_next_layers_and_changes_nothing(monkeypatch,
                                                                     count_lean):
    """With the helper running (kernels/weight_stream.py), each MoE call of the lean loop
    queues the next layer's attention weights, and the results stay the module path's."""
    from wideserve.kernels import weight_stream
    queued = []
    real = weight_stream.queue

    def queue(tensors):
        queued.append(len(tensors))
        real(tensors)
    monkeypatch.setattr(weight_stream, "queue", queue)
    model = build("moe-mlp-only")
    weight_stream.start((), min_plan=0)
    try:
        run_both(model, SCHEDULES["decode"], monkeypatch)
    finally:
        weight_stream.stop()
    assert count_lean and len(queued) == 3 * len(count_lean)     # one per layer and step
    assert weight_stream.stats().running is False
