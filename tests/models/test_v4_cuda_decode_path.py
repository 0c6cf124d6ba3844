"""DeepSeek-V4 and V4.1 (+ DSpark taps) decode forward on the code paths it takes on CUDA
(tests/cuda_paths.py; layers/attention/v4_static.py), padded to capture sizes 1, 2 and 8 over
requests of mixed contexts: it passes CaptureGuard (worker/capture_guard.py) with the same
op trace at other contexts and tokens, reads the device 0 times (benchmarks/host_reads.py's
counter), compiles with torch.compile(fullgraph=True) and gives the batched backend's logits
for the real rows. The CPU's batched backend fails the same guard (docs/cuda_graphs.md)."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import v4_configs as v4cfg
from cuda_paths import allow_batch, force_cuda_paths
from paged_harness import PagedHarness
from v4_helpers import randomize_
from wideserve.layers import experts
from wideserve.layers.attention import v4_static
from wideserve.models.deepseek_v4.config import DeepseekV4Config
from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from wideserve.models.deepseek_v41.config import DeepseekV41Config
from wideserve.models.deepseek_v41.model import DeepseekV41ForCausalLM
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.worker.capture_guard import CaptureGuard, CaptureViolation
from wideserve.worker.model_loader import keeps_fp32

CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256
_V41 = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2,
    n_routed_experts=8, num_experts_per_tok=2, sliding_window=8, index_n_heads=4,
    index_head_dim=32, hc_mult=4, hc_sinkhorn_iters=5, rms_norm_eps=1e-6,
    engram_vocab_size=37, engram_n_heads=2, engram_head_dim=16,
    engram_compressed_vocab_size=VOCAB, engram_pad_token_id=2, dspark_noise_token_id=VOCAB - 1,
    dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, dspark_markov_rank=8,
    num_nextn_predict_layers=3, dspark_block_size=5, dtype="float32",
    rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 32})
# Every layer mode: ratio-1 and ratio-2 sources, a reindex without candidates, the candidate
# source, a reindex restricted to its candidates (2 blocks of 2 among up to 24 entries), a
# reuse; Engram at layer 0; DSpark taps.
V41 = dict(_V41, num_hidden_layers=6, compress_ratios=[1, 1, 0, 2, 2, 2, 0, 0, 0],
           kv_source_layer_ids=[0, 3], index_source_layer_ids=[0, 1, 3, 4],
           candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=2,
           index_topk=3, engram_layer_ids=[0], engram_num_embeddings=[300],
           dspark_target_layer_ids=[3, 4, 5])
PROMPTS = {1: [13], 2: [5, 14], 8: [3, 22, 9, 1, 17]}     # real requests per padded size


def v4_model() -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(v4cfg.A)).eval()
    randomize_(model, 3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():       # hash routing: k distinct experts per token id
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("tid2eid"):
                t.copy_(torch.rand(t.shape[0], 8, generator=gen).argsort(-1)[:, :t.shape[1]])
    return model


def v41_model() -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict({"text_config": V41})).eval()
    randomize_(model, 4)
    return model


def _harness(model, reqs: int) -> PagedHarness:
    specs = dict(model.kv_cache_specs())
    if isinstance(model, DeepseekV41ForCausalLM):
        specs.update(model.dspark_kv_cache_specs())
    return PagedHarness(model, max_reqs=reqs, max_len=48, block_size=8, specs=specs)


def pad_batch(batch: ForwardBatch, n: int) -> ForwardBatch:
    """The batch padded to n rows as worker/decode_capture.py pads it: token 0 at position 0
    through an all-null block-table row, writing slot 0 of the null block."""
    r = batch.num_reqs
    extra = n - r

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])
    views = [dataclasses.replace(
        v, block_table=grow(v.block_table, 0),
        slot_mapping=None if v.slot_mapping is None else grow(v.slot_mapping, 0))
        for v in batch.kv_groups]
    qsl = torch.arange(n + 1)
    return dataclasses.replace(
        batch, input_ids=grow(batch.input_ids, 0), positions=grow(batch.positions, 0),
        query_start_loc=qsl, seq_lens=grow(batch.seq_lens, 1), query_start_loc_cpu=qsl.numpy(),
        seq_lens_cpu=torch.cat([torch.from_numpy(batch.seq_lens_cpu),
                                torch.ones(extra, dtype=torch.int64)]).numpy(),
        kv_groups=views)


def _decode(model, size: int, steps: int, guard_from: int, padded: bool = True,
            run=None) -> tuple[list[torch.Tensor], list[list]]:
    """Prefill PROMPTS[size] (mixed lengths), then `steps` decode steps padded to `size`
    rows; steps >= guard_from run under one CaptureGuard made after the warm-up. Returns
    (logits of the real rows per decode step, the guarded steps' traces)."""
    g = torch.Generator().manual_seed(size)
    lens = PROMPTS[size]
    h = _harness(model, len(lens))
    slots = list(range(len(lens)))
    h.step(slots, [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens])
    guard, logits, traces = None, [], []
    for i in range(steps):
        tokens = [[int(t)] for t in torch.randint(3, VOCAB, (len(lens),), generator=g)]

        def fwd(batch: ForwardBatch) -> torch.Tensor:
            nonlocal guard
            if padded:
                batch = pad_batch(batch, size)
            if i < guard_from:
                hidden = (run or model.forward)(batch)
            else:
                guard = guard or CaptureGuard()
                allow_batch(guard, batch)
                with guard:
                    hidden = (run or model.forward)(batch)
                traces.append(guard.trace)
            return model.compute_logits(hidden[:len(lens)])
        logits.append(h.run(slots, tokens, fwd))
    return logits, traces


BUILDERS = {"v4": v4_model, "v41": v41_model}


@pytest.mark.parametrize("size", [1, 2, 8])
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_decode_forward_is_capturable(family, size, monkeypatch) -> None:
    """Forced CUDA paths, padded to `size`: two guarded decode steps (other contexts, other
    tokens, other entries completing) pass the guard with identical traces, and the real
    rows' logits equal the CPU's batched backend's, unpadded."""
    want, _ = _decode(BUILDERS[family](), size, steps=4, guard_from=99, padded=False)
    model = BUILDERS[family]()
    force_cuda_paths(monkeypatch, model)
    if size == 8:       # the indexers score the table's entries in pieces (uneven last one)
        monkeypatch.setattr(v4_static, "KEY_CHUNK", 5)
    got, traces = _decode(model, size, steps=4, guard_from=2)
    assert len(traces) == 2 and traces[0] == traces[1]
    ops = {op for op, _ in traces[0]}
    assert "aten._grouped_mm.default" in ops and "aten.index_copy_.default" in ops
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_the_guard_fails_the_host_planned_decode(family, monkeypatch) -> None:
    """The guard is not vacuous on these models: with the CUDA paths but the host-planned
    batched backend (the CPU's), the decode forward fails it."""
    model = BUILDERS[family]()
    force_cuda_paths(monkeypatch, model)
    model.set_attention_backend("batched")
    with pytest.raises(CaptureViolation):
        _decode(model, 2, steps=2, guard_from=1)


def _host_read_counter():
    spec = importlib.util.spec_from_file_location("host_reads", ROOT / "benchmarks/host_reads.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.HostReadCounter()


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_decode_forward_reads_the_device_zero_times(family, monkeypatch) -> None:
    """benchmarks/host_reads.py's counter around the decode forward: 0 reads (the batched
    backend's forward on the CPU reads the block tables through numpy)."""
    def reads(model, padded: bool) -> int:
        with _host_read_counter() as counter:
            def counted(batch: ForwardBatch) -> torch.Tensor:
                with counter.scope():           # the decode steps' forwards, not the prefill
                    return model.forward(batch)
            _decode(model, 8, steps=3, guard_from=99, padded=padded, run=counted)
        return sum(counter.inside.values())
    model = BUILDERS[family]()
    force_cuda_paths(monkeypatch, model)
    assert reads(model, True) == 0
    assert reads(BUILDERS[family](), False) > 0      # the counter sees the CPU path's reads


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_decode_forward_compiles_fullgraph(family, monkeypatch) -> None:
    """torch.compile(fullgraph=True) of the decode forward traces it as one graph (dynamo
    finds graph breaks whatever the backend; "eager" keeps it fast), once for two steps,
    with the eager logits.

    In bf16: torch._grouped_mm's shape function takes bf16 only, so layers/experts.py traces
    grouped_mm_mlp in bf16 and keeps the fp32 experts eager (docs/cuda_graphs.md)."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)   # v41_helpers turns it off
    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(gm)
        return gm.forward

    def build():
        model = BUILDERS[family]()
        for name, p in model.named_parameters():     # bf16 as the loader makes it
            if p.is_floating_point() and not keeps_fp32(type(model), name):
                p.data = p.data.to(torch.bfloat16)
        force_cuda_paths(monkeypatch, model)
        return model
    want, _ = _decode(build(), 2, steps=2, guard_from=99)
    model = build()
    compiled = torch.compile(model.decode_forward, fullgraph=True, backend=backend)
    got, _ = _decode(model, 2, steps=2, guard_from=99, run=compiled)
    torch._dynamo.reset()
    # One graph for both steps: nothing a step changes (contexts, tokens, the batch and
    # group-view objects) is guarded on, so it does not recompile per step either.
    assert len(graphs) == 1, f"{len(graphs)} graphs (0: dynamo did not run)"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_decode_capturable(monkeypatch) -> None:
    """True on CUDA for the default backend with grouped_mm experts, also under a capturable
    expert-parallel dispatcher and (V4.1) with an Engram layer (its rows staged before the
    replay); False on the CPU, for the reference backend, for experts that sync and under a
    dispatcher that is not capturable."""
    monkeypatch.setattr(experts, "_grouped_mm_runs", lambda *a: True)
    v4 = v4_model()
    assert v4.decode_capturable(CUDA) and not v4.decode_capturable(torch.device("cpu"))
    v4.set_attention_backend("reference")
    assert not v4.decode_capturable(CUDA)
    v4.set_attention_backend("static")
    layer = next(m for m in v4.modules() if isinstance(m, experts.RoutedExperts))
    layer.ep = SimpleNamespace(capturable=False)     # a dispatcher whose exchange syncs
    assert not v4.decode_capturable(CUDA)
    layer.ep = SimpleNamespace(capturable=True)      # the padded one (layers/ep_dispatch.py)
    assert v4.decode_capturable(CUDA)
    layer.ep, layer.impl, layer._resolved = None, "padded", {}
    assert not v4.decode_capturable(CUDA)
    # Engram at layer 0: capturable, its rows staged on the host before each replay.
    assert v41_model().decode_capturable(CUDA)
    no_engram = dict(V41, engram_layer_ids=[], engram_num_embeddings=[])
    v41 = DeepseekV41ForCausalLM(DeepseekV41Config.from_dict({"text_config": no_engram}))
    assert v41.decode_capturable(CUDA) and not v41.decode_capturable(torch.device("cpu"))
