"""router -> prefill -> decode over HTTP with NIXL between real server processes: greedy
outputs equal one colocated server's; a killed prefill instance and a killed decode instance
each end their requests as the policy says, with the survivors' KV pools intact afterwards.

Two prefill instances (the router balances over them), one decode instance, one router.
"""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from entrypoints.openai.oai_server_utils import RemoteServer
from pd_cluster import cluster as pd_cluster
from pd_cluster import kv_config as _kv
from pd_cluster import router_post

PROMPTS = ["To be, or not to be, that is the question: whether 'tis nobler in the mind",
           "The quick brown fox jumps over the lazy dog. " * 4,
           "Hello world, hello server, hello tokens. 0123456789 + - * / = ? ! ; : " * 2]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    specs = {"p1": _kv("kv_producer", kv_lease_s=3), "p2": _kv("kv_producer", kv_lease_s=3),
             "d": _kv("kv_consumer", kv_load_timeout_s=5)}
    with pd_cluster(tmp_path_factory.mktemp("tiny"), specs, ["p1", "p2"], ["d"]) as c:
        yield c


def _complete(url: str, prompt: str, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **GREEDY, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _handle(url: str, prompt: str) -> dict:
    """A prefill instance's answer to a prefill leg, asked as the router asks it."""
    r = router_post(url, {"prompt": prompt, **GREEDY, "max_tokens": 1,
                          "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _stats(server: RemoteServer) -> dict:
    return httpx.get(server.url + "/debug/stats", timeout=30).json()["stats"]


def _idle_and_intact(server: RemoteServer, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(server.url + "/debug/kv_integrity", timeout=30).json()
        s = state["stats"]
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_usage"] == 0:
            return state
        assert time.monotonic() < deadline, f"not idle: {state}"
        time.sleep(0.1)


def _metric(text: str, name: str, **labels: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_router_greedy_equals_colocated_streaming_and_not(cluster):
    router, d = cluster["router"], cluster["d"]
    expected = [_complete(d.url, p)["choices"][0]["text"] for p in PROMPTS]   # colocated
    got = [_complete(router, p)["choices"][0]["text"] for p in PROMPTS]
    assert got == expected
    # Streaming chat through the router equals the non-streamed colocated answer.
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    ref = httpx.post(d.url + "/v1/chat/completions", json={"messages": msgs, **GREEDY},
                     timeout=60).json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", router + "/v1/chat/completions",
                      json={"messages": msgs, "stream": True, **GREEDY}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert text == ref
    kv = _stats(d)["kv_transfer"]
    assert kv["loads_done"] == len(PROMPTS) + 1 and kv["loads_failed"] == 0
    assert kv["tokens_loaded"] > 0
    metrics = httpx.get(router + "/metrics").text
    assert _metric(metrics, "wideserve_router_remote_kv_total", used="true") == len(PROMPTS) + 1
    held = [_stats(cluster[p])["kv_transfer"]["leases_released"] for p in ("p1", "p2")]
    assert sum(held) == len(PROMPTS) + 1 and min(held) > 0        # both prefills served
    # The engines' connector metrics on each server's /metrics (disagg/connector_metrics.py).
    dm = httpx.get(d.url + "/metrics").text
    for name in ("loads_completed_total", "load_seconds_count"):
        assert _metric(dm, "wideserve:kv_transfer_" + name) == len(PROMPTS) + 1, name
    assert _metric(dm, "wideserve:kv_transfer_bytes_loaded_total") == kv["bytes_loaded"] > 0
    assert _metric(dm, "wideserve:kv_transfer_loads_failed_total") == 0
    # A producer frees after its last output: its snapshot arrives with the next heartbeat.
    deadline = time.monotonic() + 10
    while True:
        pm = [httpx.get(cluster[p].url + "/metrics").text for p in ("p1", "p2")]
        released = sum(_metric(m, "wideserve:kv_transfer_leases_released_total") for m in pm)
        if released == len(PROMPTS) + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert released == len(PROMPTS) + 1
    for name in ("p1", "p2", "d"):
        _idle_and_intact(cluster[name])


def test_responses_route_prefill_then_decode(cluster):
    router, d = cluster["router"], cluster["d"]
    body = {"input": PROMPTS[0], "max_output_tokens": 8, "temperature": 0.0}
    expected = httpx.post(d.url + "/v1/responses", json=body, timeout=60)
    assert expected.status_code == 200, expected.text
    done0 = _stats(d)["kv_transfer"]["loads_done"]
    got = httpx.post(router + "/v1/responses", json=body, timeout=60)
    assert got.status_code == 200, got.text
    # Item ids are random; the content is greedy and must agree.
    assert [o.get("content") for o in got.json()["output"]] == \
        [o.get("content") for o in expected.json()["output"]]
    assert _stats(d)["kv_transfer"]["loads_done"] == done0 + 1     # decoded with remote KV
    assert "kv_transfer_params" not in got.json()


def _conversation(url: str) -> tuple[list[str], str]:
    """Two turns, the second continuing the first by previous_response_id."""
    texts, previous = [], None
    for turn in (PROMPTS[0], PROMPTS[1]):
        body = {"input": turn, "max_output_tokens": 8, "temperature": 0.0,
                "ignore_eos": True, "previous_response_id": previous}
        r = httpx.post(url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
        texts.append(r.json()["output"][0]["content"][0]["text"])
    return texts, previous


def test_responses_with_state_through_the_router(cluster):
    """The decode instance holds the store: turn 2 through the router continues turn 1
    (the prefill leg stores nothing and is not asked for previous_response_id), and the
    stored-response routes reach the decode instance."""
    router, d = cluster["router"], cluster["d"]
    expected, _ = _conversation(d.url)
    got, last = _conversation(router)
    assert got == expected
    stored = httpx.get(f"{router}/v1/responses/{last}", timeout=30)
    assert stored.status_code == 200 and stored.json()["id"] == last
    items = httpx.get(f"{router}/v1/responses/{last}/input_items", params={"order": "asc"},
                      timeout=30)
    assert items.status_code == 200
    assert items.json()["data"][0]["content"][0]["text"] == PROMPTS[1]
    assert httpx.post(f"{router}/v1/responses/{last}/cancel", timeout=30).status_code == 400
    assert httpx.delete(f"{router}/v1/responses/{last}", timeout=30).json()["deleted"] is True
    gone = httpx.get(f"{router}/v1/responses/{last}", timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    _idle_and_intact(d)


def test_prefill_killed_before_the_pull_recomputes_on_decode(cluster):
    p2, d, router = cluster["p2"], cluster["d"], cluster["router"]
    expected = _complete(d.url, PROMPTS[2])["choices"][0]["text"]
    handle = _handle(p2.url, PROMPTS[2])["kv_transfer_params"]
    p2.close(signal.SIGKILL, group=True)
    failed0 = _stats(d)["kv_transfer"]["loads_failed"]
    got = _complete(d.url, PROMPTS[2], kv_transfer_params=handle)
    assert got["choices"][0]["text"] == expected
    kv = _stats(d)["kv_transfer"]
    assert kv["loads_failed"] == failed0 + 1, kv
    # The router keeps serving: prefill legs to the dead instance fall back to decode.
    for p in PROMPTS:
        assert _complete(router, p)["choices"][0]["text"] == _complete(d.url, p)["choices"][0]["text"]
    metrics = httpx.get(router + "/metrics").text
    assert _metric(metrics, "wideserve_router_upstream_errors_total", role="prefill") >= 1
    _idle_and_intact(d)
    _idle_and_intact(cluster["p1"])


def test_decode_killed_holding_a_handle_frees_prefill_blocks_on_lease_expiry(cluster):
    p1, d, router = cluster["p1"], cluster["d"], cluster["router"]
    expired0 = _stats(p1)["kv_transfer"]["leases_expired"]
    r = _handle(p1.url, PROMPTS[0])
    assert r["kv_transfer_params"]["do_remote_prefill"] is True
    assert _stats(p1)["kv_usage"] > 0                      # held under the 3 s lease
    d.close(signal.SIGKILL, group=True)
    # Through the router the decode leg now fails fast with a clear error, not a hang ...
    r = httpx.post(router + "/v1/completions", json={"prompt": PROMPTS[1], **GREEDY}, timeout=30)
    assert r.status_code == 502 and "decode instance unreachable" in r.text
    # ... and the prefill instance frees the held blocks when their leases expire.
    _idle_and_intact(p1, timeout=15)
    assert _stats(p1)["kv_transfer"]["leases_expired"] >= expired0 + 1

