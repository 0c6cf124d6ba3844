"""A feature whose optional dependency is missing fails at once with one line naming the pip
extra that installs it (wideserve/utils/extras.py), not with an ImportError from deep inside."""
from __future__ import annotations

import importlib.util
import json

import pytest

from wideserve import LLM
from wideserve.utils import extras
from wideserve.entrypoints import cli

PD = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})


@pytest.fixture
def hide(monkeypatch):
    """hide(*names): make find_spec report these top-level modules as not installed."""
    real = importlib.util.find_spec

    def install(*names: str) -> None:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, **k: None if name.split(".")[0] in names
                            else real(name, *a, **k))
    return install


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bench_throughput_hf_without_transformers_names_oracle(hide, capsys) -> None:
    hide("transformers")
    assert cli.main(["bench", "throughput", "--backend", "both", "--num-prompts", "1"]) == 2
    assert _one_line(capsys) == ("wideserve bench throughput: error: --backend both needs "
                                 "transformers: pip install 'wideserve[oracle]'")


def test_bench_serve_plots_without_matplotlib_names_bench(hide, capsys) -> None:
    hide("matplotlib")
    assert cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9",
                     "--plot-dir", "out"]) == 2
    assert _one_line(capsys).endswith("--plot-dir needs matplotlib: pip install "
                                      "'wideserve[bench]'")


def test_serve_pd_without_nixl_names_pd(hide, capsys) -> None:
    hide("nixl", "nixl_cu12")
    assert cli.main(["serve", "--kv-transfer-config", PD]) == 2
    assert "NixlConnector (P/D disaggregation) needs NIXL (nixl-cu12): pip install " \
           "'wideserve[pd]'" in _one_line(capsys)


def test_serve_pd_without_secret_names_the_variable(monkeypatch, capsys) -> None:
    if not extras.NIXL.installed():
        pytest.fail("NIXL is part of the test install (.ci/run); it is missing")
    monkeypatch.delenv("WIDESERVE_KV_SECRET", raising=False)
    assert cli.main(["serve", "--kv-transfer-config", PD]) == 2
    assert "$WIDESERVE_KV_SECRET" in _one_line(capsys)


def test_offline_pd_without_nixl_names_pd(hide) -> None:
    hide("nixl", "nixl_cu12")
    with pytest.raises(extras.MissingExtraError, match=r"pip install 'wideserve\[pd\]'"):
        LLM(kv_transfer_config=PD)


def test_every_extra_named_in_messages_exists_in_pyproject() -> None:
    import tomllib
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml")
                              .read_text())
    declared = pyproject["project"]["optional-dependencies"]
    for extra in (extras.NIXL, extras.TRANSFORMERS, extras.MATPLOTLIB):
        assert extra.extra in declared
    assert any(d.startswith("nixl-cu12") for d in declared["pd"])
    assert any(d.startswith("transformers") for d in declared["oracle"])
    assert any(d.startswith("matplotlib") for d in declared["bench"])
