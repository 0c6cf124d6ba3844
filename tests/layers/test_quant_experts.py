"""Routed experts kept in their checkpoint format (FP8 block-scaled, MXFP4, NVFP4): the C++ grouped GEMM
that dequantises per tile (csrc/quant_gemm.cpp) and its torch fallbacks against dequantise-then-
matmul in fp32; RoutedExperts on packed weights against the same experts dequantised; the loader
keeping a tiny FP4 / FP8 DeepSeek-V4 checkpoint's experts packed (checkpoint bytes, resident
bytes, logits and greedy tokens equal to the dequantised load)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from paged_harness import PagedHarness
from wideserve.config import LoadConfig
from wideserve.kernels import quant_gemm
from wideserve.kernels.loader import build
from wideserve.layers import quant
from wideserve.layers.experts import RoutedExperts, loop_mlp
from wideserve.worker.model_loader import load_model

FORMATS = {"fp8": quant.expert_format("fp8", (128, 128)),
           "fp8_small": quant.expert_format("fp8", (16, 32)),
           "fp8_f32": quant.expert_format("fp8", (128, 128), scale_dtype="fp32"),
           "mxfp4": quant.expert_format("fp4"),
           "nvfp4": quant.expert_format("nvfp4")}


def _random(fmt: quant.ExpertFormat, L: int, R: int, K: int, halves: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(L, R, K, generator=g) / K ** 0.5
    return fmt.quantize(dense, halves)


def _reference(x: torch.Tensor, counts: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               fmt: quant.ExpertFormat, halves: int, glob: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Dequantise every expert to x's dtype (as the dequantise-at-load path holds it; exact
    in bf16 but for NVFP4), then one matmul per expert's rows, in fp32."""
    w = fmt.dequantize(codes, scale, halves, x.dtype, glob).float()
    out, start = torch.zeros(x.shape[0], codes.shape[1]), 0
    for e, n in enumerate(counts.tolist()):
        out[start:start + n] = x[start:start + n].float() @ w[e].t()
        start += n
    return out


