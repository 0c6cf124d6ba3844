"""Failures of the KV handoff end requests as kv_load_failure_policy says, leave other
requests alone and leak no blocks on either side; the decode side's admission cap holds
under a burst of arrivals."""
from __future__ import annotations

import time

import pytest

from pd_harness import (decode, drain, greedy, make_engines, prefill, run_colocated, settle,
                        write_config)
from wideserve.types.messages import EngineCoreRequest
from wideserve.disagg.connector_metrics import families

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160,
         "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False}
PROMPTS = [[2 + (7 * i + j) % 150 for j in range(20 + 9 * i)] for i in range(4)]
MAX_NEW = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("llama"), LLAMA)


def _engines(model, p_kv=None, d_kv=None, **kw):
    kw = {"kv_cache_memory": 1 << 22, **kw}
    return make_engines(model, load_format="dummy", block_size=16, p_kv=p_kv, d_kv=d_kv, **kw)


@pytest.mark.parametrize("policy,op", [("recompute", "push"), ("fail", "push"),
                                       ("recompute", "pull")])
def test_injected_transfer_failure_follows_policy(model, policy, op):
    p, d, ref = _engines(model, d_kv={"kv_load_failure_policy": policy, "kv_transfer_op": op,
                                      "kv_connector_extra_config": {"inject_load_failures": 2}})
    expected = run_colocated(ref, PROMPTS, MAX_NEW)
    outs = decode(d, p, PROMPTS, prefill(p, PROMPTS), MAX_NEW)
    stats = d.kv_connector.scheduler.stats
    assert (stats.loads_failed, stats.loads_done) == (2, 2)
    for i in range(len(PROMPTS)):
        out = outs[f"d{i}"]
        if policy == "recompute" or i >= 2:        # the first two loads fail
            assert out["finish"] == "length" and out["tokens"] == expected[i]
        else:
            assert out["finish"] == "error" and "injected failure" in out["error"]
            assert out["tokens"] == []
    settle(p, d, ref)
    # The failed pulls released their leases at once instead of waiting for expiry.
    assert p.kv_connector.scheduler.stats.leases_expired == 0


@pytest.mark.parametrize("op", ["push", "pull"])
def test_lease_expiry_frees_prefill_blocks_and_decode_recomputes(model, op):
    p, d, ref = _engines(model, p_kv={"kv_lease_s": 0.05}, d_kv={"kv_transfer_op": op})
    expected = run_colocated(ref, PROMPTS, MAX_NEW)
    handles = prefill(p, PROMPTS)
    assert p.kv_manager.usage > 0                   # held for the decode side
    time.sleep(0.1)
    p.step()                                        # the producer notices the expiry
    settle(p)                                       # ... and has freed everything
    assert p.kv_connector.scheduler.stats.leases_expired == len(PROMPTS)
    outs = decode(d, p, PROMPTS, handles, MAX_NEW)  # pulls find no lease: recompute
    assert [outs[f"d{i}"]["tokens"] for i in range(len(PROMPTS))] == expected
    assert d.kv_connector.scheduler.stats.loads_failed == len(PROMPTS)
    settle(p, d, ref)


def test_lease_expired_mid_flight_fails_with_clear_error(model):
    p, d, _ = _engines(model, p_kv={"kv_lease_s": 0.05}, d_kv={"kv_load_failure_policy": "fail"})
    handles = prefill(p, PROMPTS[:1])
    time.sleep(0.1)
    outs = decode(d, p, PROMPTS[:1], handles, MAX_NEW)
    assert outs["d0"]["finish"] == "error" and "lease expired" in outs["d0"]["error"]
    settle(p, d)


