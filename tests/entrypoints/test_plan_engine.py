"""`wideserve info --plan` against what the engine allocates on the CPU for the bundled tiny
V4 and V4.1 models: device weights per rank (expert-sharded, with EPLB replicas and the
drafter) from the loader, and the KV cache capacity from the engine's own sizing and
allocation (kv_cache/groups.py), each within 5%."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wideserve.config import CacheConfig, LoadConfig, SchedulerConfig
from wideserve.kv_cache.groups import allocate_kv_tensors, build_kv_cache_config
from wideserve.entrypoints.cli import main as cli_main
from wideserve.entrypoints.info import _draft_specs
from wideserve.entrypoints.plan import (CHECKPOINT_EXPERT_BYTES, GIB, engine_kv_sizes,
                                        host_resident_modules, weight_bytes)
from wideserve.worker.model_loader import BUNDLED_MODEL, build_model, load_model, read_config
from wideserve.models.registry import resolve_model_class

ASSETS = BUNDLED_MODEL.parent
TINY = {"v4": ASSETS / "shakespeare-v4-tiny", "v41": ASSETS / "shakespeare-v41-tiny"}
DATA = Path(__file__).resolve().parents[1] / "data"


def _meta(path: Path) -> torch.nn.Module:
    cfg = read_config(path)
    cls = resolve_model_class(cfg)
    return build_model(cls, cls.config_class.from_dict(cfg), torch.bfloat16,
                       torch.device("meta"))


def _device_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes outside host-resident modules (what the device would hold)."""
    host = host_resident_modules(model)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n.rsplit(".", 1)[0] not in host)


@pytest.mark.parametrize("family", sorted(TINY))
def test_weights_per_rank_with_replicas_match_the_loader(family: str) -> None:
    w = weight_bytes(_meta(TINY[family]))
    assert w.draft > 0 and w.draft_experts > 0        # both tiny models carry a drafter
    load = LoadConfig(model=str(TINY[family]), dtype="bfloat16", load_format="dummy")
    for ranks, redundant in ((2, 0), (2, 2)):
        loaded = load_model(load, (ranks, 0, redundant)).model
        actual = _device_bytes(loaded)
        assert w.per_rank(ranks, True, redundant) == pytest.approx(actual, rel=0.05), \
            (family, ranks, redundant)
    # the replicas are what they cost: two more experts per layer over two ranks
    assert w.per_rank(2, True, 2) > w.per_rank(2, True, 0)


@pytest.mark.parametrize("family,speculative", [("v4", False), ("v4", True), ("v41", False),
                                                ("v41", True)])
def test_kv_capacity_matches_the_engine_allocation(family: str, speculative: bool) -> None:
    model = _meta(TINY[family])
    specs = model.kv_cache_specs("auto")
    if speculative:
        specs = {**specs, **_draft_specs(model, "auto")}
    seqs, tokens, budget = 8, 256, 48 << 20
    per_token, per_request = engine_kv_sizes(specs, seqs, tokens)
    planned = int((budget - per_request * seqs) // per_token)
    cfg = build_kv_cache_config(specs, CacheConfig(kv_cache_memory=budget),
                                SchedulerConfig(max_num_seqs=seqs,
                                                max_num_batched_tokens=tokens))
    caches = allocate_kv_tensors(cfg, "cpu")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in caches.values()}
    allocated = sum(storages.values())
    assert cfg.capacity_tokens == pytest.approx(planned, rel=0.05)
    assert budget * 0.95 <= allocated <= budget
    # The plan's per-token cost is the padded pool's, not the bare record sum: it names what
    # one more token of context takes from the budget.
    assert per_token * cfg.capacity_tokens <= allocated


