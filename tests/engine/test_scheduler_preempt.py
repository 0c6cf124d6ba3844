"""Scheduler: preemption by recompute, requests that can never fit, aborts (no model)."""
from __future__ import annotations

import pytest
from sched_harness import (Trace, make_request, next_token, run_to_completion,
                           step)

from wideserve.types.sched_output import RequestEventType
from wideserve.types.request import RequestStatus


def _reference_tokens(make, specs, **cfg) -> dict[str, list[int]]:
    """Output tokens of the same requests with a KV pool large enough to never preempt."""
    sched, _ = make(num_blocks=4096, **cfg)
    for rid, n, seed, max_tokens in specs:
        sched.add_request(make_request(rid, n, seed=seed, max_tokens=max_tokens))
    trace = run_to_completion(sched)
    assert not any(s.preempted_req_ids for s in trace.steps)
    return {rid: trace.tokens(rid) for rid, *_ in specs}


def test_fcfs_preemption_and_prefix_cache_resume(make):
    specs = [("a", 12, 1, 14), ("b", 12, 2, 14)]
    want = _reference_tokens(make, specs, block_size=4)
    # 10 blocks of 4 slots: each request grows to 25 tokens (7 blocks), both cannot fit.
    sched, kv = make(num_blocks=10, block_size=4)
    reqs = {rid: make_request(rid, n, seed=seed, max_tokens=mt) for rid, n, seed, mt in specs}
    for r in reqs.values():
        sched.add_request(r)
    trace = run_to_completion(sched)
    preempt_steps = [i for i, s in enumerate(trace.steps) if s.preempted_req_ids]
    assert preempt_steps, "the tiny pool should force a preemption"
    first = trace.steps[preempt_steps[0]]
    # FCFS preempts the last running request, and admits nothing in a step that preempted.
    assert first.preempted_req_ids == ["b"] and first.num_new_admitted == 0
    assert [s.request_id for s in first.scheduled] == ["a"]
    assert reqs["b"].num_preemptions >= 1 and reqs["a"].num_preemptions == 0
    # b resumes from the prefix cache: its first share after preemption starts at a hit.
    resumed = [s for st in trace.steps[preempt_steps[0] + 1:] for s in st.scheduled
               if s.request_id == "b" and s.is_new_or_resumed]
    assert resumed and kv.stats.hits > 0
    # Recompute is invisible in the output: same tokens as without preemption.
    for rid in reqs:
        assert trace.tokens(rid) == want[rid]
        assert trace.final(rid).finish_reason == "length"
    b_events = [e.type for o in trace.outputs["b"] for e in (o.events or [])]
    assert RequestEventType.PREEMPTED in b_events
    assert b_events.count(RequestEventType.SCHEDULED) == 1 + reqs["b"].num_preemptions


def test_preempted_request_goes_to_the_front(make):
    sched, _ = make(num_blocks=10, block_size=4, max_num_seqs=2)
    for rid, n, seed, mt in [("a", 12, 1, 14), ("b", 12, 2, 14), ("c", 4, 3, 2)]:
        sched.add_request(make_request(rid, n, seed=seed, max_tokens=mt))
    trace = run_to_completion(sched)
    admissions = [x.request_id for s in trace.steps for x in s.scheduled if x.is_new_or_resumed]
    # c arrived before b was preempted but waits behind it (head of line), although its
    # 4-token prompt would have fit beside a.
    assert admissions == ["a", "b", "b", "c"]


def test_resume_share_starts_at_prefix_hit(make):
    sched, kv = make(num_blocks=10, block_size=4)
    a, b = make_request("a", 12, seed=1, max_tokens=14), make_request("b", 12, seed=2,
                                                                       max_tokens=14)
    sched.add_request(a)
    sched.add_request(b)
    resumed_at = None
    for _ in range(200):
        if not sched.has_requests():
            break
        out = sched.schedule()
        for s in out.scheduled:
            if s.request_id == "b" and s.is_new_or_resumed and b.num_preemptions:
                resumed_at = (s.request.num_computed_tokens - s.num_new_tokens,
                              s.request.num_tokens)
        sampled = {s.request_id: [next_token(s.request)] for s in out.scheduled
                   if s.request.num_computed_tokens >= s.request.num_tokens}
        sched.update_from_output(out, sampled)
    assert resumed_at is not None
    start, num_tokens = resumed_at
    # b was preempted holding 5 blocks (20 slots) when a needed its 6th; a then grew to 7
    # blocks, taking 2 of b's freed blocks. b frees tail-first, so its two output blocks
    # were evicted and its three prompt blocks (12 tokens) are still cached: the resumed
    # share starts there and recomputes only the rest.
    assert b.num_preemptions == 1
    assert start == 12 and num_tokens > 16
    # num_cached_tokens is the hit at the first admission (none), not at the resumption.
    assert b.num_cached_tokens == 0


