"""A prefill instance that is a DEP group -> a decode instance that is a DEP group (each
`serve -dp 2 --enable-expert-parallel` with a producer / consumer `--kv-transfer-config`):
each group's client routes a request to a rank; a prefill rank holds the lease of the
requests it computed and its handle names that rank's side channel; a decode rank's
connector loads the KV into its own cache; the greedy outputs equal a colocated server's
(the bundled V4; 1 torch thread per process)."""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from dist_utils import free_port_block  # noqa: E402

from entrypoints.openai.oai_server_utils import RemoteServer  # noqa: E402
from pd_cluster import router_post  # noqa: E402

SECRET = "pd-dep-test-secret-0123456789abcd"
PROMPTS = ["To be, or not to be, that is the question: whether 'tis nobler in the mind",
           "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar",
           "Now is the winter of our discontent made glorious summer by this sun",
           "All the world's a stage, and all the men and women merely players"]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
COMMON = ["--block-size", "32", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
          "--enable-debug-endpoints"]


def _complete(url: str, prompt: str, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **GREEDY, **kw}, timeout=90)
    assert r.status_code == 200, r.text
    return r.json()


def _handoff(prefill: str, decode: str, prompt: str) -> str:
    r = router_post(prefill, {"prompt": prompt, **GREEDY, "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": True}}, secret=SECRET,
                    timeout=90)
    assert r.status_code == 200, r.text
    handle = r.json()["kv_transfer_params"]
    assert handle["do_remote_prefill"] is True
    return _complete(decode, prompt, kv_transfer_params=handle)["choices"][0]["text"]


def _dep(port_base: int, kv: dict) -> list[str]:
    return COMMON + ["-dp", "2", "--enable-expert-parallel", "--dp-sync-timeout", "30",
                     "--data-parallel-rpc-port", str(port_base),
                     "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", **kv})]


def _per_rank(url: str) -> tuple[dict, list[dict]]:
    stats = httpx.get(url + "/debug/stats", timeout=30).json()["stats"]
    return stats["kv_transfer"], [r["kv_transfer"] for r in stats["per_rank"]]


def test_dep_prefill_group_to_dep_decode_group_equals_colocated():
    saved = dict(os.environ)
    os.environ.update(WIDESERVE_KV_SECRET=SECRET, UCX_NET_DEVICES="lo", UCX_MODULES="^ib")
    servers: list[RemoteServer] = []
    ports = free_port_block(12)         # one block: the two groups' RPC ports never overlap
    try:
        with ThreadPoolExecutor(2) as pool:
            p = pool.submit(RemoteServer, _dep(ports, {"kv_role": "kv_producer",
                                                       "kv_lease_s": 30}))
            d = pool.submit(RemoteServer, _dep(ports + 6, {
                "kv_role": "kv_consumer", "kv_load_failure_policy": "fail",
                "kv_load_timeout_s": 20}))
            servers = [p.result(), d.result()]
        prefill, decode = servers[0].url, servers[1].url
        # Colocated: the prefill group itself serves the whole requests.
        with ThreadPoolExecutor(4) as pool:
            expected = list(pool.map(lambda q: _complete(prefill, q)["choices"][0]["text"],
                                     PROMPTS))
        with ThreadPoolExecutor(4) as pool:        # concurrent: each group spreads them
            got = list(pool.map(lambda q: _handoff(prefill, decode, q), PROMPTS))
        assert got == expected
        total, per_rank = _per_rank(decode)
        assert [r["loads_failed"] for r in per_rank] == [0, 0]
        assert sum(r["loads_done"] for r in per_rank) == len(PROMPTS) == total["loads_done"]
        assert min(r["loads_done"] for r in per_rank) >= 1, per_rank     # both ranks loaded
        total, per_rank = _per_rank(prefill)
        assert total["leases_granted"] == len(PROMPTS)
        assert min(r["leases_granted"] for r in per_rank) >= 1, per_rank  # both ranks leased
    finally:
        for s in servers:
            s.close()
        os.environ.clear()
        os.environ.update(saved)
