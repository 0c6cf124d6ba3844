"""The small-batch decode path (worker/small_batch.py): decode steps of 1-4 requests over
preallocated inputs, the lean forward's plan kept across steps. Greedy outputs equal the
standard path's (LoadConfig.small_batch_decode=0) on every family while the batch grows and
shrinks, requests are aborted and preempted."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_families import FAMILIES, model_dir, vocab_size  # noqa: E402
from wideserve import LLM, SamplingParams  # noqa: E402
from wideserve.models import lean_decode  # noqa: E402
from wideserve.types.messages import EngineCoreRequest  # noqa: E402
from wideserve.layers.small_m import SmallMLinear  # noqa: E402
from wideserve.worker.small_batch import SmallBatchDecode  # noqa: E402


def _llm(path: Path, small: int, dtype: str = "float32", **kw) -> LLM:
    args = dict(dtype=dtype, load_format="dummy", max_model_len=256,
                kv_cache_memory=1 << 26, skip_tokenizer_init=True, max_num_seqs=8,
                small_batch_decode=small, seed=0)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(path), **args)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scenario(llm: LLM, vocab: int, logprobs: bool = False) -> dict[str, list]:
    """One user, then a batch that grows to five (past the path's four) and shrinks, an abort
    mid-decode and a late arrival; the tokens each request received (logprobs: with each
    token's logprob and the top 2, the floats as they came out)."""
    engine = llm.engine
    got: dict[str, list] = {}

    def add(rid: str, n: int, max_tokens: int) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=2 if logprobs else None)
        engine.add_request(EngineCoreRequest(rid, _prompt(vocab, n, len(got) + 7), sp))
        got[rid] = []

    def steps(k: int) -> None:
        for _ in range(k):
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
                lps = out.new_logprobs.sampled if logprobs and out.new_logprobs else None
                if lps is not None:
                    got[out.request_id] += list(zip(lps.token_ids, lps.logprobs))

    add("a", 9, 14)
    steps(4)
    for rid, n, m in (("b", 5, 9), ("c", 20, 5), ("d", 3, 7), ("e", 11, 6)):
        add(rid, n, m)
    steps(3)
    engine.abort_requests(["b"])
    steps(2)
    add("f", 6, 5)
    while engine.has_unfinished_requests():
        steps(1)
    assert engine.kv_manager.usage == 0.0
    engine.check_integrity()
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equal_to_the_standard_path(family: str, tmp_path: Path) -> None:
    path = model_dir(family, tmp_path)
    vocab = vocab_size(path)
    runs = {}
    for small in (0, 4):
        llm = _llm(path, small)
        runs[small] = _scenario(llm, vocab)
        path_obj = llm.engine.runner.small
        if small:
            assert isinstance(path_obj, SmallBatchDecode) and path_obj.steps >= 8
            # DeepSeek's plain linears are SmallMLinears (the default) and ran in the small
            # steps, as F.linear in fp32
            assert bool(path_obj.linears) == (family in ("v4", "v41"))
            ran = [m._small_calls[1] for m in path_obj.linears if 1 in m._small_calls]
            assert bool(ran) == bool(path_obj.linears) and all(c is None for c in ran)
        else:
            assert path_obj is None
    assert runs[4] == runs[0]
    assert len(runs[4]["a"]) == 14 and 0 < len(runs[4]["b"]) < 9


def test_preemption_equal_to_the_standard_path(tmp_path: Path) -> None:
    """A pool too small for every request: preempted requests resume (their first step
    again a prefill) and the outputs do not change."""
    path = model_dir("qwen3moe", tmp_path)
    runs, small_steps = {}, 0
    for small in (0, 4):
        llm = _llm(path, small, block_size=16, num_blocks_override=5)
        runs[small] = _scenario(llm, vocab_size(path))
        assert llm.engine.get_stats().num_preemptions > 0
        small_steps = llm.engine.runner.small.steps if small else small_steps
    assert runs[4] == runs[0] and small_steps > 0


def test_cuda_like_copies(tmp_path: Path) -> None:
    """Separate device copies of the inputs and block tables, uploaded each step as on CUDA:
    every field the model reads is uploaded (V4: ratio-1 and compressed groups)."""
    from wideserve.worker.block_tables import BlockTables
    path = model_dir("v4", tmp_path)
    base = _scenario(_llm(path, 0), vocab_size(path))
    llm = _llm(path, 0)
    runner = llm.engine.runner
    runner.tables = BlockTables(len(runner.groups), torch.device("cpu"), separate_copy=True)
    runner.small = SmallBatchDecode(runner.groups, runner.cache_group, runner.kv_caches,
                                    runner.tables, runner.device, separate_copy=True)
    assert _scenario(llm, vocab_size(path)) == base and runner.small.steps >= 8


def _count_plans(monkeypatch) -> list[int]:
    calls: list[int] = []
    plan = lean_decode._plan_layer

    def counted(*args, **kw):
        calls.append(1)
        return plan(*args, **kw)
    monkeypatch.setattr(lean_decode, "_plan_layer", counted)
    return calls


def test_lean_plan_kept_and_dropped(tmp_path: Path, monkeypatch) -> None:
    """bf16 Qwen3-MoE (the lean forward): a single user's decode steps plan the layers once;
    a block table reallocated or a hook registered later makes the next step plan again (the
    hook runs); outputs stay the standard path's."""
    path = model_dir("qwen3moe", tmp_path)
    vocab = vocab_size(path)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [{"prompt_token_ids": _prompt(vocab, 10, 1)}]
    base = _llm(path, 0, dtype="bfloat16").generate(prompt, sp, use_tqdm=False)
    llm = _llm(path, 4, dtype="bfloat16")
    calls = _count_plans(monkeypatch)
    out = llm.generate(prompt, sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    layers = len(llm.engine.model.model.layers)
    # the prefill plans for itself; the 11 decode steps share one plan
    assert len(calls) == 2 * layers, len(calls)
    calls.clear()
    small = llm.engine.runner.small
    small.tables.reserve(32, [64] * len(small.groups))        # new table tensors
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == \
        base[0].outputs[0].token_ids
    assert len(calls) == 2 * layers
    calls.clear()
    seen = []
    llm.engine.model.model.layers[0].self_attn.register_forward_hook(
        lambda *a: seen.append(1))
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == \
        base[0].outputs[0].token_ids
    assert len(seen) == 12          # the module path ran every step, hook and all


def test_config_switch(tmp_path: Path) -> None:
    path = model_dir("llama", tmp_path)
    assert _llm(path, 2).engine.runner.small.max_size == 2
    with pytest.raises(ValueError, match="small_batch_decode"):
        _llm(path, -1)
    # EPLB rewrites expert slots while serving, under a kept plan: the path is off
    assert _llm(model_dir("qwen3moe", tmp_path), 4, enable_eplb=True).engine.runner.small is None
    # small-M GEMMs by default; small_batch_gemms=False (--no-small-batch-gemms) and
    # --batch-invariant (its InvariantLinears) keep no SmallMLinear
    small = _llm(model_dir("v4", tmp_path), 4).engine.runner.small
    assert small.linears and small.mhc_sites == 2 * 4 + 2      # 4 layers and the MTP block
    for kw in ({"small_batch_gemms": False}, {"batch_invariant": True}):
        llm = _llm(model_dir("v4", tmp_path), 4, **kw)
        assert not llm.engine.runner.small.linears and not llm.engine.runner.small.mhc_sites
        assert not any(isinstance(m, SmallMLinear) for m in llm.engine.model.modules())
    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], True), (["--no-small-batch-gemms"], False)):
        assert engine_config_from_args(parser.parse_args(argv)).load.small_batch_gemms is want