@pytest.mark.parametrize("op", ["push", "pull"])
def test_abort_while_loading_frees_blocks(model, op):
    p, d, _ = _engines(model, d_kv={"kv_transfer_op": op})
    handles = prefill(p, PROMPTS)
    for i, (prompt, h) in enumerate(zip(PROMPTS, handles)):
        d.add_request(EngineCoreRequest(f"a{i}", prompt, greedy(MAX_NEW, h)))
    d.step()        # loads admitted (pull: done; push: waiting for the producer's step)
    assert d.kv_connector.scheduler.stats.loads_started == len(PROMPTS)
    assert len(getattr(d.kv_connector.worker, "waiting", {})) == \
        (len(PROMPTS) if op == "push" else 0)
    d.abort_requests([f"a{i}" for i in range(len(PROMPTS))])
    outs = drain(d, {f"a{i}" for i in range(len(PROMPTS))})
    assert all(o["finish"] == "abort" for o in outs.values())
    settle(p, d)        # the producer skips the cancelled pushes and frees the leases
    assert p.kv_connector.scheduler.stats.leases_released == len(PROMPTS)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_push_from_a_stalled_producer_times_out_as_the_policy_says(model, policy):
    """The producer stops stepping (hung or dead) after granting the handles: the consumer's
    pushes time out and end as the policy says, while the blocks they targeted stay
    quarantined (counted as such by the integrity check and the metrics: neither free nor
    leaked) since the producer has not confirmed the writes stopped; once it steps again it
    skips the withdrawn pushes, frees its blocks, and the consumer frees the quarantine."""
    p, d, ref = _engines(model, d_kv={"kv_load_failure_policy": policy,
                                      "kv_load_timeout_s": 0.2, "kv_transfer_op": "push"})
    expected = run_colocated(ref, PROMPTS[:2], MAX_NEW)
    handles = prefill(p, PROMPTS[:2])
    for i, (prompt, h) in enumerate(zip(PROMPTS[:2], handles)):
        d.add_request(EngineCoreRequest(f"s{i}", prompt, greedy(MAX_NEW, h)))
    outs = drain(d, {"s0", "s1"})                   # the producer is not stepped
    for i in range(2):
        if policy == "recompute":
            assert outs[f"s{i}"]["tokens"] == expected[i]
        else:
            assert outs[f"s{i}"]["finish"] == "error" and "timed out" in outs[f"s{i}"]["error"]
    conn = d.kv_connector.scheduler
    assert conn.stats.loads_failed == 2 and conn.stats.loads_quarantined == 2
    assert p.kv_manager.usage > 0                   # claimed: held until the push stops
    counts = d.kv_manager.check_integrity()
    held = sum(c["quarantined"] for c in counts.values())
    assert held > 0 and held == d.kv_manager.num_quarantined_blocks
    assert all(c["used"] == c["quarantined"] for c in counts.values())  # nothing else held
    snap = conn.snapshot()
    assert (snap["quarantined"], snap["quarantined_blocks"]) == (2, held)
    gauges = {f.name: f.samples[0].value for f in families(snap, "m")}
    assert gauges["wideserve:kv_transfer_blocks_quarantined"] == held
    settle(p, d, ref)       # the producer steps: the pushes have stopped, the fence is reached
    assert p.kv_connector.scheduler.stats.leases_released == 2
    assert conn.stats.quarantines_released == 2 and conn.num_quarantined == 0


def test_bad_handles_are_rejected_with_clear_errors(model):
    p, d, _ = _engines(model)
    (h,) = prefill(p, PROMPTS[:1])
    with pytest.raises(ValueError, match="the prefill computed"):
        d.add_request(EngineCoreRequest("x", PROMPTS[0] + [5], greedy(2, h)))
    with pytest.raises(ValueError, match="KV layout differs"):
        d.add_request(EngineCoreRequest("y", PROMPTS[0],
                                        greedy(2, {**h, "remote_layout": "0" * 32})))
    with pytest.raises(ValueError, match="not a producer"):
        d.add_request(EngineCoreRequest("z", PROMPTS[0], greedy(2, {"do_remote_decode": True})))
    with pytest.raises(ValueError, match="not a consumer"):
        p.add_request(EngineCoreRequest("w", PROMPTS[0], greedy(2, h)))
    # A handle whose block ids were tampered with: refused at admission (its signature no
    # longer verifies), nothing is loaded; the real handle still works.
    bad = {**h, "remote_block_ids": [row[:1] for row in h["remote_block_ids"]]}
    with pytest.raises(ValueError, match="signature does not verify"):
        d.add_request(EngineCoreRequest("v", PROMPTS[0], greedy(2, bad)))
    outs = decode(d, p, PROMPTS[:1], [h], MAX_NEW)
    assert outs["d0"]["finish"] == "length"
    assert d.kv_connector.scheduler.stats.loads_done == 1
    settle(p, d)


@pytest.mark.parametrize("cap", [4, 0])
def test_admission_cap_under_burst_of_64(model, cap):
    p, d, ref = _engines(model, d_kv={"max_new_kv_loads_per_step": cap}, max_num_seqs=64,
                         kv_cache_memory=1 << 24)
    prompts = [[2 + (3 * i + j) % 150 for j in range(18 + i % 7)] for i in range(64)]
    handles = prefill(p, prompts)
    for i, (prompt, h) in enumerate(zip(prompts, handles)):
        d.add_request(EngineCoreRequest(f"b{i}", prompt, greedy(2, h)))
    started = []
    ids = {f"b{i}" for i in range(64)}
    done: set[str] = set()
    while done != ids:
        before = d.kv_connector.scheduler.stats.loads_started
        done |= {o.request_id for o in d.step() if o.finished}
        started.append(d.kv_connector.scheduler.stats.loads_started - before)
        if p.has_unfinished_requests():
            p.step()
    assert sum(started) == 64
    if cap:
        assert max(started) == cap and started[:16] == [cap] * 16
    else:
        assert started[0] == 64
    settle(p, d)
