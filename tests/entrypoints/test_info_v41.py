"""`wideserve info` on DeepSeek-V4.1-Flash (tests/data/deepseek-v41-flash: the reference's
DeepseekV41Config() defaults), run as a real process: 890 B/token of global KV (layers 2, 8,
14 at ratio 2 and 20 at ratio 1 own NVFP4 entries of 288 B and MXFP4 keys of 68 B: 2.5 x 356)
and the per-request window rings (40 x 128 x 528 B) apart."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLASH = ROOT / "tests" / "data" / "deepseek-v41-flash"
FLASH_VISION = ROOT / "tests" / "data" / "deepseek-v41-flash-vision"


def test_config_file_is_the_reference_default():
    import os
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    ref = DeepseekV41TextConfig()
    text = json.loads((FLASH / "config.json").read_text())["text_config"]
    for key in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                "candidate_source_layer_id", "head_dim", "index_head_dim", "sliding_window",
                "num_hidden_layers", "engram_layer_ids", "engram_num_embeddings"):
        assert text[key] == getattr(ref, key), key


def test_info_prints_890_bytes_per_token_and_window_bytes_apart():
    proc = subprocess.run([sys.executable, "-m", "wideserve.entrypoints.cli", "info", str(FLASH)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "total KV per token: 890 B" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["compressed"] == ["720", "0"] and lines["indexer"] == ["170", "0"]
    assert lines["window"] == ["0", f"{40 * 128 * 528:,}"]
    assert "34 more caches read other layers' records" in out
    assert "attention layers 21-39: CSA(1) reads layer 20" in out
    assert "(16.79B) active per token" in out


def test_the_real_config_with_its_vision_tower_loads():
    """The released config (tests/data/deepseek-v41-flash-vision: the same text model and the
    reference's default 32-layer ViT) used to be refused ("wideserve serves the text model
    only"); now it builds, with the tower counted apart from the text model."""
    import os
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    from wideserve.entrypoints.info import describe_model
    config = json.loads((FLASH_VISION / "config.json").read_text())
    ref = DeepseekV41Config()
    assert config["image_token_id"] == ref.image_token_id
    for key, value in config["vision_config"].items():
        assert value == getattr(ref.vision_config, key), key
    out = describe_model(str(FLASH_VISION))
    assert "(16.79B) active per token" in out         # the text model's, as without vision
    # 32 blocks of 12.85M, patch embedding, final norm, aligner, the three delimiters
    assert "vision tower: 485,268,480 (485.27M)" in out