@pytest.mark.parametrize("family", ["v4", "v41", "qwen3moe"])
def test_batch_invariant_bits_equal_to_the_standard_path(family: str, tmp_path: Path) -> None:
    """--batch-invariant, bf16: the small path changes no bit (greedy tokens and their
    logprobs through the scripted scenario equal the standard path's), and its plain linears
    stay the mode's nn.Linear-free kernels (no SmallMLinear: small_batch_gemms is on)."""
    path = model_dir(family, tmp_path)
    vocab = vocab_size(path)
    runs = {}
    for small in (0, 4):
        llm = _llm(path, small, dtype="bfloat16", batch_invariant=True,
                   load_format="dummy" if family == "qwen3moe" else "auto")
        runs[small] = _scenario(llm, vocab, logprobs=True)
        if small:
            assert llm.engine.runner.small.steps >= 8 and not llm.engine.runner.small.linears
    assert runs[4] == runs[0]
    assert sum(isinstance(x, tuple) for x in runs[4]["a"]) == 14       # the logprobs compared


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_small_m_gemms_trained_bf16(family: str, tmp_path: Path, monkeypatch) -> None:
    """The bundled trained DeepSeek-V4 / V4.1 in bf16 (the CPU's serving dtype): in a small
    step their plain linears run the kernel table's small-M GEMMs (layers/small_m.py), the
    grouped o_a projection its per-group GEMMs and every decoder mHC site the fused op
    (kernels/mhc.py); greedy outputs equal the standard path's (F.linear / bmm / torch mHC)
    through the scripted scenario (trained weights have no near tie there; on random
    weights the ulp they can differ by flips a greedy token, docs/host_path.md)."""
    from wideserve.kernels import mhc as fused_mhc
    fused_rows: list[int] = []
    real = fused_mhc.coeffs
    monkeypatch.setattr(fused_mhc, "coeffs",
                        lambda x, *a: fused_rows.append(x.shape[0]) or real(x, *a))
    path = model_dir(family, tmp_path)
    vocab = vocab_size(path)
    runs = {}
    for small in (0, 4):
        fused_rows.clear()
        llm = _llm(path, small, dtype="bfloat16", load_format="auto",
                   small_batch_gemms=bool(small))
        runs[small] = _scenario(llm, vocab)
        sites = 2 * len(llm.engine.model.model.layers)
        assert len(fused_rows) == (sites * llm.engine.runner.small.steps if small else 0)
        assert all(1 <= r <= 4 for r in fused_rows)
        linears = [m for m in llm.engine.model.modules() if isinstance(m, torch.nn.Linear)]
        if not small:
            assert all(type(m) is torch.nn.Linear for m in linears)
            continue
        path_obj = llm.engine.runner.small
        assert path_obj.linears and len(path_obj.linears) == len(linears)
        ran = [m for m in path_obj.linears if 1 in m._small_calls]
        # the main model's bf16 linears (not the unused MTP / DSpark blocks) ran packed
        # GEMMs; V4.1's fp32 compressor projections F.linear
        kept = [m._small_calls[1] for m in ran if m.weight.dtype == torch.bfloat16]
        assert len(kept) >= 30 and all(c is not None and c.kernel != "torch" for c in kept)
        assert all(m._small_calls[1] is None for m in ran if m.weight.dtype == torch.float32)
        assert any(m._small_groups for m in path_obj.linears)     # the grouped o_a
    assert runs[4] == runs[0]