def test_priority_preempts_lowest_priority_even_if_scheduled(make):
    sched, _ = make(num_blocks=6, block_size=4, policy="priority")
    low = make_request("low", 5, seed=1, max_tokens=12)
    high = make_request("high", 8, seed=2, max_tokens=8)
    low.priority, low.arrival_time = 1, 0.0
    high.priority, high.arrival_time = 0, 1.0
    sched.add_request(low)
    step(sched)                  # low runs first, so it sits first in the running list
    sched.add_request(high)
    trace = Trace()
    for _ in range(100):
        out = step(sched, trace)
        if out.preempted_req_ids:
            break
    # Both hold 3 blocks (6 = the pool). low (position 10) needs no new block and is
    # scheduled first; high (position 12) needs a 4th, and the victim is the lowest
    # priority request, low: its share is taken back from this step.
    assert out.preempted_req_ids == ["low"]
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("high", 1)]
    assert out.num_batched_tokens == 1
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert low.num_tokens == 11      # its outputs so far are kept
    run_to_completion(sched)
    assert high.num_output_tokens == 8 and low.num_output_tokens == 12


def test_no_admission_in_a_step_that_preempted(make):
    # Without prefix caching and with 4-token shares, the preempted request's first share
    # would fit in the blocks it just freed; it still waits for the next step.
    sched, _ = make(num_blocks=8, block_size=4, prefix=False, long_prefill_token_threshold=4)
    a, b = make_request("a", 12, seed=1, max_tokens=12), make_request("b", 12, seed=2,
                                                                       max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    trace = run_to_completion(sched)
    preempting = [i for i, s in enumerate(trace.steps) if s.preempted_req_ids]
    assert preempting
    for i in preempting:
        st = trace.steps[i]
        assert st.num_new_admitted == 0
        assert not set(st.preempted_req_ids) & {s.request_id for s in st.scheduled}
        nxt = trace.steps[i + 1]
        assert any(s.is_new_or_resumed and s.request_id in st.preempted_req_ids
                   for s in nxt.scheduled), "the resumed share fits right away"
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12


def test_request_too_large_for_pool_fails_at_admission(make):
    sched, _ = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_request("big", 40))
    sched.add_request(make_request("small", 6, seed=1, max_tokens=3))
    trace = run_to_completion(sched)
    final = trace.final("big")
    assert final.finish_reason == "error" and "does not fit in the KV cache" in final.error
    assert trace.tokens("big") == []
    assert trace.final("small").finish_reason == "length" and len(trace.tokens("small")) == 3
    assert sched.make_stats().num_errors == 1


