"""The captured decode step (worker/decode_capture.py) on the CPU: decode batches padded to
capture sizes and run over static buffers ("replayed" eagerly: the CUDA graph capture itself
needs a GPU). Greedy outputs equal the eager path's across batch-size changes, preemption,
prefix hits and speculative decoding; padded rows write nothing but the null block."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from oracle import mixed_prompts, save_hf
from test_engine_greedy import _qwen3_moe
from wideserve import LLM, SamplingParams
from wideserve.worker.decode_capture import (CPU_DEFAULT, CapturedDecode, capture_sizes,
                                             context_buckets, decode_capture_enabled, padded_size)

LENGTHS = [3, 9, 17, 30, 41, 5, 12, 27]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(64) == (1, 2, 4, *range(8, 65, 8))
    assert capture_sizes(1000)[-1] == 512
    sizes = capture_sizes(20)
    assert sizes == (1, 2, 4, 8, 16, 20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == \
        [1, 4, 8, 16, 20, 20, None]


def test_enforce_eager_turns_it_off() -> None:
    def on(eager, capture, device, capturable=True):
        return decode_capture_enabled(eager, capture, device, capturable)
    assert on(None, None, CPU) is CPU_DEFAULT                  # measured (BENCHMARKS.md)
    assert on(None, None, CUDA) and on(False, None, CUDA)      # a capturable model on CUDA
    assert not on(None, None, CUDA, capturable=False)          # nothing to capture: eager
    assert not on(True, None, CUDA) and not on(True, None, CPU)    # --enforce-eager
    assert on(None, True, CPU, capturable=False) and not on(None, False, CUDA)
    with pytest.raises(ValueError, match="enforce_eager"):
        on(True, True, CPU)


def _v4():
    from models import v4_configs
    from models.v4_helpers import hf_model
    return hf_model(v4_configs.A, seed=3)


@pytest.fixture(scope="module", params=["qwen3_moe", "v4_A"])
def model_path(request, tmp_path_factory) -> str:
    model = _qwen3_moe() if request.param == "qwen3_moe" else _v4()
    return str(save_hf(model, tmp_path_factory.mktemp(request.param)))


def _llm(path: str, capture: bool, **kw) -> LLM:
    args = dict(dtype="float32", block_size=16, kv_cache_memory=1 << 26,
                skip_tokenizer_init=True, max_num_seqs=6, decode_capture=capture)
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, **args)


def _watch(llm: LLM) -> list[tuple[int, int]]:
    """Record (real rows, padded size) of every captured step."""
    cap = llm.engine.runner.captured
    assert isinstance(cap, CapturedDecode)
    calls: list[tuple[int, int]] = []
    run = cap.run

    def counted(reqs, n):
        calls.append((len(reqs), n))
        return run(reqs, n)
    cap.run = counted
    return calls


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # Different lengths: requests finish at different steps, so the batch shrinks.
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.usage == 0.0


def test_greedy_equal_with_batch_changes_preemption_and_prefix_hits(model_path) -> None:
    prompts = mixed_prompts(160, LENGTHS, seed=1)
    shared = mixed_prompts(160, [4, 11, 23, 7], seed=2, shared_prefix=3 * 16 + 5)
    runs = {}
    for capture in (False, True):
        plain = _llm(model_path, capture, max_num_batched_tokens=64)
        calls = _watch(plain) if capture else []
        out = _generate(plain, prompts)
        out += _generate(plain, shared[:1]) + _generate(plain, shared[1:])
        assert plain.engine.get_stats().prefix_hits >= 3 * 3 * 16
        _idle(plain)
        tight = _llm(model_path, capture, max_num_batched_tokens=64, num_blocks_override=8)
        out += _generate(tight, prompts)
        assert tight.engine.get_stats().num_preemptions > 0
        _idle(tight)
        runs[capture] = out
        if capture:
            assert plain.engine.runner.captured.sizes == (1, 2, 4, 6)
            padded = {n for r, n in calls if n > r}
            assert len({n for _, n in calls}) >= 3 and padded, calls
    assert runs[True] == runs[False]


def test_cuda_like_copies(model_path) -> None:
    """Separate device copies of the static buffers and block tables (uploaded each step, as on
    CUDA) give the same greedy outputs: every field the model reads is uploaded."""
    from wideserve.worker.block_tables import BlockTables
    from wideserve.worker.decode_capture import StaticDecodeInputs
    prompts = mixed_prompts(160, LENGTHS, seed=5)
    base = _generate(_llm(model_path, False), prompts)
    llm = _llm(model_path, False)
    runner = llm.engine.runner
    runner.tables = BlockTables(len(runner.groups), CPU, separate_copy=True)
    cap = runner.enable_decode_capture((1, 2, 4, 6), 512)
    cap.inputs = StaticDecodeInputs(6, cap.slot_groups, CPU, separate_copy=True)
    calls = _watch(llm)
    assert _generate(llm, prompts) == base
    assert any(n > r for r, n in calls)
    _idle(llm)


class _GraphLike:
    """A capturer with a CUDA graph's contract, on the CPU: run once at capture; a replay
    recomputes from the static buffers' current contents into the same output tensor."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def capture(self, run):
        out = run()
        self.captured.append(out.shape[0])

        def replay():
            out.copy_(run())
            return out
        return replay


