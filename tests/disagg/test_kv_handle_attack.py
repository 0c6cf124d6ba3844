"""The KV-handle attack over HTTP, between real servers (NIXL) and through the router
(docs/disaggregation.md, "Threat model"): a client asks the prefill instance for A's prompt
(A's KV is held under a lease), then sends its own request B with a handle forged to reach
A's blocks, (a) directly to the decode instance and (b) through the router. B gets a 400
with a clear message, and the decode instance receives not one byte of A's KV (its
connector counters); the real holder of A's handle is still served."""
from __future__ import annotations

import httpx
import pytest

from pd_cluster import cluster as pd_cluster
from pd_cluster import kv_config

# Same token count (the tiny tokenizer is byte-level BPE): the forged handle passes the
# length check, so only its binding to A's lease, blocks and prompt can refuse it.
A = "The quick brown fox jumps over the lazy dog. " * 4
B = "The lazy brown dog jumps over the quick fox. " * 4
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    specs = {"p": kv_config("kv_producer", kv_lease_s=60),
             "d": kv_config("kv_consumer", kv_load_timeout_s=5)}
    with pd_cluster(tmp_path_factory.mktemp("tiny"), specs, ["p"], ["d"]) as c:
        yield c


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _prefill(p_url: str, prompt: str) -> dict:
    r = _post(p_url, {"prompt": prompt, **GREEDY, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _kv_stats(url: str) -> dict:
    return httpx.get(url + "/debug/stats", timeout=30).json()["stats"]["kv_transfer"]


def test_forged_handle_for_another_prompts_blocks(pd):
    p, d, router = pd["p"].url, pd["d"].url, pd["router"]
    a, b = _prefill(p, A), _prefill(p, B)
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    h_a, h_b = a["kv_transfer_params"], b["kv_transfer_params"]
    assert h_a["remote_block_ids"] != h_b["remote_block_ids"]
    before = _kv_stats(d)
    # B's own handle, re-pointed at A's blocks; A's handle (leaked) sent with B's prompt.
    forged = [{**h_b, "remote_block_ids": h_a["remote_block_ids"]}, h_a]
    for handle in forged:
        for stream in (False, True):                                    # (a) directly
            r = _post(d, {"prompt": B, **GREEDY, "stream": stream,
                          "kv_transfer_params": handle})
            assert r.status_code == 400, r.text
            assert "kv_transfer_params: the handle" in r.json()["error"]["message"], r.text
    for body in ({"prompt": B}, {"prompt": [B, B]}):                    # (b) via the router
        r = _post(router, {**body, **GREEDY, "kv_transfer_params": forged[0]})
        assert r.status_code == 400, r.text
        assert "kv_transfer_params is set by the router" in r.json()["error"]["message"]
    after = _kv_stats(d)
    # Not one byte of A's (or anybody's) KV reached the decode instance.
    for key in ("loads_started", "bytes_loaded", "pages_loaded", "tokens_loaded"):
        assert after[key] == before[key], (key, before, after)
    # A's and B's real holders are still served, with their own KV.
    for prompt, handle in ((A, h_a), (B, h_b)):
        r = _post(d, {"prompt": prompt, **GREEDY, "kv_transfer_params": handle})
        assert r.status_code == 200, r.text
    assert _kv_stats(d)["loads_done"] == before["loads_done"] + 2
    # The router's own P/D path still works (it mints the handle from the prefill's answer).
    r = _post(router, {"prompt": B, **GREEDY})
    assert r.status_code == 200, r.text
    assert _kv_stats(d)["loads_done"] == before["loads_done"] + 3
