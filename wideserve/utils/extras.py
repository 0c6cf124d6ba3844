"""Optional dependencies and the pip extra that installs each (pyproject.toml
[project.optional-dependencies]). A feature whose dependency is missing fails with one line
naming the extra, before it starts any work, instead of an ImportError from deep inside.

    pip install 'wideserve[pd]'       NIXL, the P/D KV transport (install torch first)
    pip install 'wideserve[oracle]'   transformers: `bench throughput --backend hf|both`
    pip install 'wideserve[bench]'    matplotlib (`bench serve --plot-dir`), the openai SDK
    pip install 'wideserve[test]'     all of the above that the test suite needs, and pytest

Plain data and importlib only: imported by the front end and the engine alike.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed; the message names the extra."""


@dataclass(frozen=True, slots=True)
class Extra:
    modules: tuple[str, ...]      # importable top-level names; any one of them will do
    package: str                  # what the user would recognise
    extra: str                    # the pip extra that installs it

    def installed(self) -> bool:
        return any(importlib.util.find_spec(m) is not None for m in self.modules)

    def message(self, what: str) -> str:
        return f"{what} needs {self.package}: pip install 'wideserve[{self.extra}]'"

    def require(self, what: str) -> None:
        if not self.installed():
            raise MissingExtraError(self.message(what))


NIXL = Extra(("nixl", "nixl_cu12"), "NIXL (nixl-cu12)", "pd")
TRANSFORMERS = Extra(("transformers",), "transformers", "oracle")
MATPLOTLIB = Extra(("matplotlib",), "matplotlib", "bench")


def require_kv_connector(kv_transfer: object | None) -> None:
    """P/D with NixlConnector needs NIXL (`--kv-transfer-config` names the feature)."""
    if kv_transfer is not None and getattr(kv_transfer, "kv_connector", None) == "NixlConnector":
        NIXL.require("--kv-transfer-config NixlConnector (P/D disaggregation)")
