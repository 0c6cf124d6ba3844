"""DeepSeek-V4.1 against its reference implementation (nemo-automodel 0.7.0, fp32) on tiny
configs covering every layer mode (swa / full / reindex / reuse, ratios 1 and 2), Engram and
both indexer levels (v41_helpers.py).

Two regimes, both with two requests sharing every step. quant="off": both sides' KV
quantisers are the identity: |dlogit| <= 1e-4 (TOL). quant="on": the same FP8 / NVFP4 / MXFP4
records as the reference. The maths agree to ~1e-6 before rounding, but a value that sits on a
rounding boundary (fp32 last bits differ with op order and matmul shapes) lands in the
neighbouring bin, ~6% of one channel of one FP8 record, and that moves later logits by up to
~1e-2 (seen: 1.2e-3 and 1.04e-2, logits std ~1.2); most runs stay within 1e-6. So with
quantisers on the bound is TOL_QUANT = 3e-2, still ~100x below what any real error gives (a
dropped candidate mask, Engram or reuse moves logits by 1-9 here). The records themselves are
bit-equal to the reference's quantisers (tests/layers/test_kv_quant.py).

Runs go through the paged harness with poison on (out-of-window sliding entries are NaN), so
a read outside a window or the compressor state's window fails loudly."""
from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch
import v41_helpers as h
from paged_harness import PagedHarness
from safetensors.torch import save_file

from wideserve.config import CacheConfig
from wideserve.kv_cache import allocate_kv_tensors, build_kv_cache_config
from wideserve.kv_cache.spec import SharedKVSpec
from wideserve.layers.attention import v41_batched

TOL = 1e-4
TOL_QUANT = 3e-2
# config -> (lengths of the two requests, prefill chunk plans not multiples of the ratios or
# candidate blocks; the rest of each request is decoded one token per step, both together).
CASES = {"A": ((41, 30), ([5, 7, 3, 11], [9, 2, 6])),
         "B": ((33, 26), ([3, 9], [5, 1, 4])),
         "C": ((38, 23), ([7, 5], [3]))}
LENGTHS = {**{name: case[0] for name, case in CASES.items()}, "D": (60, 44)}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    cache: dict[tuple, tuple] = {}

    def get(name: str, quant: str = "on"):
        if name not in cache:
            kw = h.CONFIGS[name]
            m = h.oracle_model(kw, seed=len(cache))
            path = h.save_checkpoint(m, kw, tmp_path_factory.mktemp(f"v41_{name}"))
            seqs = [h.random_tokens(n, seed=10 + i) for i, n in enumerate(LENGTHS[name])]
            refs = {"on": [h.oracle_logits(m, s) for s in seqs]}
            with h.kv_quant_off():
                refs["off"] = [h.oracle_logits(m, s) for s in seqs]
            assert all(r.std() > 0.3 for r in refs["on"]), "logits too flat for a check"
            cache[name] = (m, path, h.ws_model(path), seqs, refs)
        m, path, ws, seqs, refs = cache[name]
        return m, path, ws, seqs, refs[quant]
    return get


def _maybe_off(quant: str):
    return h.kv_quant_off() if quant == "off" else contextlib.nullcontext()


def _harness(model, seqs, kv: str = "auto") -> PagedHarness:
    """kv: the kv_cache_dtype; "auto" packs the reference's records, "raw" stores values."""
    return PagedHarness(model, max_reqs=len(seqs), max_len=max(map(len, seqs)) + 4,
                        specs=model.kv_cache_specs(kv))


def _kv(quant: str) -> str:
    return "raw" if quant == "off" else "auto"


