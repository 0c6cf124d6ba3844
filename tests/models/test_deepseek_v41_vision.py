"""DeepSeek-V4.1 with its vision tower against the reference (nemo-automodel 0.7.0, fp32) on a
tiny random config (2 vision layers; text config C: Engram at layer 0, so the image positions'
Engram masking is exercised; random `bias_vl`, so image positions route differently):
- preprocessing: the same patches and grid as the reference's processor;
- the image span's embeddings (ViT, aligner, delimiters) equal the reference's;
- logits of a prompt holding an image, one-shot and with the image split across prefill
  chunks, equal the reference's (KV quantisers off, |dlogit| <= 1e-4); the same ids without
  the image are text (image_token_id included), as in the reference;
- official names load the same tower; `--limit-mm-per-prompt image=0` builds the text model
  alone (no vision parameter allocated, the vision tensors skipped) with the text logits."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import v41_helpers as h
from paged_harness import PagedHarness
from safetensors.torch import save_file

from wideserve.config import LoadConfig
from wideserve.config.multimodal import MultiModalLimits
from wideserve.models.deepseek_v41.model import IMAGE_EMBEDS, IMAGE_ROWS
from wideserve.models.deepseek_v41.vision import (IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_START,
                                                 prepare_image, span_embeddings)
from wideserve.worker.model_loader import load_model

TOL = 1e-4
IMAGE_ID = h.VOCAB - 2
VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
              patch_size=4, downsample_ratio=2, max_image_tokens=64, min_pixels=256)


def span_types(grid) -> list[int]:   # noqa: ANN001 - vision.ImageGrid
    """The reference's per-position types of an image span (START, IMAGE.., NEWLINE, END)."""
    return ([IMAGE_START] + ([IMAGE] * grid.llm_width + [IMAGE_NEWLINE]) * grid.llm_height
            + [IMAGE_END])