# (format, L, R output rows, K, rows per expert, halves): M = 0, 1, odd, large; experts with
# no rows; R not a multiple of 16; K not a multiple of 32 (odd for FP8).
CASES = [
    ("mxfp4", 3, 64, 256, [0, 0, 0], 2),
    ("mxfp4", 3, 64, 256, [0, 1, 0], 2),
    ("mxfp4", 4, 40, 96, [1, 0, 3, 7], 1),
    ("mxfp4", 2, 300, 258, [33, 2], 2),
    ("mxfp4", 3, 90, 320, [0, 257, 5], 2),
    ("fp8", 3, 256, 384, [5, 0, 70], 2),
    ("fp8", 2, 200, 131, [1, 19], 1),
    ("fp8_small", 3, 72, 77, [9, 0, 300], 2),
    ("fp8_f32", 3, 200, 200, [4, 0, 40], 2),
    ("nvfp4", 3, 64, 256, [0, 1, 0], 2),
    ("nvfp4", 4, 40, 96, [1, 0, 3, 7], 1),
    ("nvfp4", 3, 90, 336, [0, 257, 5], 2),
]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    build()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["dots", "brgemm", "portable"])
@pytest.mark.parametrize("case", CASES)
def test_op_matches_dequantise_then_matmul(case, path, dtype):
    name, L, R, K, rows, halves = case
    fmt = FORMATS[name]
    codes, scale, glob = _random(fmt, L, R, K, halves, seed=L * R + K)
    counts = torch.tensor(rows)
    x = torch.randn(int(counts.sum()), K, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = _reference(x, counts, codes, scale, fmt, halves, glob)
    got = quant_gemm.grouped_linear(x, counts, codes, scale, fmt.op_id, fmt.block, halves,
                                    brgemm_min_rows=4 if path == "brgemm" else None,
                                    portable=path == "portable", global_scale=glob)
    assert got.dtype == dtype and got.shape == (x.shape[0], R)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:                      # fp32 sums rounded once to bf16: within one bf16 ulp
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("name,R,K", [("mxfp4", 90, 258), ("mxfp4", 64, 320), ("fp8", 40, 131),
                                      ("nvfp4", 90, 258), ("nvfp4", 64, 320)])
def test_op_rows_do_not_depend_on_the_rows_beside_them(name, R, K):
    # the dot-product path (no brgemm) takes an expert's rows in passes of up to 8 and the
    # weight rows 4 or 2 at a time (MXFP4's and NVFP4's register dequantisation): each row's
    # result must be bitwise what the row alone gives (--batch-invariant relies on it), for
    # every pass size, a weight-row tail (R = 90) and a partial last K chunk (K = 258)
    fmt = FORMATS[name]
    codes, scale, glob = _random(fmt, 2, R, K, 1, seed=R + K)
    x = torch.randn(13, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def run(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return quant_gemm.grouped_linear(rows, torch.tensor(counts), codes, scale, fmt.op_id,
                                         fmt.block, 1, None, global_scale=glob)
    alone = [torch.cat([run(x[i:i + 1], [1 - e, e]) for i in range(13)]) for e in (0, 1)]
    for split in ([13, 0], [0, 13], [4, 9], [9, 4], [1, 12], [7, 6]):
        together = run(x, split)
        assert torch.equal(together[:split[0]], alone[0][:split[0]]), split
        assert torch.equal(together[split[0]:], alone[1][split[0]:]), split
    for e in (0, 1):
        counts = torch.tensor([13, 0] if e == 0 else [0, 13])
        torch.testing.assert_close(alone[e].float(), _reference(x, counts, codes, scale, fmt, 1,
                                                                glob), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("path", ["dots", "brgemm"])
def test_fp8_every_code_and_edge_scales(path):
    # every e4m3 code (subnormals, +-0, the NaN codes in one row) under UE8M0 scales from
    # 2^-127 to 2^113 (the widened-fp16 decode takes 2^-100..2^100, the rest the fp32 loop;
    # larger ones overflow the sums of the reference too)
    fmt = quant.expert_format("fp8", (1, 32))
    R, K = 24, 256
    codes = torch.arange(R * K, dtype=torch.int64).remainder(256).to(torch.uint8).view(1, R, K)
    nan = (codes & 0x7F) == 0x7F
    codes[:, 1:][nan[:, 1:]] = 0x38                      # 1.0; row 0 keeps its NaN codes
    edges = torch.tensor([0, 1, 26, 27, 100, 120, 127, 133, 200, 227, 228, 240],
                         dtype=torch.uint8)
    scale = edges[torch.arange(R * K // 32) % len(edges)].view(1, R, K // 32)
    x = (torch.randn(3, K, generator=torch.Generator().manual_seed(5)) * 1e-3).to(torch.bfloat16)
    counts = torch.tensor([3])
    got = quant_gemm.grouped_linear(x, counts, codes, scale, fmt.op_id, fmt.block, 1,
                                    brgemm_min_rows=1 if path == "brgemm" else None)
    want = _reference(x, counts, codes, scale, fmt, 1, None)
    assert got[:, 0].isnan().all() and not got[:, 1:].isnan().any()
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-30, equal_nan=True)


# 2^-119 / 1.5 x (1 - 2^-9): the subnormal product 1.5 x 2^-7 (an E4M3 subnormal) x it rounds
# up to the smallest normal bf16, which a decode that flushed it would lose
ROUNDS_UP = float(torch.tensor(2.0 ** -119 / 1.5 * (1 - 2.0 ** -9), dtype=torch.float32))


@pytest.mark.parametrize("path", ["dots", "brgemm", "portable"])
@pytest.mark.parametrize("glob", [1.0, 0.37, 2.0 ** -100, 2.0 ** -120, ROUNDS_UP, 2.0 ** 100])
def test_nvfp4_every_code_and_scale_decodes_exactly(path, glob):
    # every e2m1 code under every E4M3 scale byte (subnormal scales; a NaN scale in row 0
    # only) times global scales inside the register decode's range (2^-100 and up) and below
    # it (2^-120, ROUNDS_UP: the fp32 loop, products subnormal), read out exactly through
    # one-hot input rows in calls of 1 and 8 rows (register decode) and 9 (the buffered
    # rows): every weight must be the reference's bf16 value. Where the build has the bf16
    # dot products (AVX512-BF16; brgemm runs only there), they read subnormal weights as zero
    # (vdpbf16ps and AMX flush them); the portable loop (`portable`, or a build without
    # them) reads them as themselves.
    fmt = FORMATS["nvfp4"]
    R, K = 32, 256
    nibbles = torch.arange(R * K).remainder(16).view(1, R, K // 2, 2)
    codes = (nibbles[..., 0] | (nibbles[..., 1] << 4)).to(torch.uint8)
    scale = torch.arange(R * K // 16).remainder(256).to(torch.uint8).view(1, R, K // 16)
    scale[(scale & 0x7F) == 0x7F] = 0x38                 # 1.0 (every byte is in rows 16-31)
    scale[0, 0, 3] = 0xFF                                 # a NaN scale: row 0 is all NaN
    g = torch.full((1, 1), glob)
    want = fmt.dequantize(codes, scale, 1, torch.bfloat16, g)[0].float()
    build()
    if path != "portable" and torch.ops.wideserve.moe_fast_path_compiled():
        want = torch.where(want.abs() < 2.0 ** -126, torch.zeros(()), want)
    eye = torch.eye(K).bfloat16()
    for m in (1, 8, 9):
        parts = [quant_gemm.grouped_linear(eye[k:k + m], torch.tensor([len(eye[k:k + m])]),
                                           codes, scale, fmt.op_id, fmt.block, 1,
                                           1 if path == "brgemm" else None,
                                           portable=path == "portable", global_scale=g)
                 for k in range(0, K, m)]
        got = torch.cat(parts).t().float()                  # [R, K]: the weights
        assert got[0].isnan().all(), m
        assert torch.equal(got[1:], want[1:]), (m, (got[1:] != want[1:]).nonzero()[:4])


def test_op_refuses_mismatched_inputs():
    fmt = FORMATS["mxfp4"]
    codes, scale, _ = _random(fmt, 2, 32, 64, 1, seed=0)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="counts sum"):
        quant_gemm.grouped_linear(x, torch.tensor([1, 1]), codes, scale, 1, fmt.block, 1)
    with pytest.raises(RuntimeError, match="does not hold K"):
        quant_gemm.grouped_linear(torch.randn(3, 60), torch.tensor([1, 2]), codes, scale, 1,
                                  fmt.block, 1)
    with pytest.raises(RuntimeError, match="scale"):
        quant_gemm.grouped_linear(x, torch.tensor([1, 2]), codes, scale[:, :, :1], 1,
                                  fmt.block, 1)
    nv = FORMATS["nvfp4"]
    codes, scale, glob = _random(nv, 2, 32, 64, 1, seed=0)
    with pytest.raises(RuntimeError, match="NVFP4 needs global_scale"):
        quant_gemm.grouped_linear(x, torch.tensor([1, 2]), codes, scale, 2, nv.block, 1)
    with pytest.raises(RuntimeError, match="global_scale must be"):
        quant_gemm.grouped_linear(x, torch.tensor([1, 2]), codes, scale, 2, nv.block, 1,
                                  global_scale=glob[:1])


def test_nvfp4_dequantises_as_modelopt_writes_it():
    """Code x E4M3 block scale x fp32 global scale; a round trip within FP4 precision."""
    dense = torch.randn(2, 48, 64) * torch.tensor([0.01, 30.0])[:, None, None]
    codes, scale, glob = quant.quantize_nvfp4(dense)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 48, 32)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (2, 48, 4)
    assert glob.shape == (2,)
    back = quant.dequantize_nvfp4(codes, scale, glob, 16, torch.float32)
    by_hand = quant.unpack_fp4_e2m1(codes) * scale.float().repeat_interleave(16, -1) \
        * glob[:, None, None]
    assert torch.equal(back, by_hand)
    for i in range(2):       # e2m1 steps are at most 1/3 of a value up to the block's amax
        assert (back[i] - dense[i]).abs().max() <= dense[i].abs().max() / 3


@pytest.mark.parametrize("name", ["fp8", "fp8_f32", "mxfp4", "nvfp4"])
def test_torch_fallback_matches_reference(name):
    fmt = FORMATS[name]
    codes, scale, glob = _random(fmt, 3, 256, 128, 2, seed=4)
    counts = torch.tensor([3, 0, 9])
    x = torch.randn(12, 128)
    torch.testing.assert_close(
        quant.dequant_grouped_linear(x, counts, codes, scale, fmt, 2, glob),
        _reference(x, counts, codes, scale, fmt, 2, glob))


def test_scaled_mm_path_is_close():
    """The CUDA FP8 path's maths (torch._scaled_mm row-wise also runs on the CPU): FP8
    activations per row and K block, so close to, not equal to, the dequantised product."""
    fmt = FORMATS["fp8"]
    codes, scale, _ = _random(fmt, 3, 256, 512, 2, seed=5)
    counts = torch.tensor([5, 0, 20])
    x = torch.randn(25, 512).to(torch.bfloat16)
    want = _reference(x, counts, codes, scale, fmt, 2)
    got = quant.scaled_mm_grouped_linear(x, counts, codes, scale, fmt, 2).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_fp8_gate_up_keeps_separate_scale_grids():
    """I = 96 is not a multiple of the 128-row block: gate and up rows keep their own grids."""
    fmt = FORMATS["fp8"]
    dense = torch.randn(1, 192, 256)
    dense[:, 96:] *= 1000                          # up rows far larger than gate rows
    codes, scale, _ = fmt.quantize(dense, halves=2)
    assert scale.shape == (1, 2, 2)
    back = fmt.dequantize(codes, scale, 2, torch.float32)
    for rows in (slice(0, 96), slice(96, 192)):     # each half within its own block's precision
        err = (back[:, rows] - dense[:, rows]).abs().max()
        assert err <= dense[:, rows].abs().max() / 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp8_small", "mxfp4", "nvfp4"])
def test_routed_experts_on_packed_weights(name, dtype):
    """RoutedExperts holding codes + scales computes what the same experts dequantised do, and
    holds no dense copy."""
    fmt = FORMATS[name]
    E, d, inter, T, k = 6, 96, 48, 37, 2
    packed = RoutedExperts(E, d, inter, swiglu_limit=7.0)
    packed.keep_checkpoint_format(fmt)
    g = torch.Generator().manual_seed(3)
    w13, s13, g13 = fmt.quantize(torch.randn(E, 2 * inter, d, generator=g) / d ** 0.5, halves=2)
    w2, s2, g2 = fmt.quantize(torch.randn(E, d, inter, generator=g) / inter ** 0.5)
    values = {"gate_up_proj": w13, "gate_up_proj_scale": s13, "gate_up_proj_global": g13,
              "down_proj": w2, "down_proj_scale": s2, "down_proj_global": g2}
    with torch.no_grad():
        for n, p in packed.named_parameters():
            p.copy_(values[n])
    x = torch.randn(T, d, generator=g).to(dtype)
    ids = torch.randint(0, E - 1, (T, k), generator=g)     # expert E-1 gets no rows
    weights = torch.rand(T, k, generator=g).to(dtype)
    got = packed(x, ids, weights)
    assert packed.resolved_impl(x.device, dtype) == "quant"
    gate_up, down = packed.dense_weights(torch.float32)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    ys = loop_mlp(x.float().index_select(0, order // k), counts, gate_up, down, 7.0)
    y = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, d)
    want = (weights.float().unsqueeze(-1) * y).sum(1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert packed.expert_load.tolist() == counts.tolist()
    assert all(p.dtype == torch.uint8 or n.endswith("_global")
               for n, p in packed.named_parameters())
    assert packed._packs is None


def test_routed_experts_take_the_measured_brgemm_threshold(monkeypatch, tmp_path):
    """The layer declares its format's "quant_experts" shape and hands the op the kernel
    choice's threshold for it (bf16; none for fp32 inputs nor in the batch-invariant mode)."""
    from wideserve.kernels.choice import KernelChoice, KernelPolicy
    from wideserve.layers.gemm_shapes import GemmShape
    fmt = FORMATS["mxfp4"]
    layer = RoutedExperts(4, 64, 32)
    layer.keep_checkpoint_format(fmt)
    assert layer.gemm_shapes() == [GemmShape("quant_experts", 32, 64, (1, 1, 32, 1))]
    timed = []

    def timer(family, kernels, shape, rows):      # brgemm faster from 7 rows
        timed.append((family, shape))
        return {"micro": 6.0 + rows, "brgemm": 12.5}
    layer.kernel_choice = KernelChoice(KernelPolicy(cache_dir=tmp_path), timer=timer)
    monkeypatch.setattr(KernelChoice, "runnable", lambda self, family, dtype:
                        ("micro", "brgemm") if dtype == torch.bfloat16 else ())
    seen = []
    real = quant_gemm.grouped_linear
    monkeypatch.setattr(quant_gemm, "grouped_linear",
                        lambda *a, **kw: (seen.append(a[7]), real(*a, **kw))[1])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randint(0, 120, p.shape, generator=g) if p.dtype == torch.uint8
                    else torch.ones(p.shape))
    x = torch.randn(5, 64, generator=g)
    ids = torch.randint(0, 4, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    layer(x.bfloat16(), ids, w.bfloat16())
    assert seen == [7, 7] and {t[0] for t in timed} == {"quant_experts"}
    assert {t[1][2:] for t in timed} == {(1, 1, 32, 1)}
    seen.clear()
    layer(x, ids, w)                                 # fp32: the op's dot products only
    layer.batch_invariant = True
    layer(x.bfloat16(), ids, w.bfloat16())
    assert seen == [None] * 4


# --- the tiny DeepSeek-V4 checkpoint of tests/worker/test_loader_v4.py, FP4 and FP8 experts ---

def _loader_v4():
    path = Path(__file__).resolve().parents[1] / "worker" / "test_loader_v4.py"
    spec = importlib.util.spec_from_file_location("loader_v4_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _to_fp8_experts(root: Path) -> None:
    """Rewrite the checkpoint's FP4 experts as FP8 e4m3 with 128x128 UE8M0 block scales (a
    `Base`-style "FP8 mixed" checkpoint); I = 32 < 128, so w1 and w3 have one block row each."""
    from safetensors.torch import load_file, save_file
    weights, scales = {}, {}
    files = sorted(root.glob("*.safetensors"))
    every = {f: load_file(f) for f in files}
    for f, tensors in every.items():
        for n, t in tensors.items():
            if ".ffn.experts." in n:
                (weights if n.endswith(".weight") else scales)[n] = (f, t)
    for n, (f, t) in weights.items():
        sname = n[: -len("weight")] + "scale"
        sf, s = scales[sname]
        q, qs = quant.quantize_fp8_block(quant.dequantize_fp4(t, s, 32, torch.float32))
        every[f][n], every[sf][sname] = q, qs
    for f, tensors in every.items():
        save_file(tensors, f)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "expert_dtype": "fp8"}))


@pytest.fixture(scope="module", params=["fp4", "fp8"])
def checkpoint(request, tmp_path_factory) -> Path:
    module = _loader_v4()
    tmp = tmp_path_factory.mktemp(f"v4{request.param}")
    (tmp / "cfg").mkdir()
    (tmp / "cfg" / "config.json").write_text(json.dumps(module.CONFIG))
    truth = load_model(LoadConfig(model=str(tmp / "cfg"), load_format="dummy", seed=5,
                                  dtype="float32")).model.state_dict()
    module.write_original(tmp / "original", truth)
    if request.param == "fp8":
        _to_fp8_experts(tmp / "original")
    return tmp / "original"


def _expert_modules(model) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for m in _expert_modules(model)
               for p in m.parameters())


def _checkpoint_expert_bytes(root: Path) -> int:
    from safetensors import safe_open
    total = 0
    for f in root.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for n in h.keys():
                if ".ffn.experts." in n:
                    t = h.get_tensor(n)
                    total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loader_keeps_experts_packed_and_greedy_is_unchanged(checkpoint, dtype):
    packed = load_model(LoadConfig(model=str(checkpoint), dtype=dtype)).model
    dense = load_model(LoadConfig(model=str(checkpoint), dtype=dtype), packed_experts=False).model
    experts = _expert_modules(packed)
    assert experts and all(m.weight_format is not None for m in experts)
    assert all(m.weight_format is None for m in _expert_modules(dense))
    # resident expert bytes are the checkpoint's (codes + scales), not 2 bytes per value
    assert _expert_bytes(packed) == _checkpoint_expert_bytes(checkpoint)
    for m, ref in zip(experts, _expert_modules(dense)):
        for got, want in zip(m.dense_weights(ref.gate_up_proj.dtype),
                             (ref.gate_up_proj, ref.down_proj)):
            assert torch.equal(got, want)
    assert _greedy(packed) == _greedy(dense)
    # after decoding no derived dense copy was made
    assert _expert_bytes(packed) == _checkpoint_expert_bytes(checkpoint)
    assert all(m._packs is None for m in experts)


def _greedy(model, after_step=None, steps: int = 12) -> list[list[int]]:
    """Two requests decoded greedily through the paged harness; `after_step()` runs after
    every forward (an EPLB balancer's step)."""
    prompts = [[5, 9, 17, 3, 44, 2, 8], [60, 1, 7]]
    harness = PagedHarness(model, max_reqs=2, max_len=48)
    logits = harness.step([0, 1], prompts)
    seqs = [[int(logits[6].argmax())], [int(logits[9].argmax())]]
    for _ in range(steps):
        if after_step is not None:
            after_step()
        logits = harness.step([0, 1], [[s[-1]] for s in seqs])
        for i in range(2):
            seqs[i].append(int(logits[i].argmax()))
    return seqs


def test_eplb_rebalance_with_packed_experts_keeps_greedy(checkpoint):
    """EPLB with redundant slots on checkpoint-format experts: the replicas get the codes and
    the scales, a rebalance moves both, and the greedy tokens stay those without EPLB."""
    _check_eplb(checkpoint)


def _check_eplb(checkpoint: Path) -> None:
    from wideserve.config.eplb import EplbConfig
    from wideserve.worker.eplb_balancer import EpGroup, ExpertBalancer
    load = LoadConfig(model=str(checkpoint), dtype="float32")
    want = _greedy(load_model(load).model)
    model = load_model(load).model
    layers = [m for n, m in _named_experts(model) if n.startswith("model.")]
    cfg = EplbConfig(num_redundant_experts=4, window_size=2, step_interval=3,
                     layers_per_step=2)
    bal = ExpertBalancer("target", layers, layers[0].num_experts, cfg, EpGroup(),
                         torch.device("cpu"))
    assert all(m.gate_up_proj_scale.shape[0] == m.num_experts + 4 for m in layers)
    before = bal.placement.clone()
    # One rank: the policy has no ranks to balance and keeps the placement, so the plan is
    # a rotation of every layer's slots (the moves are what this test is about).
    bal._choose = lambda logical: bal.placement.roll(1, dims=1)
    assert _greedy(model, bal.step) == want
    assert bal.stats.rebalances >= 1 and not torch.equal(bal.placement, before)
    bal.verify_weights()             # every slot holds its logical expert's codes and scales


def test_expert_parallel_ranks_load_their_packed_experts(checkpoint):
    """Under expert parallelism each rank's slots hold the codes and scales of its experts
    (the shard filter slices the scale stacks with the codes), redundant slots included."""
    _check_ep_shards(checkpoint)


def _check_ep_shards(checkpoint: Path) -> None:
    from wideserve.worker.expert_shard import ExpertPlacement
    load = LoadConfig(model=str(checkpoint), dtype="bfloat16")
    full = dict(_named_experts(load_model(load).model))
    for rank in (0, 1):
        part = load_model(load, (2, rank, 2)).model
        for name, m in _named_experts(part):
            ref = full[name]
            slots = ExpertPlacement(ref.num_experts, 2, rank, 2).slot_experts
            assert m.weight_format == ref.weight_format and len(slots) == m.num_local_experts
            leaves = [n for n, _ in m.named_parameters()]
            assert len(leaves) == (6 if m.weight_format.has_global else 4)
            for leaf in leaves:
                assert torch.equal(getattr(m, leaf), getattr(ref, leaf)[slots]), (name, leaf)


def _named_experts(model) -> list[tuple[str, RoutedExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


# --- per-expert checkpoints of other families: V4.1's official names (MXFP4), Qwen3-MoE FP8
# (fp32 `weight_scale_inv` per 128 x 128 block, as HF / vLLM write them) and ModelOpt NVFP4 ---

def _qwen3_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Qwen3 FP8: one fp32 scale amax / 448 per 128 x 128 block (the tiny experts are one
    block), not a power of two."""
    assert max(w.shape) <= 128
    s = (w.abs().max() / quant.FP8_E4M3_MAX).reshape(1, 1)
    return {"weight": (w / s).to(torch.float8_e4m3fn), "weight_scale_inv": s}


def _modelopt_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, s, g = quant.quantize_nvfp4(w)
    return {"weight": q, "weight_scale": s, "weight_scale_2": g, "input_scale": torch.ones(())}


def _deepseek_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, s = quant.quantize_fp4(w)
    return {"weight": q, "scale": s}


# family -> (config of a tiny model, per-expert name, quantiser, config.json additions)
_QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
          "norm_topk_prob": True, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "torch_dtype": "float32"}
_HF_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_DS_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
FAMILIES = {
    "qwen3_fp8": (_QWEN3, lambda p, e, k: f"{p}.{e}.{_HF_PROJ[k]}", _qwen3_fp8,
                  {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                           "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}}),
    "qwen3_nvfp4": (_QWEN3, lambda p, e, k: f"{p}.{e}.{_HF_PROJ[k]}", _modelopt_nvfp4,
                    {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                             "group_size": 16}}),
    # official V4.1 names: `layers.{i}.ffn.experts.{e}.w1.weight` + `.scale` (UE8M0 per 32)
    "v41_mxfp4": (None, lambda p, e, k: f"{p.removeprefix('model.')}.{e}.{_DS_PROJ[k]}",
                  _deepseek_mxfp4, {}),
}


def _v41_config() -> dict:
    sys_path = Path(__file__).resolve().parents[1] / "models"
    spec = importlib.util.spec_from_file_location("v41_helpers_q", sys_path / "v41_helpers.py")
    h = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h)
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": dict(h.B, num_nextn_predict_layers=0),
            "vision_config": {"num_hidden_layers": 0}, "torch_dtype": "float32",
            "max_position_embeddings": 4096}


def _write_family(root: Path, family: str) -> Path:
    """A random model of the family (dummy weights, fp32) saved with its routed experts per
    expert in the family's quantised format; everything else dense."""
    from safetensors.torch import save_file
    config, name_of, quantise, extra = FAMILIES[family]
    config = {**(config or _v41_config()), **extra}
    (root / "cfg").mkdir(parents=True)
    (root / "cfg" / "config.json").write_text(json.dumps(config))
    state = load_model(LoadConfig(model=str(root / "cfg"), load_format="dummy", seed=5,
                                  dtype="float32")).model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        prefix, _, leaf = n.rpartition(".")
        if leaf == "gate_up_proj" and prefix.endswith(".experts"):
            half = t.shape[1] // 2
            parts = {"gate": t[:, :half], "up": t[:, half:]}
        elif leaf == "down_proj" and prefix.endswith(".experts"):
            parts = {"down": t}
        else:
            out[n] = t.contiguous()
            continue
        for kind, stack in parts.items():
            for e in range(stack.shape[0]):
                for suffix, v in quantise(stack[e]).items():
                    out[f"{name_of(prefix, e, kind)}.{suffix}"] = v.contiguous()
    path = root / "ckpt"
    path.mkdir()
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _write_family(tmp_path_factory.mktemp(request.param), request.param)


def _per_expert_bytes(root: Path) -> int:
    """The checkpoint's expert weight bytes: codes, scales and global scales (not ModelOpt's
    activation `input_scale`, which weight-only serving does not use)."""
    from safetensors import safe_open
    total = 0
    with safe_open(root / "model.safetensors", framework="pt") as h:
        for n in h.keys():
            if ".experts." in n and not n.endswith(".input_scale"):
                t = h.get_tensor(n)
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_expert_checkpoints_stay_packed_and_greedy_is_unchanged(family_checkpoint, dtype):
    family, root = family_checkpoint
    load = LoadConfig(model=str(root), dtype=dtype)
    packed = load_model(load).model
    dense = load_model(load, packed_experts=False).model
    # the dequantised experts on the reference implementation (per-expert matmuls); the fused
    # bf16 op rounds its weighted sum once over all picks, which flips this random V4.1's
    # argmax on its own (0.12 in the logits against "loop", as much as against packed)
    for m in _expert_modules(dense):
        m.impl = "loop"
    experts = _expert_modules(packed)
    want = {"qwen3_fp8": ("fp8", "fp32"), "qwen3_nvfp4": ("nvfp4", "e4m3"),
            "v41_mxfp4": ("mxfp4", "ue8m0")}[family]
    assert experts and all((m.weight_format.kind, m.weight_format.scale_dtype) == want
                           for m in experts)
    assert all(m.weight_format is None for m in _expert_modules(dense))
    assert _expert_bytes(packed) == _per_expert_bytes(root)
    for m, ref in zip(experts, _expert_modules(dense)):
        for got, exp in zip(m.dense_weights(ref.gate_up_proj.dtype),
                            (ref.gate_up_proj, ref.down_proj)):
            assert torch.equal(got, exp)
    assert _greedy(packed) == _greedy(dense)
    assert _expert_bytes(packed) == _per_expert_bytes(root)
    assert all(m._packs is None for m in experts)


def test_per_expert_packed_experts_move_and_shard_with_their_scales(family_checkpoint):
    """Expert-parallel shards carry codes, scales and NVFP4 global scales together (V4.1's
    official prefixes have no `model.`: the shard filter still finds them); an EPLB rebalance
    moves NVFP4's global scales with the codes (the other formats' moves: the V4 test above)."""
    family, root = family_checkpoint
    if family == "qwen3_nvfp4":
        _check_eplb(root)
    _check_ep_shards(root)
