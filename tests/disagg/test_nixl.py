"""NIXL pulls and pushes between two processes (UCX over loopback) and between two network namespaces
with UCX_TLS=tcp; the side channel refuses peers without the shared secret."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from wideserve.disagg.side_channel import (SideChannelClient, SideChannelError,
                                           SideChannelServer)

PEER = str(Path(__file__).with_name("nixl_peer.py"))
SECRET = "a-test-secret-of-32-bytes-length"


def _env(dev: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WIDESERVE_KV_SECRET=SECRET,
               UCX_NET_DEVICES=dev, UCX_MODULES="^ib", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _load(tmp_path, op: str, prefix: list[str], prefix2: list[str], dev: str, dev2: str,
          host: str, **extra: str) -> tuple[dict, dict]:
    port_file = str(tmp_path / "port.json")
    prod = subprocess.Popen([*prefix, sys.executable, PEER, "producer", host, port_file, op],
                            env=_env(dev, **extra), stdout=subprocess.PIPE, text=True)
    try:
        # Started together: each spends most of its time importing torch.
        cons = subprocess.run([*prefix2, sys.executable, PEER, "consumer", host, port_file, op],
                              env=_env(dev2, **extra), capture_output=True, text=True,
                              timeout=90)
        assert cons.returncode == 0, cons.stderr[-3000:]
        out, _ = prod.communicate(timeout=60)
        return json.loads(cons.stdout.strip().splitlines()[-1]), \
            json.loads(out.strip().splitlines()[-1])
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait()


@pytest.mark.parametrize("op", ["pull", "push"])
def test_nixl_load_between_two_processes(tmp_path, op):
    cons, prod = _load(tmp_path, op, [], [], "lo", "lo", "127.0.0.1")
    assert cons["ok"], cons
    assert cons["pages"] == 8 + 1          # window group: only the page the window reads
    # The forged handle (req0's lease id, other block ids) was refused, and counted.
    assert "does not match the lease" in cons["forged"]
    assert "already served" in cons["again"]        # a handle is served once
    assert prod == {"released": ["req0"], "pushed": int(op == "push"), "refused": 0,
                    "refused_after_cancel": 0, "leases_refused_mismatch": 1,
                    "leases_refused_unknown": 1}


def test_nixl_push_faults_between_two_processes(tmp_path):
    """An expired lease refuses the push. A producer that stalls (stops itself) between its
    deadline check and posting the write: the load fails within the timeout + the cancel
    timeout with its blocks quarantined, and no new load from that producer starts; resumed,
    the producer posts the stale write, which lands in the quarantined pages only; the fence
    (the producer's word that the write stopped) frees them, and once reused they stay
    intact. A push request overtaken by its cancel is refused on arrival."""
    cons, prod = _load(tmp_path, "faults", [], [], "lo", "lo", "127.0.0.1")
    assert cons["req0"] is True
    assert "refused the push" in cons["expired"] and "lease expired" in cons["expired"]
    assert "timed out" in cons["stalled"] and "did not answer" in cons["stalled"], cons
    assert 3 <= cons["stalled_s"] < 3 + 2 + 3, cons        # timeout + cancel timeout (+ slack)
    assert cons["quarantined"] and cons["untouched_while_stalled"], cons
    assert "has not confirmed" in cons["refused_while_fenced"], cons
    assert cons["fenced"] and cons["landed_before_fence"], cons
    assert cons["reused_intact"], cons
    assert "cancelled this push" in cons["overtaken"] and cons["intact_after_overtaken"], cons
    assert prod["released"] == ["expired", "late", "req0", "req1"], prod
    assert prod["refused_after_cancel"] == 1, prod


NS = ("ws_pd0", "ws_pd1")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    assert shutil.which("ip"), "iproute2 is needed for the two-namespace test (.ci/run)"
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    try:
        _ip("netns", "add", NS[0])
        _ip("netns", "add", NS[1])
        _ip("link", "add", "ws_pdv0", "type", "veth", "peer", "name", "ws_pdv1")
        _ip("link", "set", "ws_pdv0", "netns", NS[0])
        _ip("link", "set", "ws_pdv1", "netns", NS[1])
        _ip("-n", NS[0], "addr", "add", "10.251.0.1/24", "dev", "ws_pdv0")
        _ip("-n", NS[1], "addr", "add", "10.251.0.2/24", "dev", "ws_pdv1")
        for i, ns in enumerate(NS):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", f"ws_pdv{i}", "up")
        yield
    finally:
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_nixl_push_between_network_namespaces_over_tcp(tmp_path, namespaces):
    cons, prod = _load(tmp_path, "push", ["ip", "netns", "exec", NS[0]], ["ip", "netns", "exec", NS[1]],
                       "ws_pdv0", "ws_pdv1", "10.251.0.1", UCX_TLS="tcp")
    assert cons["ok"], cons
    assert prod["released"] == ["req0"] and prod["pushed"] == 1


def test_side_channel_refuses_unauthenticated_peers():
    server = SideChannelServer(b"s" * 32, "127.0.0.1", 0, {"metadata": lambda b: b"secret-meta"})
    try:
        good = SideChannelClient(b"s" * 32)
        assert good.call("127.0.0.1", server.port, "metadata", b"", 5) == b"secret-meta"
        bad = SideChannelClient(b"x" * 32)
        with pytest.raises(SideChannelError, match="unauthenticated"):
            bad.call("127.0.0.1", server.port, "metadata", b"", 5)
        # A replayed (captured) authentic request and raw garbage are refused too.
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        from wideserve.disagg.side_channel import make_header
        head = make_header(b"s" * 32, "metadata", "peer", b"")
        replies = []
        for frames in ([msgspec.msgpack.encode(head), b""], [msgspec.msgpack.encode(head), b""],
                       [b"\xc1junk", b""]):
            sock.send_multipart(frames)
            assert sock.poll(5000)
            replies.append(msgspec.msgpack.decode(sock.recv()))
        sock.close(linger=0)
        ctx.term()
        assert replies[0][0] is True and replies[0][2] == b"secret-meta"
        assert replies[1][:4] == [False, head.nonce, b"", "unauthenticated"]
        assert replies[2][3] == "malformed message"
        assert server.num_refused == 3
        good.close()
        bad.close()
    finally:
        server.close()


def test_nixl_memory_type_follows_the_kv_tensors():
    """DRAM or VRAM is chosen from the KV slabs' device (no device runtime is imported for
    it); a kv_buffer_device that disagrees is a clear error naming the flag."""
    from nixl_peer import layout

    from wideserve.disagg.nixl_worker import memory_type
    lay = layout()
    assert memory_type(lay, "auto") == memory_type(lay, "cpu") == "DRAM"
    with pytest.raises(ValueError, match="kv-transfer-config.*kv_buffer_device is 'cuda'"):
        memory_type(lay, "cuda")


_IDLE_AGENT = """
import sys, time
from wideserve.disagg.nixl_agent import new_agent
agent = new_agent("idle", int(sys.argv[1]))
start = time.process_time()
time.sleep(1.0)
print(time.process_time() - start)
"""


def test_idle_agent_sleeps_between_events():
    """The default agent's progress thread waits in poll() (NIXL's wrapper would make it spin:
    a whole core per idle agent); a process whose only work is one idle agent uses a small
    fraction of a core. Under load a spinning thread only gets less CPU, never a sleeping one
    more, so the bound cannot pass by accident of scheduling."""
    from wideserve.config.kv_transfer import DEFAULT_PROGRESS_POLL_US
    out = subprocess.run([sys.executable, "-c", _IDLE_AGENT, str(DEFAULT_PROGRESS_POLL_US)],
                         env=_env("lo"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 0.25


def test_progress_poll_is_validated():
    from wideserve.config.kv_transfer import KVTransferConfig
    with pytest.raises(ValueError, match="kv_progress_poll_us"):
        KVTransferConfig(kv_progress_poll_us=-1)
