"""Two "nodes" (network namespaces joined by a veth pair) x 2 ranks: node 0 runs the API server
and ranks 0-1, node 1 `serve --headless` with ranks 2-3. Rendezvous, gloo, the step-sync side
channel and the engines' sockets all go over the namespaces' own addresses. A completion
through the OpenAI server on node 0 must equal the same completion on one process, and every
rank must have served the MoE (its all-to-all counters move). Needs root (CI runs as root)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from dist_utils import free_port_block, net_namespaces

NODE0, NODE1 = "10.251.0.1", "10.251.0.2"
CLIENT = r"""
import json, sys, time, httpx
url = sys.argv[1]
deadline = time.monotonic() + 240
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("server not healthy")
    time.sleep(0.3)
outs = []
for prompt in ("To be, or not to be", "Now is the winter of"):
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt,
                   "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}, timeout=120)
    r.raise_for_status()
    outs.append(r.json()["choices"][0]["text"])
# Each rank's stats reach the front end within the engine loop's stats interval (50 ms) of
# its last step; wait for every rank's counters rather than racing the last message.
want = [f'dp_rank="{r}"' for r in range(4)]
deadline = time.monotonic() + 30
while True:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    moved = [l for l in metrics.splitlines()
             if l.startswith("wideserve:ep_all_to_all_seconds_total{")
             and float(l.rsplit(" ", 1)[1]) > 0]
    if all(any(w in l for l in moved) for w in want) or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({"texts": outs, "metrics": metrics}))
"""


def _one_process_texts() -> list[str]:
    from wideserve import LLM, SamplingParams
    llm = LLM(None, dtype="float32", block_size=32, kv_cache_memory=64 << 20, max_num_seqs=8)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(
        ["To be, or not to be", "Now is the winter of"], sp, use_tqdm=False)]


def test_two_nodes_two_ranks_each_serve_through_the_openai_server(tmp_path):
    port = free_port_block(10)
    common = ["-dp", "4", "--data-parallel-size-local", "2", "--enable-expert-parallel",
              "--data-parallel-address", NODE0, "--data-parallel-rpc-port", str(port),
              "--dp-sync-timeout", "60", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB",
              "--block-size", "32", "--dtype", "float32"]
    cli = [sys.executable, "-m", "wideserve.entrypoints.cli", "serve"]
    with net_namespaces(("ws_dep0", "ws_dep1"), (NODE0, NODE1), "ws_depv") as run_in:
        logs = [open(tmp_path / f"node{i}.log", "w") for i in (0, 1)]
        procs = []
        try:
            procs.append(run_in(0, [*cli, *common, "--served-model-name", "m", "--host", NODE0,
                                    "--port", "8000", "--log-level", "warning"], logs[0]))
            procs.append(run_in(1, [*cli, *common, "--headless",
                                    "--data-parallel-start-rank", "2"], logs[1]))
            client = run_in(0, [sys.executable, "-c", CLIENT, f"http://{NODE0}:8000"],
                            subprocess.PIPE)
            out, _ = client.communicate(timeout=300)
            assert client.returncode == 0, _logs(tmp_path)
            result = json.loads(out)
        finally:
            # The server stops every rank (remote ones too); the headless node then ends.
            for p in procs:
                if p is procs[0]:
                    p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
        assert [p.returncode for p in procs] == [0, 0], _logs(tmp_path)
    assert result["texts"] == _one_process_texts()
    for rank in range(4):
        line = next(l for l in result["metrics"].splitlines()
                    if l.startswith("wideserve:ep_all_to_all_seconds_total{")
                    and f'dp_rank="{rank}"' in l)
        assert float(line.rsplit(" ", 1)[1]) > 0


def _logs(tmp_path) -> str:
    return "\n".join(f"--- node {i} ---\n" + (tmp_path / f"node{i}.log").read_text()[-4000:]
                     for i in (0, 1))