def test_capture_at_startup_and_the_reallocation_fallback(model_path, caplog) -> None:
    """The graph path's bookkeeping: every size captured at startup (largest first) over
    reserved block tables that keep their tensors, replays read the static output, and a table
    reallocated later sends the runner back to eager replays with the same outputs."""
    import logging
    prompts = mixed_prompts(160, LENGTHS, seed=6)
    base = _generate(_llm(model_path, False), prompts)
    llm = _llm(model_path, False)
    graphs = _GraphLike()
    cap = llm.engine.runner.enable_decode_capture((1, 2, 4, 6), 512, capturer=graphs)
    assert graphs.captured == [6, 4, 2, 1]
    calls = _watch(llm)
    assert _generate(llm, prompts) == base
    assert cap.capturer is graphs and any(n > r for r, n in calls)
    _idle(llm)
    cap.tables.reserve(64, [100] * len(cap.groups))          # new table tensors
    with caplog.at_level(logging.WARNING):
        assert _generate(llm, prompts) == base
    assert "reallocated" in caplog.text and cap.capturer is not graphs
    _idle(llm)


def test_context_buckets(model_path) -> None:
    """Graphs per size and context bucket (max_model_len, / 4, ... >= 1024): a step replays
    the smallest bucket holding its longest context, over block tables narrowed to it (views
    of the reserved tensors), with the eager outputs."""
    assert context_buckets(512) == (512,) and context_buckets(1000) == (1000,)
    assert context_buckets(4096) == (1024, 4096)
    assert context_buckets(40960) == (2560, 10240, 40960)
    prompts = mixed_prompts(160, LENGTHS, seed=8)
    base = _generate(_llm(model_path, False), prompts)
    llm = _llm(model_path, False)
    graphs = _GraphLike()
    cap = llm.engine.runner.enable_decode_capture((1, 2, 4, 6), 4096, capturer=graphs)
    assert cap.buckets == (1024, 4096) and graphs.captured == [6, 6, 4, 4, 2, 2, 1, 1]
    assert cap.num_replays == 8
    widths = []
    forward = llm.engine.model.forward

    def seen(batch):
        widths.append({v.block_table.shape[1] for v in batch.kv_groups})
        return forward(batch)
    llm.engine.model.forward = seen
    assert _generate(llm, prompts) == base
    full = {cap.tables.device_table(g).shape[1] for g in range(len(cap.groups))}
    assert {1024 // lay.block_size for lay in cap.groups} in widths      # replays: narrowed
    assert max(max(w) for w in widths) >= max(full) > 1024 // 16       # eager prefills: whole
    _idle(llm)


def _copy_caches(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy that keeps the aliasing: the caches of a page-size bucket share one slab."""
    slabs: dict[int, torch.Tensor] = {}
    out = {}
    for name, v in caches.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr not in slabs:
            slabs[ptr] = v.view(torch.uint8).reshape(-1).clone()
        out[name] = slabs[ptr].view(v.dtype).view(v.shape)
    return out


def test_padded_rows_write_only_the_null_block(model_path) -> None:
    """Each captured step, against the eager forward of the same requests on a copy of the
    caches: every entry outside the null block ends equal (the same entries changed, to the
    same values), and the block pool is untouched."""
    llm = _llm(model_path, True)
    runner, kv = llm.engine.runner, llm.engine.kv_manager
    cap = runner.captured
    run, seen = cap.run, []

    def checked(reqs, n):
        before = _copy_caches(runner.kv_caches)
        eager = runner.build_batch(reqs)
        eager.kv_caches = _copy_caches(runner.kv_caches)
        with torch.inference_mode():
            runner.model.forward(eager)
        used, free = kv.usage, kv.num_free_blocks
        out = run(reqs, n)
        assert (kv.usage, kv.num_free_blocks) == (used, free)
        for name, cache in runner.kv_caches.items():
            want, old = eager.kv_caches[name][1:], before[name][1:]
            assert torch.equal(cache[1:] != old, want != old), name
            torch.testing.assert_close(cache[1:], want, atol=1e-5, rtol=1e-4)
        seen.append((len(reqs), n))
        return out
    cap.run = checked
    _generate(llm, mixed_prompts(160, LENGTHS[:5], seed=3))
    assert any(n > r for r, n in seen), seen
    _idle(llm)


def test_speculative_decoding_composes(tmp_path) -> None:
    """Draft-model speculation with a budget that allows drafts at <= 3 requests only: steps
    without drafts run captured, verification steps eagerly; outputs equal no speculation."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=False)).eval()
    path = str(save_hf(model, tmp_path / "llama"))
    prompts = [[(7 * i + j) % 60 + 2 for j in range(5 + i)] for i in range(6)]
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
            "batch_token_budget": 9}
    base = _generate(_llm(path, False), prompts)
    llm = _llm(path, True, speculative_config=spec)
    calls = _watch(llm)
    assert _generate(llm, prompts) == base
    assert any(n > r for r, n in calls)
    assert llm.engine.get_stats().spec_decode.num_drafts > 0
    _idle(llm)


def test_block_tables_reserve_keeps_the_tables() -> None:
    from wideserve.worker.block_tables import BlockTables
    t = BlockTables(2, CPU, rows=2, separate_copy=True)
    pad = t.reserve_row()
    t.reserve(9, [5, 40])
    tables = [t.device_table(g) for g in range(2)]
    rows = [t.update(f"r{i}", [list(range(1, 6)), list(range(1, 41))]) for i in range(8)]
    assert all(t.device_table(g) is tables[g] for g in range(2))
    assert not t.host(0)[pad].any() and not t.host(1)[pad].any()
    assert np.array_equal(t.device_table(1).numpy()[rows[3]], np.arange(1, 41))


def test_the_cuda_decode_path_replays_as_captured(tmp_path, monkeypatch) -> None:
    """Qwen3-MoE on the code paths it takes on CUDA (tests/cuda_paths.py), every size
    "captured" by GuardedCapturer: each replay passes the capture guard and records the op and
    shape trace of its capture (other contexts, tokens, rows: what a graph replays), and the
    greedy outputs equal the default eager engine's."""
    from cuda_paths import force_cuda_paths
    from wideserve.worker.capture_guard import GuardedCapturer
    path = str(save_hf(_qwen3_moe(), tmp_path / "qwen3_moe"))
    prompts = mixed_prompts(160, LENGTHS, seed=7)
    base = _generate(_llm(path, False), prompts)
    llm = _llm(path, False)
    force_cuda_paths(monkeypatch, llm.engine.model)
    guarded = GuardedCapturer()
    cap = llm.engine.runner.enable_decode_capture((1, 2, 4, 6), 4096, capturer=guarded)
    assert len(guarded.traces) == 8 and cap.buckets == (1024, 4096)     # sizes x buckets
    calls = _watch(llm)
    assert _generate(llm, prompts) == base
    assert guarded.replays == len(calls) and any(n > r for r, n in calls)
    _idle(llm)


def test_the_gpu_check_script_runs_its_cpu_flow(capsys) -> None:
    """benchmarks/cuda_graph_check.py (the check prepared for a GPU) on the CPU: the eager and
    the captured-step runs, equal greedy tokens, one JSON line per run and batch size."""
    import importlib.util
    import json
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_graph_check.py"
    spec = importlib.util.spec_from_file_location("cuda_graph_check", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--dtype", "float32", "--batches", "1,3",
                        "--max-tokens", "5", "--max-num-seqs", "4", "--prompt-len", "9"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in lines if "batch" in r]
    assert {(r["run"], r["batch"]) for r in rows} == {(run, b) for run in ("eager", "graphs")
                                                      for b in (1, 3)}
    assert all(r["greedy_equal_to_eager"] and r["steps"] == 5 for r in rows)
    assert lines[-1] == {"result": "OK"}


def test_cuda_graph_capturer_protocol(monkeypatch) -> None:
    """CudaGraphCapturer against a stand-in torch.cuda that logs the calls (the CPU cannot
    capture): warm-up runs on a side stream, then one run inside torch.cuda.graph; the first
    graph's pool is handed to every later capture; a replay is graph.replay() returning the
    captured output, without running the forward."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from wideserve.worker.decode_capture import CudaGraphCapturer
    log: list = []

    class Stream:
        def __init__(self, device=None):
            self.name = "side" if device is not None else "main"

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    class Graph:
        def __init__(self):
            self.id = sum(1 for e in log if e[0] == "graph")

        def pool(self):
            return ("pool", self.id)

        def replay(self):
            log.append(("replay", self.id))

    @contextmanager
    def stream(s):
        log.append(("on", s.name))
        yield

    @contextmanager
    def graph(g, pool=None):
        log.append(("graph", g.id, pool))
        yield
        log.append(("end", g.id))

    fake = SimpleNamespace(Stream=Stream, current_stream=lambda device=None: Stream(),
                           stream=stream, CUDAGraph=Graph, graph=graph)
    monkeypatch.setattr(torch, "cuda", fake)
    runs = []

    def forward(tag):
        def run():
            runs.append(tag)
            log.append(("run", tag))
            return torch.full((2,), float(len(runs)))
        return run

    cap = CudaGraphCapturer(torch.device("cpu"), warmup=2)
    big, small = cap.capture(forward("big")), cap.capture(forward("small"))
    graphs = [e for e in log if e[0] == "graph"]
    assert graphs == [("graph", 0, None), ("graph", 1, ("pool", 0))]
    first = log[:log.index(("graph", 0, None)) + 3]
    assert first == [("wait", "side", "main"), ("on", "side"), ("run", "big"), ("run", "big"),
                     ("wait", "main", "side"), ("graph", 0, None), ("run", "big"), ("end", 0)]
    n = len(runs)
    out = big()
    assert len(runs) == n and log[-1] == ("replay", 0) and torch.equal(out, torch.full((2,), 3.0))
    assert small() is not out and log[-1] == ("replay", 1)
