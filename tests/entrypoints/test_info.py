"""`wideserve info` on the real V4-Flash config.json (no weights), run as a real process."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wideserve.entrypoints.cli import main
from wideserve.entrypoints.info import compress_runs

ROOT = Path(__file__).resolve().parents[2]
FLASH = ROOT / "tests" / "data" / "deepseek-v4-flash"


def flash_bytes_per_token(e_kv: float, e_ix: float) -> float:
    """reference/model-arch.md §6.2 from the config: CSA (E_kv + E_ix)/4, HCA E_kv/128."""
    cfg = json.loads((FLASH / "config.json").read_text())
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    return ratios.count(4) * (e_kv + e_ix) / 4 + ratios.count(128) * e_kv / 128


def wideserve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wideserve.entrypoints.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    procs = {kv: wideserve("info", str(FLASH), "--kv-cache-dtype", kv) for kv in ("bf16", "fp8")}
    out = {}
    for kv, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[kv] = stdout
    return out


@pytest.mark.parametrize("kv,e_kv,e_ix", [("bf16", 1024, 256), ("fp8", 584, 68)])
def test_kv_bytes_per_token(outputs, kv, e_kv, e_ix):
    want = f"{round(flash_bytes_per_token(e_kv, e_ix)):,}"
    assert want == {"bf16": "6,880", "fp8": "3,514"}[kv]         # reference §6.3
    text = outputs[kv]
    assert re.search(rf"^\s+total\s+{want}\s", text, re.M), text
    assert f"total KV per token: {want} B" in text


def test_schedule_and_params(outputs):
    text = outputs["bf16"]
    assert "architecture: DeepseekV4ForCausalLM" in text
    assert "(284.33B) total" in text                               # HF meta count, reference §1
    for line in ("attention layers 0-1: SWA(128)",
                 "attention layers 2-42: CSA(4)/HCA(128) alternating",
                 "mlp       layers 0-2: hash MoE (6 of 256)",
                 "mlp       layers 3-42: top-k MoE (6 of 256)",
                 "attention block 0: SWA(128)"):
        assert line in text, text
    # 43 windows of 128 bf16 latents (reference §6.3: 5.4 MiB)
    assert re.search(rf"^\s+window\s+0\s+{43 * 128 * 1024:,}$", text, re.M), text


def test_bad_flag_value_exits_2():
    proc = wideserve("info", str(FLASH), "--kv-cache-dtype", "fp9")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "--kv-cache-dtype" in stderr and "fp9" in stderr


def test_missing_model_dir(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["info", str(tmp_path / "empty")]) == 1
    assert "has no config.json" in capsys.readouterr().err


def test_compress_runs():
    assert compress_runs(["S", "S", "C", "H", "C", "H", "C"]) == [
        "layers 0-1: S", "layers 2-6: C/H alternating"]
    assert compress_runs(["a", "b", "a", "c", "c"], first=3, noun="block") == [
        "block 3: a", "block 4: b", "block 5: a", "blocks 6-7: c"]
    assert compress_runs(["x"]) == ["layer 0: x"]
