"""The KV connector's backends are a registry of KVConnectorWorker factories
(disagg/connector.py): it covers every name the config accepts, and its errors are clear."""
from __future__ import annotations

import pytest

from wideserve.disagg import connector
from wideserve.config.kv_transfer import CONNECTORS, KVTransferConfig


def test_registry_covers_the_configured_connectors() -> None:
    assert sorted(connector.CONNECTOR_WORKERS) == sorted(CONNECTORS)


def test_loopback_needs_its_hub_and_names_are_unique(monkeypatch) -> None:
    cfg = KVTransferConfig(kv_connector="LoopbackConnector")
    with pytest.raises(ValueError, match="LoopbackConnector connects engines in one process"):
        connector.CONNECTOR_WORKERS["LoopbackConnector"](cfg, None, None, None)
    with pytest.raises(ValueError, match="'NixlConnector' is already registered"):
        connector.register_connector("NixlConnector", connector._nixl_worker)
    monkeypatch.setattr(connector, "CONNECTOR_WORKERS", dict(connector.CONNECTOR_WORKERS))
    connector.register_connector("MyConnector", connector._loopback_worker)
    assert connector.CONNECTOR_WORKERS["MyConnector"] is connector._loopback_worker


def test_unknown_connector_is_refused_by_name() -> None:
    conn = connector.KVConnector.__new__(connector.KVConnector)
    conn.config = KVTransferConfig()
    conn.config.kv_connector = "Nope"     # past the config's own check
    with pytest.raises(ValueError, match="unknown kv_connector 'Nope'; registered: "
                                         "LoopbackConnector, NixlConnector"):
        conn._make_worker(None)