def test_checkpoint_expert_bytes_for_v4_flash() -> None:
    w = weight_bytes(_meta(DATA / "deepseek-v4-flash"))
    values = 256 * 44 * 3 * 2048 * 4096            # experts x (43 + 1 MTP) x 3 matrices
    assert w.expert_values == values
    assert w.experts_as("fp4") == pytest.approx(values * (0.5 + 1 / 32))
    assert w.experts_as("fp4") / w.experts == pytest.approx(CHECKPOINT_EXPERT_BYTES["fp4"] / 2)
    assert w.experts / GIB == pytest.approx(528.0)


def test_cli_plan_prints_drafter_replicas_checkpoint_and_reserve(capsys) -> None:
    assert cli_main(["info", str(DATA / "deepseek-v4-flash"), "--plan", "-dp", "8",
                     "--enable-expert-parallel", "--num-redundant-experts", "32",
                     "--memory-per-rank", "141GiB", "--max-model-len", "128K",
                     "--kv-cache-dtype", "fp8", "--speculative"]) == 0
    out = capsys.readouterr().out
    # V4 names fp4 and its loader keeps FP4 experts packed: the weights are counted so
    w = weight_bytes(_meta(DATA / "deepseek-v4-flash"))
    kept = w.with_experts_as("fp4")
    per_rank = kept.per_rank(8, True, 32) / GIB
    for needle in ("+ 32 EPLB replicas", "of which drafter (MTP / DSpark blocks)",
                   f"routed experts per rank: {kept.experts / 8 / GIB:.2f} GiB as FP4 with "
                   f"scales, kept in the checkpoint's format ({w.experts / 8 / GIB:.2f} GiB "
                   "if dequantised to bfloat16)",
                   f"- weights {per_rank:.2f} GiB", "activation reserve:", "KV capacity:",
                   "requests at 131,072 tokens"):
        assert needle in out, needle
    assert "config.json names no expert format" not in out
    assert "if the experts were held" not in out and "as loaded today" not in out


def test_cli_plan_refusals(capsys) -> None:
    assert cli_main(["info", "--plan", "--num-redundant-experts", "4"]) == 1
    assert "--num-redundant-experts needs --enable-expert-parallel" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["info", "--plan", "--num-redundant-experts", "-1"])
    assert e.value.code == 2
    assert "--num-redundant-experts: must be >= 0" in capsys.readouterr().err


def _quant_families():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "layers" / "test_quant_experts.py"
    spec = importlib.util.spec_from_file_location("quant_experts_families", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family,fmt", [("v41_mxfp4", "fp4"), ("qwen3_nvfp4", "nvfp4"),
                                        ("qwen3_fp8", "fp8")])
def test_experts_counted_as_stored_match_the_loader(family: str, fmt: str,
                                                    tmp_path: Path) -> None:
    """The plan counts routed experts in the checkpoint's format (as `info --plan` does for a
    config naming it, or V4.1's released MXFP4); the loader holds a rank's packed experts,
    EPLB replicas included, in the same bytes: within 5%, whole rank and experts alone."""
    from wideserve.entrypoints.info import _expert_format
    from wideserve.layers.experts import RoutedExperts
    path = _quant_families()._write_family(tmp_path, family)
    config = read_config(path)
    assert _expert_format(config) == (fmt, family.startswith("v41"))
    dense = weight_bytes(_meta(path))
    w = dense.with_experts_as(fmt)
    for ranks, redundant in ((1, 0), (2, 2)):
        loaded = load_model(LoadConfig(model=str(path), dtype="bfloat16"),
                            (ranks, 0, redundant)).model
        experts = sum(p.numel() * p.element_size() for m in loaded.modules()
                      if isinstance(m, RoutedExperts) for p in m.parameters())
        assert w.per_rank(ranks, True, redundant) == pytest.approx(_device_bytes(loaded),
                                                                   rel=0.05)
        assert w.per_rank(ranks, True, redundant) - w.rest == pytest.approx(experts, rel=0.05)
    assert w.experts < 0.6 * dense.experts          # not the dequantised bf16 size
