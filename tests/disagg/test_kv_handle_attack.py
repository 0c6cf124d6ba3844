"""The KV-handle attacks over HTTP, between real servers (NIXL) and through the router
(docs/disaggregation.md, "Threat model"):
- a client that reaches the prefill instance asks it for a KV handle (`do_remote_decode`)
  itself: unsigned, with a forged or stolen router header, or another secret's; a 403 each,
  no lease granted, no handle;
- a handle the router obtained for A's prompt leaks: the client sends its own request B with
  a handle forged to reach A's blocks, (a) directly to the decode instance and (b) through
  the router. B gets a 400 with a clear message, and the decode instance receives not one
  byte of A's KV (its connector counters); the real holder of A's handle is still served."""
from __future__ import annotations

import json

import httpx
import pytest

from pd_cluster import SECRET
from pd_cluster import cluster as pd_cluster
from pd_cluster import kv_config, router_post
from wideserve.disagg.peer_auth import HEADER, sign_request

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
    """A's and B's handles, as the router obtains them (a leaked handle is the attack)."""
    r = router_post(p_url, {"prompt": prompt, **GREEDY, "max_tokens": 1,
                            "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _kv_stats(url: str) -> dict:
    return httpx.get(url + "/debug/stats", timeout=30).json()["stats"]["kv_transfer"]


def test_a_client_cannot_obtain_a_kv_handle_from_the_prefill_instance(pd):
    p, d = pd["p"].url, pd["d"].url
    leg = {"prompt": A, **GREEDY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    content = json.dumps(leg).encode()
    stolen = sign_request(SECRET.encode(), "POST", "/v1/completions", content)
    other = json.dumps({**leg, "prompt": B}).encode()
    attempts = [
        ("has no x-wideserve-kv-auth header", content, {}),
        ("malformed", content, {HEADER: "v1:1:2"}),
        ("does not verify", content, {HEADER: sign_request(b"not-the-secret-0123456789",
                                                           "POST", "/v1/completions", content)}),
        # The router's real header, captured, on another body: A's signature for B's prompt.
        ("does not verify", other, {HEADER: stolen}),
    ]
    granted = _kv_stats(p)["leases_granted"]
    for why, body, headers in attempts:
        for stream in (False, True):
            sent = json.dumps({**json.loads(body), "stream": stream}).encode()
            r = httpx.post(p + "/v1/completions", content=sent, timeout=60,
                           headers={"content-type": "application/json", **headers})
            assert r.status_code == 403, r.text
            message = r.json()["error"]["message"]
            assert "only a P/D router" in message and why in message, message
            assert "kv_transfer_params" not in r.json()                 # no handle
    r = httpx.post(p + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": A}], **GREEDY,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 403, r.text
    assert _kv_stats(p)["leases_granted"] == granted        # not one lease for a client
    # The stolen header is good once, for its own body (what the router sent) ...
    headers = {"content-type": "application/json", HEADER: stolen}
    r = httpx.post(p + "/v1/completions", content=content, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["remote_mac"], r.text
    handle = r.json()["kv_transfer_params"]
    # ... and never again: a replay gets no second lease.
    r = httpx.post(p + "/v1/completions", content=content, headers=headers, timeout=60)
    assert r.status_code == 403 and "already used" in r.text, r.text
    assert _kv_stats(p)["leases_granted"] == granted + 1
    # Requests that ask for no handle need no header.
    assert _post(p, {"prompt": A, **GREEDY}).status_code == 200
    assert _post(d, {"prompt": A, **GREEDY, "kv_transfer_params": handle}).status_code == 200


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
