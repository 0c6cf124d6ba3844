"""The startup block of `wideserve serve` names the model, the parallel layout, the KV
capacity in tokens and in full-context requests, every feature's setting, the kernels and the
endpoints; weight loading shows a progress bar."""
from __future__ import annotations

import torch

from wideserve.config import engine_config_from_kwargs
from wideserve.serving.startup import PREFIX, features, startup_summary
from wideserve.kernels import describe
from wideserve.worker.model_loader import _with_progress

INFO = {"architecture": "DeepseekV4ForCausalLM", "dtype": "bfloat16", "num_params": 13_760_000_000,
        "num_active_params": 1_000_000_000, "kv_capacity_tokens": 1_114_112,
        "kv_block_size": 128}
URL = "http://127.0.0.1:8000"


def _summary(config, kernels=("k",)) -> dict[str, str]:
    text = startup_summary(INFO, config, ["DeepSeek-V4-Flash"], 131072, URL,
                           None if kernels is None else list(kernels))
    lines = text.splitlines()
    assert all(line.startswith(PREFIX) for line in lines)
    keyed: dict[str, str] = {}
    key = ""
    for line in lines:
        body = line.removeprefix(PREFIX)
        if body[:12].strip():
            key = body[:12].strip().rstrip(":")
        keyed[key] = keyed.get(key, "") + body[12:] + "\n"
    return keyed


def test_single_engine_defaults() -> None:
    s = _summary(engine_config_from_kwargs(model="/m/DeepSeek-V4-Flash"))
    assert s["model"].startswith("DeepSeek-V4-Flash (DeepseekV4ForCausalLM, bfloat16, cpu) "
                                 "from /m/DeepSeek-V4-Flash")
    assert s["parameters"] == "13.76B total, 1.00B active per token\n"
    assert s["parallel"] == "one engine on cpu\n"
    assert s["context"].startswith("131072 tokens per request at most")
    assert "1,114,112 tokens of context in total, shared by all running requests" in s["KV cache"]
    assert "room for 8 requests at the full 131,072-token context" in s["KV cache"]
    assert "at most 64 run at once" in s["KV cache"] and "prefix caching on" in s["KV cache"]
    assert s["features"] == ("speculative decoding off; EPLB off; P/D off; prefix caching on; "
                             "eager\n")
    assert s["kernels"] == "k\n"
    assert s["serving"].startswith(f'{URL}/v1 as "DeepSeek-V4-Flash"; health {URL}/health')


def test_dep_eplb_mtp_pd_are_all_named() -> None:
    config = engine_config_from_kwargs(
        model="/m/x", data_parallel_size=8, data_parallel_size_local=4,
        enable_expert_parallel=True, enable_eplb=True,
        eplb_config={"step_interval": 3000, "window_size": 1000, "num_redundant_experts": 32},
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        enable_prefix_caching=False)
    s = _summary(config)
    assert s["parameters"].startswith("13.76B on each rank (rank 0's count: its 1/8 of the "
                                      "routed experts")
    assert s["parallel"].startswith("DEP (data-parallel attention, expert-parallel MoE), 8 "
                                    "ranks; this node runs ranks 0-3 on cpu")
    assert "tokens of context per rank" in s["KV cache"]
    assert s["features"] == ("MTP speculation k=3; EPLB every 3000 steps over a 1000-step "
                             "window, 32 redundant experts; P/D kv_consumer over NixlConnector "
                             "(pull); prefix caching off; eager\n")


def test_speculation_methods() -> None:
    for spec, text in (({"method": "ngram", "num_speculative_tokens": 2,
                         "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                        "n-gram speculation k=2 (n 2-4)"),
                       ({"method": "dspark", "num_speculative_tokens": 5},
                        "DSpark speculation k=5")):
        assert features(engine_config_from_kwargs(speculative_config=spec)).startswith(text)


def test_kernels_lines_are_the_engines_report() -> None:
    engine = ["C++ CPU kernels, avx2 build (installed); CPU features: avx2",
              "GEMM kernel per token bucket (1 thread; ...)",
              "  linear      64x32  micro 1-16, brgemm 17+  (1 4 16 16 16 16 us)"]
    text = startup_summary({**INFO, "kernels": engine}, engine_config_from_kwargs(), ["m"],
                           1024, URL)
    lines = [line.removeprefix(PREFIX) for line in text.splitlines()]
    at = lines.index("kernels:    " + engine[0])
    assert lines[at + 1:at + 3] == [" " * 12 + line for line in engine[1:]]
    assert lines[at + 3].startswith("serving:")


def test_kernels_line_without_an_engine_report_names_the_build() -> None:
    s = _summary(engine_config_from_kwargs(), kernels=None)
    assert s["kernels"] == describe("cpu") + "\n"
    assert "C++ CPU kernels" in s["kernels"] and "CPU features:" in s["kernels"]
    cuda = startup_summary(INFO, engine_config_from_kwargs(device="cuda"), ["m"], 1024, URL)
    assert "cuda: torch's kernels" in cuda


def test_the_engine_reports_its_kernels(monkeypatch, tmp_path) -> None:
    """The engine's ModelInfo carries the lines the server prints: the build and the GEMM
    choice of the loaded model (measured here, in a cache of the test's own)."""
    from wideserve.engine.engine_core import EngineCore
    from wideserve.kernels import choice

    monkeypatch.setenv(choice.ENV_FORCE, "auto")
    monkeypatch.setenv(choice.ENV_CACHE, str(tmp_path))
    choice.default_choice.cache_clear()
    try:
        core = EngineCore(engine_config_from_kwargs(kv_cache_memory="64MiB", max_num_seqs=4))
        kernels = core.model_info.kernels
    finally:
        choice.default_choice.cache_clear()
    assert kernels[0] == describe("cpu")
    if choice.KernelChoice().runnable("linear", torch.bfloat16)[1:]:   # more than one to time
        assert kernels[1].startswith("GEMM kernel per token bucket")
        # The bundled DeepSeek-V4's GEMMs: its nn.Linear layers and the routed experts (its
        # shared expert runs gate and up as two nn.Linear, not one fused "qkv" GEMM).
        assert {line.split()[0] for line in kernels[2:]} >= {"linear", "experts"}
    text = startup_summary({**INFO, "kernels": kernels}, engine_config_from_kwargs(), ["m"],
                           1024, URL)
    assert all(line in text for line in kernels)


def test_weight_loading_progress_reaches_the_total(capsys) -> None:
    model = torch.nn.Linear(64, 32)
    tensors = [("weight", torch.zeros(32, 64)), ("bias", torch.zeros(32))]
    assert list(_with_progress(iter(tensors), model, show=True)) == tensors
    err = capsys.readouterr().err
    assert "Loading weights: 100%" in err and "8.12k/8.12k" in err
    list(_with_progress(iter(tensors), model, show=False))
    assert "Loading weights" not in capsys.readouterr().err