@pytest.mark.parametrize("quant", ["off", "on"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_oneshot_prefill(oracle, name, quant):
    _, _, ws, seqs, refs = oracle(name, quant)
    with _maybe_off(quant):
        out = _harness(ws, seqs, _kv(quant)).step([0, 1], seqs)
    assert out.dtype == torch.float32
    assert (out - torch.cat(refs)).abs().max().item() <= (TOL if quant == "off" else TOL_QUANT)


@pytest.mark.parametrize("quant", ["off", "on"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_prefill_then_decode(oracle, name, quant):
    _chunked_then_decode(oracle, name, quant, CASES[name][1])


def test_reindex_scores_only_the_candidate_blocks(oracle, monkeypatch):
    """Config D: the candidate source keeps 6 of up to 60 visible entries; the Reindex layer
    after it gathers and scores only those (asserted: narrower than what its queries see) and
    its picks, and everything after them, equal the reference's masked top-k. The candidate
    source scores its entries in pieces of 7 (the shorter request's unwritten rows included)."""
    widths = []
    real = v41_batched._candidate_entries

    def spy(cands, block_size, visible):
        ids = real(cands, block_size, visible)
        widths.append((ids.shape[-1], int(visible.max())))
        return ids
    monkeypatch.setattr(v41_batched, "_candidate_entries", spy)
    # The candidate source scores its keys 7 entries at a time (pieces, _entry_scores).
    monkeypatch.setattr(v41_batched, "KEY_CHUNK", 7)
    _chunked_then_decode(oracle, "D", "off", ([13, 6], [5, 11]))
    assert widths and all(w == 6 for w, _ in widths)
    assert max(seen for _, seen in widths) == 60
    # One-shot prefill: blocks of 32 queries, each gathering its own candidates' keys, here
    # one query slot at a time (the split that bounds a long block's gathered keys).
    monkeypatch.setattr(v41_batched, "CHUNK_ELEMENTS", 1)
    _, _, ws, seqs, refs = oracle("D", "off")
    with h.kv_quant_off():
        out = _harness(ws, seqs, "raw").step([0, 1], seqs)
    assert (out - torch.cat(refs)).abs().max().item() <= TOL


@pytest.mark.parametrize("per_query", [False, True])
def test_index_scores_in_place_equal_the_plain_expression(per_query):
    """_index_scores applies relu and the head weights in place: bit-equal to the plain
    sum_h relu(q_h . k) * w_h (keys per block, or per query as candidate scoring gathers)."""
    g = torch.Generator().manual_seed(3)
    q, w = torch.randn(3, 5, 4, 16, generator=g), torch.randn(3, 5, 4, generator=g)
    keys = torch.randn(*((3, 5, 37, 16) if per_query else (3, 37, 16)), generator=g)
    spec = "cqhd,cqkd->cqhk" if per_query else "cqhd,ckd->cqhk"
    want = (torch.einsum(spec, q, keys).relu() * w[..., None]).sum(dim=2)
    assert torch.equal(v41_batched._index_scores(q, w, keys), want)


def _chunked_then_decode(oracle, name: str, quant: str, plans) -> None:
    _, _, ws, seqs, refs = oracle(name, quant)
    steps = [list(p) + [1] * (len(s) - sum(p)) for p, s in zip(plans, seqs)]
    groups = [[0, 1]]
    worst = 0.0
    with _maybe_off(quant):
        for group in groups:
            hr = _harness(ws, seqs, _kv(quant))
            done = [0, 0]
            for i in range(max(len(steps[r]) for r in group)):
                slots = [r for r in group if i < len(steps[r])]
                chunks = [seqs[r][done[r]:done[r] + steps[r][i]] for r in slots]
                out = hr.step(slots, chunks)
                row = 0
                for r, chunk in zip(slots, chunks):
                    ref = refs[r][done[r]:done[r] + len(chunk)]
                    worst = max(worst, (out[row:row + len(chunk)] - ref).abs().max().item())
                    row += len(chunk)
                    done[r] += len(chunk)
            assert all(done[r] == len(seqs[r]) for r in group)
    assert worst <= (TOL if quant == "off" else TOL_QUANT)


def test_packed_records_give_the_same_logits_as_stored_values(oracle):
    """Packed FP8 / NVFP4 / MXFP4 records (uint8 caches) read back exactly the quantised
    values that a float cache stores, in bf16 or fp32: logits are bit-identical."""
    _, _, ws, seqs, _ = oracle("A")
    plan = [5, 7, 3, 11] + [1] * (len(seqs[0]) - 26)
    outs = {}
    for kv in ("auto", "raw", "bf16"):
        hr, done, rows = _harness(ws, seqs[:1], kv), 0, []
        for n in plan:
            rows.append(hr.step([0], [seqs[0][done:done + n]]))
            done += n
        outs[kv] = torch.cat(rows)
    assert hr.kv_caches["model.layers.2.attn.compressed"].dtype == torch.bfloat16
    assert torch.equal(outs["auto"], outs["raw"]) and torch.equal(outs["auto"], outs["bf16"])


def _official_state(m) -> dict[str, torch.Tensor]:
    """The oracle's state_dict under the official DeepSeek names (its state-dict adapter's
    mapping), routed experts split per expert into w1 / w3 [I, d] and w2 [d, I]."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import _released_key
    out = {}
    for name, t in m.state_dict().items():
        if name.endswith(".ffn.experts.gate_and_up_projs"):
            base = _released_key(name).removesuffix(".gate_and_up_projs")
            inter = t.shape[2] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w1.weight"] = t[e, :, :inter].T.contiguous()
                out[f"{base}.{e}.w3.weight"] = t[e, :, inter:].T.contiguous()
        elif name.endswith(".ffn.experts.down_projs"):
            base = _released_key(name).removesuffix(".down_projs")
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w2.weight"] = t[e].T.contiguous()
        else:
            out[_released_key(name)] = t.contiguous()
    return out


def test_official_names_load_the_same_model(oracle, tmp_path):
    m, path, ws, seqs, refs = oracle("A")
    state = _official_state(m)
    assert "embed.weight" in state and "layers.6.hc_attn_fn" in state
    assert "layers.3.ffn.experts.7.w2.weight" in state and "layers.2.attn.attn_sink" in state
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / f).write_text((path / f).read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    out = _harness(h.ws_model(tmp_path), seqs[:1]).step([0], seqs[:1])
    assert (out - refs[0]).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="unknown weight 'layers.0.attn.nonsense'"):
        ws.load_weights([("layers.0.attn.nonsense", torch.zeros(1))])


def test_shared_records_are_allocated_and_counted_once(oracle):
    _, _, ws, _, _ = oracle("A")
    specs = ws.kv_cache_specs("raw")
    shared = {n: s.owner for n, s in specs.items() if isinstance(s, SharedKVSpec)}
    # Reuse / reindex layers 3, 5, 7, 8, 9 read the sources 2, 4, 6; layers 0, 1 are SWA.
    assert shared == {f"model.layers.{i}.attn.compressed": f"model.layers.{s}.attn.compressed"
                      for i, s in ((3, 2), (5, 4), (7, 6), (8, 6), (9, 6))}
    assert sum(n.endswith(".window") for n in specs) == 10
    assert sorted(int(re.search(r"\d+", n)[0]) for n in specs if n.endswith("indexer_keys")) \
        == [2, 4, 6]
    cfg = build_kv_cache_config(specs, CacheConfig(block_size=16, kv_cache_memory=1 << 24))
    c = ws.config
    # fp32 raw records: 2 sources at ratio 2, 1 at ratio 1 -> 2 entries/token of (64 + 32) * 4 B.
    assert cfg.bytes_per_token == {"compressed": 2 * c.head_dim * 4,
                                   "indexer": 2 * c.index_head_dim * 4}
    packed = build_kv_cache_config(ws.kv_cache_specs(), CacheConfig(block_size=16,
                                                                   kv_cache_memory=1 << 24))
    # NVFP4 entry: 32 code bytes + 4 E4M3 scales; MXFP4 key: 16 + 1 UE8M0; FP8 window 64 + 2.
    assert packed.bytes_per_token == {"compressed": 2 * 36, "indexer": 2 * 17}
    assert packed.bounded_bytes_per_request["window"] == 10 * c.sliding_window * 66
    caches = allocate_kv_tensors(cfg, "cpu")
    for name, owner in shared.items():
        assert caches[name] is caches[owner] and cfg.cache_group[name] == cfg.cache_group[owner]
    with pytest.raises(ValueError, match="not a cache of its own"):
        build_kv_cache_config({**specs, "x": SharedKVSpec("nope")}, CacheConfig(block_size=16))


def test_dummy_weights_from_the_config(oracle):
    from wideserve.config import LoadConfig
    from wideserve.worker.model_loader import load_model
    _, path, _, seqs, _ = oracle("C")
    model = load_model(LoadConfig(model=str(path), load_format="dummy", seed=3)).model
    out = _harness(model, seqs[:1]).step([0], seqs[:1])
    assert torch.isfinite(out).all() and out.std() > 0.1


def _replay_run(ws, seqs, plan, on: bool) -> list[torch.Tensor]:
    """plan: steps of (tokens of request 0, of request 1, rows read of each: None = every
    row). -> per step, the logits of the rows read (the last `need` of each request)."""
    ws.decoder_replay = on
    hr, done, outs = _harness(ws, seqs, "raw"), [0, 0], []
    try:
        for n0, n1, need in plan:
            toks = [seqs[r][done[r]:done[r] + n] for r, n in enumerate((n0, n1))]
            need_rows = np.array([len(t) if k is None else k for t, k in zip(toks, need)])

            def fn(batch, need_rows=need_rows):
                batch.num_output_rows_cpu = need_rows
                return ws.compute_logits(ws.forward(batch))
            logits = hr.run([0, 1], toks, fn)
            ends = np.cumsum([len(t) for t in toks])
            outs.append(torch.cat([logits[e - k:e] for e, k in zip(ends, need_rows)]))
            done = [d + len(t) for d, t in zip(done, toks)]
    finally:
        ws.decoder_replay = False
    return outs


# Config A (layers 6-9 from the last KV source on, window 8: 8 + 3 * 7 = 29 rows at layer 6):
# a 33-row prefill beside a 25-row chunk read whole (prompt logprobs), then a chunk read by
# nobody, then both decode. Config C: a ratio-2 last source (compressor state), 3 layers.
REPLAY_PLANS = {"A": [(33, 25, (1, None)), (4, 4, (0, 1)), (1, 1, (1, 1)), (1, 0, (1, 0))],
                "C": [(30, 20, (1, 0)), (1, 3, (1, 1)), (1, 0, (1, 0))]}


def _refs_of(refs, plan) -> list[torch.Tensor]:
    done, out = [0, 0], []
    for n0, n1, need in plan:
        rows = []
        for r, n in enumerate((n0, n1)):
            k = n if need[r] is None else need[r]
            rows.append(refs[r][done[r] + n - k:done[r] + n])
            done[r] += n
        out.append(torch.cat(rows))
    return out


@pytest.mark.parametrize("name", sorted(REPLAY_PLANS))
def test_decoder_bounded_replay_is_exact(oracle, monkeypatch, name):
    """The decoder bounded replay (models/deepseek_v41/replay.py) runs the last KV source and
    the layers after it on fewer rows of a long step (here down to 29 of 33 at the source and
    8 at the last layer) and changes nothing that is read: the sampled rows, every row of a
    request read whole, and the windows the next chunk and the decode steps read equal the
    reference (1e-4) and the full run (1e-5), in fp32 with the quantisers off."""
    from wideserve.models.deepseek_v41 import model as v41_model
    _, _, ws, seqs, refs = oracle(name, "off")
    plan, stages = REPLAY_PLANS[name], []

    def record(*args, **kw):
        replay = v41_model.plan_decoder_replay.__wrapped__(*args, **kw)
        stages.append(None if replay is None else
                      {i: s.batch.num_tokens for i, s in replay.stages.items()})
        return replay
    record.__wrapped__ = v41_model.plan_decoder_replay
    monkeypatch.setattr(v41_model, "plan_decoder_replay", record)
    with h.kv_quant_off():
        full = _replay_run(ws, seqs, plan, False)
        got = _replay_run(ws, seqs, plan, True)
    # Rows per stage of the first step (request 0's, then request 1's kept rows).
    assert stages[0] == ({6: 29 + 25, 7: 22 + 25, 8: 15 + 25, 9: 8 + 25} if name == "A" else
                         {4: 22 + 20, 5: 15 + 15, 6: 8 + 8})
    for a, b, ref in zip(got, full, _refs_of(refs, plan)):
        assert (a - ref).abs().max().item() <= TOL
        assert (a - b).abs().max().item() <= 1e-5


def test_decoder_bounded_replay_in_a_prefix_replay(oracle):
    """A prefix-cache hit in replay mode (positions 10..49 recomputed to rebuild windows,
    entries cached below 50) with the decoder replay cutting rows (29 of 50 at the source of
    config D): the last row equals the run without the decoder replay (1e-5) and, 35 = 5 layers
    x 7 rows past the replay start, the reference."""
    _, _, ws, seqs, refs = oracle("D", "off")
    out = {}
    with h.kv_quant_off():
        for on in (False, True):
            ws.decoder_replay = on
            try:
                hr = _harness(ws, seqs[:1], "raw")

                def fn(batch):
                    batch.num_output_rows_cpu = np.array([1])
                    return ws.compute_logits(ws.forward(batch))[-1]
                hr.run([0], [seqs[0]], fn)
                hr.seq_lens[0] = 10
                out[on] = hr.run([0], [seqs[0][10:]], fn, kv_write_start=[50])
            finally:
                ws.decoder_replay = False
    assert (out[True] - out[False]).abs().max().item() <= 1e-5
    assert (out[True] - refs[0][-1]).abs().max().item() <= TOL


def test_decoder_bounded_replay_excluding_the_source_is_exact(oracle, monkeypatch):
    """benchmarks/v41_replay.py's "before" (the recipe's replay without layer 20): the last KV
    source on every row, the exact replay from the layer after it, equals the full run too."""
    from wideserve.models.deepseek_v41 import replay
    _, _, ws, seqs, refs = oracle("A", "off")
    exact = replay.replay_starts
    source = max(ws.config.kv_source_layer_ids)
    monkeypatch.setattr(replay, "replay_starts", lambda ctx, seq, need, window, layer, n: (
        ctx if layer == source else exact(ctx, seq, need, window, layer, n)))
    plan = REPLAY_PLANS["A"]
    with h.kv_quant_off():
        full = _replay_run(ws, seqs, plan, False)
        got = _replay_run(ws, seqs, plan, True)
    for a, b, ref in zip(got, full, _refs_of(refs, plan)):
        assert (a - ref).abs().max().item() <= TOL
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("quant", ["off", "on"])
def test_layers_sharing_a_source_and_picks_gather_them_once(oracle, monkeypatch, quant):
    """Config A: layers 2-3, 4-5, 6-7 read one KV source at one index source's picks (and 8-9
    read 6's entries at 8's picks): the picked entries are gathered (unpacked, with quant
    "on") once per source and picks, by 4 of the 8 sparse layers, and the logits are
    bit-equal to every layer gathering its own (PICKED_CACHE_BYTES = 0)."""
    from wideserve.layers.attention import v4_batched, v4_step
    _, _, ws, seqs, _ = oracle("A", quant)
    calls = []
    real = v4_batched._gather_picked

    def spy(step, name, *args):
        calls.append(name)
        return real(step, name, *args)
    monkeypatch.setattr(v4_batched, "_gather_picked", spy)
    out = {}
    for budget in (0, v4_step.PICKED_CACHE_BYTES):
        monkeypatch.setattr(v4_step, "PICKED_CACHE_BYTES", budget)
        calls.clear()
        with _maybe_off(quant):
            out[budget] = _harness(ws, seqs, _kv(quant)).step([0, 1], seqs)
        out[budget, "calls"] = list(calls)
    def layers(calls):   # the layers that gathered, and how often each (per query group)
        return {n.split(".")[2]: calls.count(n) for n in calls}
    own, shared = layers(out[0, "calls"]), layers(out[v4_step.PICKED_CACHE_BYTES, "calls"])
    per = own["2"]
    assert own == {str(i): per for i in range(2, 10)}
    assert shared == {str(i): per for i in (2, 4, 6, 8)}
    assert torch.equal(out[0], out[v4_step.PICKED_CACHE_BYTES])


@pytest.mark.parametrize("approx", ["one row fewer", "source on every row"])
def test_decoder_bounded_replay_approximations_differ(oracle, monkeypatch, approx):
    """The rows are the fewest that are exact: starting each layer one row later, or running
    the source on every row and the layers after it on the last `window` rows (the replay
    before it was exact), moves the sampled logits by far more than TOL."""
    from wideserve.models.deepseek_v41 import replay
    _, _, ws, seqs, refs = oracle("A", "off")
    exact = replay.replay_starts
    W, L = ws.config.sliding_window, ws.config.num_hidden_layers

    def later(ctx, seq, need, window, layer, num_layers):
        if approx == "one row fewer":
            return np.minimum(exact(ctx, seq, need, window, layer, num_layers) + 1,
                              seq - np.maximum(need, 1))
        return ctx if layer == 6 else np.maximum(ctx, seq - W)
    monkeypatch.setattr(replay, "replay_starts", later)
    plan = REPLAY_PLANS["A"][:1]
    with h.kv_quant_off():
        got = _replay_run(ws, seqs, plan, True)[0]
    assert L == 10 and (got[0] - refs[0][32]).abs().max().item() > 100 * TOL


def test_config_rejects_candidates_across_ratios():
    from wideserve.models.deepseek_v41.config import DeepseekV41Config
    kw = dict(h.C, compress_ratios=[1, 1, 2, 0, 2, 2, 2, 0, 0, 0], kv_source_layer_ids=[0, 2],
              index_source_layer_ids=[0, 2, 4], candidate_source_layer_id=0)
    with pytest.raises(ValueError, match="index source 2 comes after the candidate source 0"):
        DeepseekV41Config.from_dict({"text_config": kw})
    DeepseekV41Config.from_dict({"text_config": dict(h.C)})


def test_official_fp8_engram_tables_stay_fp8(oracle, tmp_path):
    """Official checkpoints store each Engram table as FP8 e4m3 rows with a UE8M0 scale per
    row and 32 channels (the reference adapter's layout). wideserve keeps them FP8 in host
    memory and dequantises only the gathered rows: the logits equal the reference's with the
    table decoded by the reference adapter's own dequantize_checkpoint_weight (rowwise)."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import \
        dequantize_checkpoint_weight

    from wideserve.layers.quant import quantize_fp8_block
    m, path, _, seqs, _ = oracle("A", "off")
    state = _official_state(m)
    params = dict(m.named_parameters())
    saved = {}
    for name in [n for n in state if n.endswith(".engram.embed.weight")]:
        codes, scale = quantize_fp8_block(state[name], (1, 32))
        state[name], state[name.removesuffix(".weight") + ".scale"] = codes, scale
        table = params["model." + name]
        saved[table] = table.data.clone()
        table.data.copy_(dequantize_checkpoint_weight(codes, scale, dtype=torch.float32,
                                                      rowwise=True))
    try:
        with h.kv_quant_off():
            ref = h.oracle_logits(m, seqs[0])
    finally:
        for table, value in saved.items():
            table.data.copy_(value)
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / f).write_text((path / f).read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    ws = h.ws_model(tmp_path)
    tables = [mod for name, mod in ws.named_modules() if name.endswith("engram.embed")]
    assert len(tables) == 2 and all(t.weight.dtype == torch.float8_e4m3fn for t in tables)
    with h.kv_quant_off():
        out = _harness(ws, seqs[:1], "raw").step([0], seqs[:1])
    assert (out - ref).abs().max().item() <= TOL
    del state["layers.4.engram.embed.scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="FP8 tensor without a .scale companion"):
        h.ws_model(tmp_path)
    # Tables wider than one scale group (Flash: 256 channels, 8 scales a row), gathered by id.
    from wideserve.layers.engram import HostTable
    dense = torch.randn(50, 96) * torch.logspace(-3, 2, 50)[:, None]
    codes, scale = quantize_fp8_block(dense, (1, 32))
    table = HostTable(50, 96)
    table.load_fp8(codes, scale)
    ids = torch.tensor([[7, 0, 49], [7, 31, 2]])
    expect = dequantize_checkpoint_weight(codes, scale, dtype=torch.float32, rowwise=True)
    assert torch.equal(table.gather(ids), expect[ids])
    assert table.float().weight.dtype == torch.float8_e4m3fn
