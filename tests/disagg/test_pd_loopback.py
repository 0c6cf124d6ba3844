"""Prefill -> decode through the loopback connector gives the colocated engine's greedy
tokens: V4 (dummy configs with prompts longer than the window, the bundled model) and
Llama, with decode-side prefix hits; both pools are intact afterwards."""
from __future__ import annotations

import random

import pytest

from models import v4_configs
from pd_harness import make_engines, prefill, run_colocated, run_pd, settle, write_config
from wideserve.text.tokenizer import Tokenizer

MAX_NEW = 6


def _prompts(vocab: int, lengths: list[int], seed: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def _v4_dir(tmp_path, name: str) -> str:
    cfg = {**getattr(v4_configs, name), "architectures": ["DeepseekV4ForCausalLM"],
           "model_type": "deepseek_v4"}
    return write_config(tmp_path / name, cfg)


def _llama_dir(tmp_path) -> str:
    return write_config(tmp_path / "llama", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160,
        "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False})


@pytest.mark.parametrize("name,block_size,mode", [("A", 16, "keep"), ("C", 12, "replay")])
def test_v4_dummy_pd_equals_colocated_with_decode_prefix_hits(tmp_path, name, block_size, mode):
    p, d, ref = make_engines(_v4_dir(tmp_path, name), load_format="dummy",
                             block_size=block_size, kv_cache_memory=1 << 24,
                             prefix_window_mode=mode)
    window = getattr(v4_configs, name)["sliding_window"]
    first = _prompts(256, [3, 17, 41, 70], seed=1)
    assert max(map(len, first)) > 4 * window
    # Turn 1's output crosses a logical block, so the decode side computes (and caches) it.
    turn1 = run_pd(p, d, first, block_size + 4)
    assert turn1 == run_colocated(ref, first, block_size + 4)
    # Turn 2 of each conversation (agentic): its prompt extends turn 1's prompt and output,
    # whose blocks the decode side computed and cached, so only the rest is pulled.
    second = [a + b + c for a, b, c in zip(first, turn1, _prompts(256, [5, 9, 2, 7], seed=2))]
    hits0 = d.kv_manager.stats.hits
    loaded0 = d.kv_connector.scheduler.stats.tokens_loaded
    assert run_pd(p, d, second, MAX_NEW, tag="t2") == run_colocated(ref, second, MAX_NEW)
    hits = d.kv_manager.stats.hits - hits0
    loaded = d.kv_connector.scheduler.stats.tokens_loaded - loaded0
    if mode == "keep":
        assert hits >= 4 * block_size
        assert loaded == sum(len(s) - 1 for s in second) - hits
    else:   # replay: a remote load ignores local hits (docs/disaggregation.md)
        assert hits == 0 and loaded == sum(len(s) - 1 for s in second)
    settle(p, d, ref)


def test_bundled_v4_pd_equals_colocated(tmp_path):
    p, d, ref = make_engines(None, max_num_batched_tokens=512, max_num_seqs=8,
                             kv_cache_memory=1 << 25)
    prompts = _prompts(512, [300, 90], seed=3)      # window 64, logical block 256
    assert run_pd(p, d, prompts, MAX_NEW) == run_colocated(ref, prompts, MAX_NEW)
    settle(p, d, ref)


@pytest.mark.parametrize("op", ["push", "pull"])
def test_llama_pd_equals_colocated(tmp_path, op):
    p, d, ref = make_engines(_llama_dir(tmp_path), load_format="dummy", block_size=16,
                             kv_cache_memory=1 << 24, d_kv={"kv_transfer_op": op})
    prompts = _prompts(160, [2, 16, 33, 50], seed=4, prefix=20)
    assert run_pd(p, d, prompts, MAX_NEW) == run_colocated(ref, prompts, MAX_NEW)
    settle(p, d, ref)


@pytest.mark.parametrize("op", ["push", "pull"])
def test_v4_load_moves_only_the_window_of_sliding_groups(tmp_path, op):
    p, d, ref = make_engines(_v4_dir(tmp_path, "A"), load_format="dummy", block_size=16,
                             kv_cache_memory=1 << 24, d_kv={"kv_transfer_op": op})
    (prompt,) = _prompts(256, [200], seed=5)
    assert run_pd(p, d, [prompt], 2) == run_colocated(ref, [prompt], 2)
    end = len(prompt) - 1                        # positions whose KV is pulled
    clipped = unclipped = 0
    for g in d.kv_config.groups:
        pages = -(-end // g.block_size)
        unclipped += pages
        first = max(0, end - g.spec.window + 1) // g.block_size if g.is_sliding else 0
        clipped += pages - first
    stats = d.kv_connector.scheduler.stats
    assert stats.pages_loaded == clipped < unclipped // 2
    settle(p, d, ref)


def test_leases_count_as_sequences_and_hold_only_the_window(tmp_path):
    """More do_remote_decode requests than max_num_seqs, nobody pulling: the producer waits
    for leases to expire instead of failing requests, and a held request keeps only the
    sliding pages the consumer's window will read."""
    p, _, _ = make_engines(_v4_dir(tmp_path, "A"), load_format="dummy", block_size=16,
                           max_num_seqs=4, max_num_batched_tokens=256,
                           kv_cache_memory=1 << 22, p_kv={"kv_lease_s": 0.3})
    prompts = _prompts(256, [60] * 10, seed=6)
    handles = prefill(p, prompts)
    assert all(h and h["do_remote_prefill"] for h in handles)
    assert p.kv_connector.scheduler.stats.leases_expired >= 6
    for h in handles:
        for g, row in zip(p.kv_config.groups, h["remote_block_ids"]):
            if g.is_sliding:
                live = sum(1 for b in row if b)
                assert live <= -(-g.spec.window // g.block_size) + 1, (g.spec.role, row)
    settle(p)


def test_qwen3_moe_pd_equals_colocated(tmp_path):
    path = write_config(tmp_path / "qwen3moe", {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 160,
        "hidden_size": 48, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
        "tie_word_embeddings": False})
    p, d, ref = make_engines(path, load_format="dummy", block_size=16, kv_cache_memory=1 << 24)
    prompts = _prompts(160, [7, 30, 45], seed=7, prefix=17)
    assert run_pd(p, d, prompts, MAX_NEW) == run_colocated(ref, prompts, MAX_NEW)
    settle(p, d, ref)


def test_bundled_v4_mtp_acceptance_after_handoff_equals_colocated():
    """Both sides run the bundled model's MTP head (k = 3): the MTP layer's KV travels with
    the rest of the layout, so the decode side drafts and accepts exactly as the colocated
    engine does, token for token (docs/disaggregation.md, "Speculative decoding")."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    p, d, ref = make_engines(None, max_num_batched_tokens=512, max_num_seqs=8,
                             kv_cache_memory=1 << 25, speculative_config=spec)
    tok = Tokenizer.from_pretrained(ref.loaded.path)
    texts = ["KING HENRY.\nMy lord, I will not hear of it; " * 6,
             "First Citizen.\nBefore we proceed any further, hear me speak.\n\nAll.\nSpeak."]
    prompts = [tok.encode(t) for t in texts]
    assert max(map(len, prompts)) > 64                     # longer than the window
    expected = run_colocated(ref, prompts, 24)
    assert run_pd(p, d, prompts, 24) == expected
    got, want = d.get_stats().spec_decode, ref.get_stats().spec_decode
    assert want.num_drafts > 0 and want.num_accepted_tokens > 0
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens_per_pos) == \
        (want.num_drafts, want.num_draft_tokens, want.num_accepted_tokens_per_pos)
    settle(p, d, ref)


def test_v41_image_prompt_pd_equals_colocated_without_the_encoder_on_decode(tmp_path):
    """A V4.1 prompt holding an image (tiny random config with a 2-layer vision tower): the
    prefill side runs the tower, the decode side pulls the KV of the image rows and computes
    only the last (text) prompt token, so it never runs the tower; greedy tokens equal the
    colocated engine's. The handle is bound to the image (its digest is in the signed prompt
    digest): the same token ids with another image, or with no image, are refused."""
    from models import v41_helpers as h
    from wideserve.models.deepseek_v41.config import DeepseekV41VisionConfig
    from wideserve.models.deepseek_v41.vision import image_input, prepare_image
    from wideserve.types.messages import EngineCoreRequest
    from pd_harness import drain, greedy
    from PIL import Image
    import numpy as np
    vision = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                  intermediate_size=48, patch_size=4, downsample_ratio=2, max_image_tokens=64,
                  min_pixels=256)
    image_id = h.VOCAB - 2
    path = write_config(tmp_path / "v41_vision", {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "text_config": dict(h.B), "vision_config": vision, "image_token_id": image_id,
        "torch_dtype": "float32", "max_position_embeddings": 4096})
    p, d, ref = make_engines(path, load_format="dummy", kv_cache_dtype="bf16", block_size=8,
                             kv_cache_memory=1 << 25, max_model_len=256)

    def image(seed: int):
        pixels = np.random.default_rng(seed).integers(0, 256, (13, 22, 3), dtype=np.uint8)
        inp = prepare_image(Image.fromarray(pixels, "RGB"),
                            DeepseekV41VisionConfig.from_dict(vision))
        return image_input(inp, 3)

    a, b = image(1), image(2)
    ids = [5, 6, 7] + [image_id] * a.length + _prompts(200, [20], seed=8)[0]
    assert a.length == b.length

    def request(rid, kv=None, images=(a,), n=MAX_NEW):
        return EngineCoreRequest(rid, list(ids), greedy(n, kv), images=list(images) or None)

    ref.add_request(request("ref"))
    want = drain(ref, {"ref"})["ref"]["tokens"]
    p.add_request(request("p", {"do_remote_decode": True}, n=1))
    handle = drain(p, {"p"})["p"]["params"]
    assert handle and handle["do_remote_prefill"] and p.worker.images.encoded == 1
    for images in ((b,), ()):
        with pytest.raises(ValueError, match="issued for a different prompt"):
            d.add_request(request("d-bad", handle, images))
    d.add_request(request("d", handle))
    got = drain(d, {"d"}, others=(p,))["d"]
    assert got["finish"] == "length" and got["tokens"] == want
    assert d.kv_connector.scheduler.stats.tokens_loaded == len(ids) - 1
    assert d.worker.images.encoded == 0
    ref.add_request(request("ref-b", images=(b,)))
    assert drain(ref, {"ref-b"})["ref-b"]["tokens"] != want     # the image matters
    settle(p, d, ref)