def test_small_m_linear_scope(tmp_path: Path) -> None:
    """A SmallMLinear is F.linear outside a small step (bitwise), the table's packed GEMM
    inside one for bf16 (close to F.linear), F.linear for fp32 even inside; grouped_linear
    likewise against the bmm; forget() picks up rewritten weights."""
    from wideserve.layers.small_m import GemmScope, grouped_linear, use_small_m_linears
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False),
                                torch.nn.Linear(64, 32)).to(torch.bfloat16)
    scope = GemmScope()
    lin, biased = use_small_m_linears(model, scope)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    g = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, lin.weight)
    ref_b = torch.nn.functional.linear(x, biased.weight, biased.bias)
    ref_g = torch.bmm(g, lin.weight.view(2, 48, 64).transpose(1, 2))
    with torch.inference_mode():
        assert torch.equal(lin(x), ref) and torch.equal(grouped_linear(lin, g, 2), ref_g)
        scope.on = True
        assert torch.allclose(lin(x).float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(biased(x).float(), ref_b.float(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(grouped_linear(lin, g, 2).float(), ref_g.float(), atol=2e-2,
                              rtol=2e-2)
        assert lin._small_calls[3] is not None and lin._small_groups[(2, 3)] is not None
        lin.weight.data.mul_(2)      # kept GEMMs hold the old packed copy until forget()
        lin.forget()
        assert torch.allclose(lin(x).float(), 2 * ref.float(), atol=4e-2, rtol=2e-2)
        wide = torch.nn.Linear(64, 8).float()
        use_small_m_linears(wide, scope)
        xf = x.float()
        assert torch.equal(wide(xf), torch.nn.functional.linear(xf, wide.weight, wide.bias))
    use_small_m_linears(model, None)
    assert type(model[0]) is torch.nn.Linear and lin(x).dtype == torch.bfloat16
