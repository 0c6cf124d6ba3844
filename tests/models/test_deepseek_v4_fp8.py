"""DeepSeek-V4 with --kv-cache-dtype fp8: window and compressed latents as fp8_ds_mla records
(FP8 non-rotary channels with UE8M0 scales per 64, bf16 rotary channels), indexer keys as
MXFP4, quantised on write and dequantised on read; 3,514 B/token on V4-Flash (checked on the
meta model in test_deepseek_v4_config.py)."""
from __future__ import annotations

import pytest
import torch
import v4_configs as cfgs
from paged_harness import PagedHarness
from v4_helpers import hf_logits, hf_model, random_tokens, ws_model

from wideserve.layers import kv_quant


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    mant, exp = torch.frexp(x)                          # x = mant * 2**exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), torch.where(mant == 0.5, exp - 1, exp))


def _ds_mla_reference(x: torch.Tensor, rope: int) -> torch.Tensor:
    """Group by group, written out plainly."""
    nope = x.shape[-1] - rope
    out = x.clone()
    for g in range(0, nope, 64):
        part = x[:, g:min(g + 64, nope)]
        scale = _pow2_ceil(part.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)
        out[:, g:g + part.shape[1]] = (part / scale).clamp(-448, 448).to(
            torch.float8_e4m3fn).float() * scale
    out[:, nope:] = x[:, nope:].to(torch.bfloat16).float()
    return out


@pytest.mark.parametrize("width,rope", [(512, 64), (64, 8), (16, 4)])
def test_ds_mla_records_round_trip(width, rope):
    g = torch.Generator().manual_seed(width)
    x = torch.cat([torch.randn(50, width, generator=g) * s for s in (1e-6, 0.01, 1, 300)])
    x[0] = 0
    codec = kv_quant.codec_for("fp8_ds_mla", width, rope)
    records = codec.pack(x)
    nope = width - rope
    assert records.shape == (200, nope + 2 * rope + -(-nope // 64) + 1)
    ref = _ds_mla_reference(x, rope)
    assert torch.equal(codec.fake_quant(x), ref)
    assert torch.equal(codec.unpack(records), ref)


@pytest.fixture(scope="module")
def pair():
    kw = cfgs.B
    hf = hf_model(kw, seed=7)
    ws = ws_model(kw, hf)
    seq = random_tokens(150, kw["vocab_size"], seed=3)
    return ws, seq, hf_logits(hf, seq)


def test_fp8_records_execute_close_to_the_unquantised_model(pair):
    """Records are uint8, read back through their codec; logits stay near the fp32 model's,
    and chunked prefill + decode (reading its own records) stays near them too."""
    ws, seq, ref = pair
    specs = ws.kv_cache_specs("fp8")
    h = PagedHarness(ws, max_reqs=1, max_len=len(seq) + 4, specs=specs)
    assert h.kv_caches["model.layers.2.self_attn.compressed"].dtype == torch.uint8
    assert h.kv_caches["model.layers.2.self_attn.indexer"].shape[-1] == 16 + 1
    oneshot = h.step([0], [seq])
    h = PagedHarness(ws, max_reqs=1, max_len=len(seq) + 4, specs=specs)
    plan, done, rows = [37, 50, 11] + [1] * (len(seq) - 98), 0, []
    for n in plan:
        rows.append(h.step([0], [seq[done:done + n]]))
        done += n
    chunked = torch.cat(rows)
    # Seen: mean |dlogit| 1.1% / 2.2% of mean |logit|, argmax agreement 98.7% / 96%.
    for out in (oneshot, chunked):
        err = (out - ref).abs()
        assert 0 < err.mean().item() < 0.05 * ref.abs().mean().item()
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_engine_serves_with_fp8_records(pair, tmp_path):
    import sys
    import warnings
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from oracle import save_hf
    from test_engine_greedy import _check_idle

    from wideserve import LLM, SamplingParams
    hf = hf_model(cfgs.B, seed=7)
    path = save_hf(hf, tmp_path / "v4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(path), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory=1 << 26, max_num_seqs=4,
                  skip_tokenizer_init=True, max_num_batched_tokens=64)
    assert llm.engine.kv_caches["model.layers.2.self_attn.window"].dtype == torch.uint8
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [random_tokens(n, cfgs.B["vocab_size"], seed=n) for n in (90, 140)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    _check_idle(llm)