def _image(seed: int, width: int, height: int):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _save(state: dict, kw: dict, path):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "text_config": dict(kw), "vision_config": dict(VISION),
              "image_token_id": IMAGE_ID, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    h.tokenizer(kw["vocab_size"]).backend_tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.processing import _preprocess_image
    kw = dict(h.CONFIGS["C"])
    cfg = DeepseekV41Config(text_config=dict(kw), vision_config=dict(VISION),
                            image_token_id=IMAGE_ID)
    be = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                       experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)
    torch.manual_seed(5)
    m = DeepseekV41ForCausalLM(cfg, backend=be, tokenizer=h.tokenizer(kw["vocab_size"]))
    m.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in [*m.named_parameters(), *m.named_buffers()]:
            if name.endswith(("sinks_param.weight", ".base", "e_score_correction_bias",
                              "bias_vl")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed.weight") and ".engram." in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.startswith(("model.vision.", "model.aligner.")) and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    m.eval()
    image = _image(1, 22, 13)                      # padded to a 5 x 3 patch... grid
    patches, grid = _preprocess_image(image, cfg.vision_config)
    types = [-1] * 9 + [int(t) for t in span_types(prepare_image(image, _ws_vision()).grid)] \
        + [-1] * 6
    seq = h.random_tokens(len(types), seed=7)
    seq = [IMAGE_ID if t >= 0 else tok for tok, t in zip(seq, types)]
    with torch.no_grad(), h.kv_quant_off():
        logits = m(torch.tensor([seq]), pixel_values=patches,
                   image_grid_hws=torch.tensor([[grid.vit_height, grid.vit_width]]),
                   vision_token_types=torch.tensor([types])).logits[0].float()
        plain_logits = h.oracle_logits(m, seq)     # the same ids as text, no image
        text_seq = h.random_tokens(20, seed=8)
        text_logits = h.oracle_logits(m, text_seq)
        span = m.model._image_embeddings(
            torch.tensor([seq]), patches, torch.tensor([[grid.vit_height, grid.vit_width]]),
            torch.tensor([types]))[0, torch.tensor(types) >= 0]
    state = m.state_dict()
    path = _save(state, kw, tmp_path_factory.mktemp("v41_vision"))
    return dict(m=m, kw=kw, path=path, image=image, patches=patches, grid=grid, seq=seq,
                types=types, logits=logits, plain_logits=plain_logits, text_seq=text_seq, text_logits=text_logits,
                span=span, state=state, tmp=tmp_path_factory)


def _ws_vision():
    from wideserve.models.deepseek_v41.config import DeepseekV41VisionConfig
    return DeepseekV41VisionConfig.from_dict(VISION)


def _load(path, **kw):
    return load_model(LoadConfig(model=str(path), dtype="float32", **kw)).model


def _logits(ws, seq: list[int], types: list[int], chunks: list[int], embeds: torch.Tensor):
    """Prefill `seq` in chunks of the given sizes, each chunk's image rows taking their
    span embeddings through ForwardBatch.extras."""
    hr = PagedHarness(ws, max_reqs=1, max_len=len(seq) + 4, specs=ws.kv_cache_specs("raw"))
    image_pos = np.flatnonzero(np.asarray(types) >= 0)
    out, start = [], 0
    for n in chunks:
        in_chunk = image_pos[(image_pos >= start) & (image_pos < start + n)]

        def fn(b, in_chunk=in_chunk, start=start):
            if len(in_chunk):
                b.extras[IMAGE_ROWS] = torch.from_numpy(in_chunk - start)
                b.extras[IMAGE_EMBEDS] = embeds[in_chunk - image_pos[0]]
            return ws.compute_logits(ws.forward(b))
        out.append(hr.run([0], [seq[start:start + n]], fn))
        start += n
    return torch.cat(out)


def test_preprocessing_equals_the_reference(oracle):
    prepared = prepare_image(oracle["image"], _ws_vision())
    g = oracle["grid"]
    assert (prepared.grid.vit_height, prepared.grid.vit_width) == (g.vit_height, g.vit_width)
    assert (prepared.grid.llm_height, prepared.grid.llm_width) == (g.llm_height, g.llm_width)
    assert torch.equal(prepared.patches, oracle["patches"])
    assert prepared.grid.span_length == sum(t >= 0 for t in oracle["types"])


def test_span_embeddings_equal_the_reference(oracle):
    ws = _load(oracle["path"])
    got = span_embeddings(ws.model, prepare_image(oracle["image"], _ws_vision()))
    assert oracle["span"].std() > 0.1
    assert (got - oracle["span"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunks", [[None], [12, 7, None]], ids=["oneshot", "chunked"])
def test_logits_with_an_image_equal_the_reference(oracle, chunks):
    ws = _load(oracle["path"])
    seq = oracle["seq"]
    chunks = [n or len(seq) - sum(c for c in chunks if c) for n in chunks]
    embeds = span_embeddings(ws.model, prepare_image(oracle["image"], _ws_vision()))
    with h.kv_quant_off():
        got = _logits(ws, seq, oracle["types"], chunks, embeds)
    ref = oracle["logits"]
    assert (got - ref).abs().max().item() <= TOL
    # The same ids without the image are text, image_token_id included (the reference marks
    # spans, not ids): the text logits, and the image really changes the text after it.
    with h.kv_quant_off():
        plain = _logits(ws, seq, [-1] * len(seq), [len(seq)], embeds)
    assert (plain - oracle["plain_logits"]).abs().max().item() <= TOL
    assert (plain[-1] - ref[-1]).abs().max().item() > 1e-2


def test_official_names_and_text_only_limit(oracle):
    official = _save(h.official_state(oracle["state"]), oracle["kw"], oracle["tmp"].mktemp("o"))
    ws = _load(official)
    assert "model.vision.blocks.1.attn.wqkv.weight" in dict(ws.named_parameters())
    got = span_embeddings(ws.model, prepare_image(oracle["image"], _ws_vision()))
    assert (got - oracle["span"]).abs().max().item() <= 1e-5
    text = _load(oracle["path"], limit_mm_per_prompt=MultiModalLimits(image=0))
    names = [n for n, _ in text.named_parameters()] + [n for n, _ in text.named_buffers()]
    assert not [n for n in names if "vision" in n or "aligner" in n or "image_" in n
                or n.endswith("bias_vl")]
    assert text.vision_param_count() == 0 < ws.vision_param_count()
    seq = oracle["text_seq"]
    with h.kv_quant_off():
        got = PagedHarness(text, max_reqs=1, max_len=len(seq) + 4,
                           specs=text.kv_cache_specs("raw")).step([0], [seq])
    assert (got - oracle["text_logits"]).abs().max().item() <= TOL


# ------------------------------------------------------------------ served through the engine
def _oracle_greedy(oracle, n: int) -> list[int]:
    """The reference's greedy continuation of the prompt holding the image (text after it)."""
    m, g = oracle["m"], oracle["grid"]
    seq, types, out = list(oracle["seq"]), list(oracle["types"]), []
    with torch.no_grad(), h.kv_quant_off():
        for _ in range(n):
            logits = m(torch.tensor([seq]), pixel_values=oracle["patches"],
                       image_grid_hws=torch.tensor([[g.vit_height, g.vit_width]]),
                       vision_token_types=torch.tensor([types])).logits[0, -1]
            out.append(int(logits.argmax()))
            seq.append(out[-1])
            types.append(-1)
    return out


def _engine(path, **kw):
    from wideserve.config import engine_config_from_kwargs
    from wideserve.engine.engine_core import EngineCore
    return EngineCore(engine_config_from_kwargs(
        model=str(path), dtype="float32", max_num_seqs=4, kv_cache_memory=64 << 20,
        kv_cache_dtype="bf16", **kw))      # (h.kv_quant_off leaves fp8 KV records rounded)


def _image_request(rid: str, seq: list[int], offset: int, image, n: int):
    from wideserve.models.deepseek_v41.vision import image_input
    from wideserve.types.messages import EngineCoreRequest
    from wideserve.types.sampling_params import SamplingParams
    return EngineCoreRequest(rid, list(seq), SamplingParams(temperature=0.0, max_tokens=n,
                                                            ignore_eos=True),
                             images=[image_input(prepare_image(image, _ws_vision()), offset)])


class _Tokens(dict):
    cached: dict[str, int]


def _run(core, *reqs) -> _Tokens:
    """Each request's tokens; `.cached`: its prefix-cache hit."""
    for r in reqs:
        core.add_request(r)
    out = _Tokens({r.request_id: [] for r in reqs})
    out.cached = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                out.cached[o.request_id] = o.num_cached_tokens
    core.check_integrity()
    return out


def test_engine_greedy_with_an_image_equals_the_reference(oracle):
    """EngineCore with an image request (the encoder run by the worker, IMAGE_ROWS /
    IMAGE_EMBEDS per step): one-shot and with prefill chunks cutting the span, the reference's
    greedy tokens; the tower runs once per request; the image changes the tokens."""
    want = _oracle_greedy(oracle, 4)
    seq, offset = oracle["seq"], oracle["types"].index(0)
    with h.kv_quant_off():
        for kw in ({}, {"max_num_batched_tokens": 8}):
            core = _engine(oracle["path"], enable_prefix_caching=False, **kw)
            got = _run(core, _image_request("a", seq, offset, oracle["image"], 4))
            assert got["a"] == want, kw
            assert core.worker.images.encoded == 1 and len(core.worker.images) == 0
        other = _run(core, _image_request("b", seq, offset, _image(2, 22, 13), 4))
    assert other["b"] != want


def test_prefix_cache_keys_the_image(oracle):
    """Same text, different image: no KV shared from the first block holding the span; the
    same image: shared past it, with the tokens of a cold run."""
    seq, offset = oracle["seq"], oracle["types"].index(0)
    seq = seq + h.random_tokens(24, seed=9)     # full blocks after the span
    with h.kv_quant_off():
        core = _engine(oracle["path"], block_size=8, enable_prefix_caching=True)
        cold = _run(core, _image_request("a", seq, offset, oracle["image"], 3))
        other = _run(core, _image_request("b", seq, offset, _image(2, 22, 13), 3))
        same = _run(core, _image_request("c", seq, offset, oracle["image"], 3))
    assert other.cached["b"] == offset // 8 * 8 < offset
    assert same.cached["c"] == (len(seq) - 1) // 8 * 8 > offset + 30
    assert same["c"] == cold["a"] != other["b"]


@pytest.mark.parametrize("steps", [2, 5], ids=["mid-span", "decoding"])
def test_preempted_image_request_recomputes_the_same_tokens(oracle, steps):
    """Preempted (by recompute, the scheduler's own path) inside the span during chunked
    prefill (the embeddings are kept: one tower run) or while decoding (they were dropped
    when the prefill passed the span: the tower runs again); the reference's tokens."""
    from wideserve.engine.scheduler import _StepPlan
    want = _oracle_greedy(oracle, 4)
    seq, offset = oracle["seq"], oracle["types"].index(0)
    with h.kv_quant_off():
        core = _engine(oracle["path"], max_num_batched_tokens=8, enable_prefix_caching=False)
        core.add_request(_image_request("a", seq, offset, oracle["image"], 4))
        out = []
        for _ in range(steps):
            out += [t for o in core.step() for t in o.new_token_ids]
        request = core.scheduler.requests["a"]
        assert (request.num_computed_tokens < offset + 10) == (steps == 2)
        core.scheduler._preempt(request, _StepPlan(0, 0))
        while core.has_unfinished_requests():
            out += [t for o in core.step() for t in o.new_token_ids]
    assert core.get_stats().num_preemptions == 1
    assert out == want
    assert core.worker.images.encoded == (1 if steps == 2 else 2)
    assert len(core.worker.images) == 0


def test_a_decompression_bomb_is_a_value_error(monkeypatch):
    """An image PIL refuses as too large to decode is the request's error (a 400 in chat),
    not a crash of the server."""
    import io
    from PIL import Image
    from wideserve.models.deepseek_v41.vision import decode_image
    buf = io.BytesIO()
    Image.new("RGB", (100, 100)).save(buf, "PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)       # 10,000 px > 2 x the limit
    with pytest.raises(ValueError, match="cannot be decoded"):
        decode_image(buf.getvalue())