def test_request_too_large_fails_when_alone_not_forever(make):
    # Chunks of 8 fit at first; the prompt outgrows the 16-slot pool only in its third chunk.
    # The small request is preempted first (recompute), then the big one fails alone.
    sched, _ = make(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    sched.add_request(make_request("big", 40))
    sched.add_request(make_request("small", 3, seed=1, max_tokens=2))
    big = sched.requests["big"]
    trace = run_to_completion(sched, max_steps=100)
    assert trace.final("big").finish_reason == "error" and big.num_preemptions == 0
    assert trace.tokens("big") == []
    assert trace.final("small").finish_reason == "length" and len(trace.tokens("small")) == 2


def test_chunk_shrinks_when_sliding_pages_do_not_fit(make):
    # Hybrid specs, 8 blocks per bucket: a 48-token chunk needs 6 window pages (8 positions)
    # and 12 state pages (4 positions) at once, more than the bucket holds; the window only
    # ever needs a few. Alone, the request runs in smaller chunks instead of failing.
    sched, _ = make(num_blocks=8, block_size=16, specs="hybrid", max_num_batched_tokens=48)
    r = make_request("a", 100, max_tokens=3)
    sched.add_request(r)
    trace = run_to_completion(sched)
    assert trace.final("a").finish_reason == "length" and len(trace.tokens("a")) == 3
    shares = [s.num_new_tokens for st in trace.steps for s in st.scheduled]
    assert max(shares) < 48 and sum(shares) == 100 + 3 - 1


def test_abort_waiting_and_running(make):
    sched, kv = make(max_num_seqs=1)
    a = make_request("a", 40, max_tokens=50)
    b = make_request("b", 8, seed=1, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert kv.block_ids("a")[0]
    sched.abort_requests(["b"])
    assert sched.num_waiting == 0
    sched.abort_requests(["a"])
    # Blocks go back at once, not at the next step.
    assert kv.block_ids("a") == [[]] and kv.usage == 0.0
    kv.check_integrity()
    assert not sched.has_unfinished_requests() and sched.has_requests()
    trace = Trace()
    out = step(sched, trace)
    assert out.is_empty and sorted(out.finished_req_ids) == ["a", "b"]
    for rid in "ab":
        assert trace.final(rid).finish_reason == "abort" and trace.tokens(rid) == []
    assert not sched.has_requests()
    sched.abort_requests(["a", "unknown"])      # already finished / never seen: ignored


def test_abort_between_schedule_and_update(make):
    sched, kv = make()
    a, b = make_request("a", 8, max_tokens=5), make_request("b", 8, seed=1, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = {s.request_id: [next_token(s.request)] for s in out.scheduled}
    sched.abort_requests("a")
    outs = {o.request_id: o for o in sched.update_from_output(out, sampled)}
    assert outs["a"].finish_reason == "abort" and outs["a"].new_token_ids == []
    assert outs["b"].new_token_ids == sampled["b"] and not outs["b"].finished
    assert a.num_output_tokens == 0 and kv.block_ids("a") == [[]]


def test_finish_requests_from_front_end(make):
    sched, _ = make()
    r = make_request("a", 8, max_tokens=20)
    sched.add_request(r)
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED, stop_reason="###")
    trace = Trace()
    step(sched, trace)
    final = trace.final("a")
    assert final.finish_reason == "stop" and final.stop_reason == "###"
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests(["x"], RequestStatus.RUNNING)


def test_input_validation(make):
    sched, _ = make(max_model_len=32)
    sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("long", 32))
    sched.add_request(make_request("ok", 31, max_tokens=5))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(make_request("ok", 3))
    trace = run_to_completion(sched)
    assert "prompt_token_ids is empty" in trace.final("empty").error
    assert "max_model_len=32" in trace.final("long").error
    # 31 prompt tokens leave room for exactly one output token.
    assert trace.tokens("ok") and len(trace.tokens("ok")) == 1
    assert trace.final("ok").finish_reason == "length"


def _workload(seed: int, n: int) -> list[tuple[str, list[int], int, int]]:
    """(id, prompt, max_tokens, arrival step, priority): prompts share prefixes so the cache
    gets hits."""
    import random
    rng = random.Random(seed)
    stems = [[rng.randrange(900) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    out = []
    for i in range(n):
        prompt = list(rng.choice(stems)) + [rng.randrange(900) for _ in range(rng.randrange(1, 30))]
        out.append((f"w{i}", prompt, rng.randrange(1, 20), rng.randrange(0, 30),
                    rng.randrange(3)))
    return out


def _run_workload(sched, kv, work, max_steps=3000):
    from wideserve.types.request import Request
    from wideserve.types.sampling_params import SamplingParams
    trace = Trace()
    for t in range(max_steps):
        for i, (rid, prompt, max_tokens, arrival, prio) in enumerate(work):
            if arrival == t:
                # Explicit arrival times: the priority order must not depend on the clock.
                sched.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                                          arrival_time=t + i / 1000, priority=prio))
        if t > max(w[3] for w in work) and not sched.has_requests():
            return trace
        out = step(sched, trace)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert sched.num_running <= sched.config.max_num_seqs
        kv.check_integrity()
    raise AssertionError("workload did not drain")


@pytest.mark.parametrize("specs,mode", [("full", "keep"), ("hybrid", "keep"),
                                        ("hybrid", "replay")])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_under_memory_pressure(make, specs, mode, policy):
    work = _workload(seed=len(specs) + len(mode) + len(policy), n=24)
    cfg = dict(block_size=16, specs=specs, mode=mode, policy=policy, max_num_seqs=8,
               max_num_batched_tokens=48)
    ref_sched, ref_kv = make(num_blocks=2048, **cfg)
    ref = _run_workload(ref_sched, ref_kv, work)
    sched, kv = make(num_blocks=12 if specs == "full" else 28, **cfg)
    trace = _run_workload(sched, kv, work)
    assert sum(len(s.preempted_req_ids) for s in trace.steps) > 0, "no memory pressure"
    assert kv.stats.hits > 0
    for rid, _, max_tokens, *_ in work:
        assert trace.tokens(rid) == ref.tokens(rid) and len(ref.tokens(rid)) == max_tokens
        assert trace.final(rid).finish_reason == "length"
    if mode == "replay":
        # A hit recomputes the replay window below the hit point without rewriting it.
        assert any(s.kv_write_start > s.request.num_computed_tokens - s.num_new_tokens
                   for st in trace.steps for s in st.scheduled)
