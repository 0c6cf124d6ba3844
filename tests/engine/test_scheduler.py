"""Scheduler: token-budget arithmetic, chunked prefill, order, limits and policies (no model)."""
from __future__ import annotations

import pytest
from sched_harness import (Trace, make_request, next_token, run_to_completion,
                           step)

from wideserve.types.sched_output import RequestEventType
from wideserve.types.request import RequestStatus


PROMPT_LENS = [1, 5, 17, 100, 333, 1200, 2500, 64, 7]


@pytest.mark.parametrize("budget", [16, 48, 256, 1000, 4096])
def test_token_budget_arithmetic(make, budget):
    """Each step: running first, each request gets min(left to compute, budget left), the step
    never exceeds the budget and leaves budget unused only when nothing else could run."""
    sched, kv = make(num_blocks=4096, block_size=16, prefix=False,
                     max_num_batched_tokens=budget, max_num_seqs=64)
    reqs = [make_request(f"r{i}", n, seed=i, max_tokens=3 + i % 5)
            for i, n in enumerate(PROMPT_LENS)]
    for r in reqs:
        sched.add_request(r)
    total = 0
    for _ in range(10_000):
        if not sched.has_requests():
            break
        before = {r.request_id: (r.num_tokens, r.num_computed_tokens) for r in sched.running}
        out = sched.schedule()
        left = budget
        seen_new = False
        for s in out.scheduled:
            req = s.request
            computed_before = req.num_computed_tokens - s.num_new_tokens
            if s.is_new_or_resumed:
                seen_new = True
                assert computed_before == 0      # prefix caching is off
            else:
                assert not seen_new, "a running request came after an admitted one"
                assert before[req.request_id] == (req.num_tokens, computed_before)
            assert s.num_new_tokens == min(req.num_tokens - computed_before, left)
            left -= s.num_new_tokens
        assert left >= 0 and out.num_batched_tokens == budget - left
        if left > 0:
            assert sched.num_waiting == 0, "budget left over while requests were waiting"
        total += out.num_batched_tokens
        sampled = {s.request_id: [next_token(s.request)] for s in out.scheduled
                   if s.request.num_computed_tokens >= s.request.num_tokens}
        sched.update_from_output(out, sampled)
    assert not sched.has_requests()
    # Every prompt token and every output token but the last is computed exactly once.
    assert total == sum(r.num_prompt_tokens + r.sampling_params.max_tokens - 1 for r in reqs)
    for r in reqs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.status is RequestStatus.FINISHED_LENGTH


def test_chunked_prefill_across_steps(make):
    sched, _ = make(max_num_batched_tokens=32)
    r = make_request("a", 100, max_tokens=3)
    sched.add_request(r)
    trace = Trace()
    chunks = [step(sched, trace).num_batched_tokens for _ in range(6)]
    assert chunks == [32, 32, 32, 4, 1, 1]
    assert [o.new_token_ids != [] for o in trace.outputs["a"]] == [True, True, True]
    assert len(trace.steps[3].scheduled) == 1 and trace.outputs["a"][0].finish_reason is None
    assert trace.final("a").finish_reason == "length"
    assert r.num_output_tokens == 3 and not sched.has_unfinished_requests()
    # One more (empty) step tells the runner to drop the request's state.
    assert sched.has_requests()
    out = step(sched)
    assert out.is_empty and out.finished_req_ids == ["a"] and not sched.has_requests()
    # Partial chunks emitted nothing: the first output came with the step that finished the
    # prompt, and it carries the queue/schedule events for TTFT.
    events = [e.type for e in trace.outputs["a"][0].events]
    assert events == [RequestEventType.QUEUED, RequestEventType.SCHEDULED]


def test_running_before_waiting(make):
    sched, _ = make(max_num_batched_tokens=16)
    a = make_request("a", 50, max_tokens=4)
    sched.add_request(a)
    assert step(sched).num_batched_tokens == 16
    b = make_request("b", 20, seed=1, max_tokens=2)
    sched.add_request(b)
    # a's unfinished prefill comes first; b waits while the budget is spent.
    out = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 16)]
    out = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 16)]
    out = step(sched)
    assert [(s.request_id, s.num_new_tokens, s.is_new_or_resumed) for s in out.scheduled] == \
        [("a", 2, False), ("b", 14, True)]
    out = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    run_to_completion(sched)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 2


def test_max_num_seqs(make):
    sched, _ = make(max_num_seqs=2, max_num_batched_tokens=512)
    reqs = [make_request(f"r{i}", 4, seed=i, max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    trace = run_to_completion(sched)
    assert max(len(s.scheduled) for s in trace.steps) == 2
    assert all(r.num_output_tokens == 3 for r in reqs)


def test_long_prefill_threshold(make):
    sched, _ = make(max_num_batched_tokens=100, long_prefill_token_threshold=30)
    sched.add_request(make_request("a", 70, max_tokens=2))
    sched.add_request(make_request("b", 50, seed=1, max_tokens=2))
    shares = [[(s.request_id, s.num_new_tokens) for s in step(sched).scheduled]
              for _ in range(4)]
    assert shares == [[("a", 30), ("b", 30)], [("a", 30), ("b", 20)],
                      [("a", 10), ("b", 1)], [("a", 1)]]


def test_admission_cap(make):
    sched, _ = make(max_new_requests_per_step=2, max_num_batched_tokens=1024)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=4))
    admitted = [step(sched).num_new_admitted for _ in range(3)]
    assert admitted == [2, 2, 1]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order(make, policy):
    sched, _ = make(policy=policy, max_num_seqs=1)
    # (id, priority, arrival): added out of arrival order on purpose.
    specs = [("a", 2, 3.0), ("b", 0, 5.0), ("c", 1, 1.0), ("d", 0, 4.0), ("e", 2, 2.0)]
    for rid, prio, arrival in specs:
        r = make_request(rid, 4, seed=ord(rid), max_tokens=2)
        r.priority, r.arrival_time = prio, arrival
        sched.add_request(r)
    trace = run_to_completion(sched)
    order = []
    for s in trace.steps:
        order += [x.request_id for x in s.scheduled if x.is_new_or_resumed]
    if policy == "fcfs":
        expected = [rid for rid, _, _ in specs]     # the order they reached the scheduler
    else:
        expected = [rid for rid, _, _ in sorted(specs, key=lambda t: (t[1], t[2]))]
    assert order == expected


def test_config_validation():
    from sched_harness import make_kv_manager

    from wideserve.config import SchedulerConfig
    from wideserve.engine.scheduler import Scheduler
    kv = make_kv_manager(8, 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=0), kv, 64)
    with pytest.raises(ValueError, match="policy"):
        Scheduler(SchedulerConfig(policy="lifo"), kv, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(), kv, 1)


def test_prefix_hit_is_reported_and_skipped(make):
    from wideserve.types.request import Request
    from wideserve.types.sampling_params import SamplingParams
    sched, kv = make(block_size=16)
    shared = [(i * 7) % 900 for i in range(40)]
    first = Request("first", shared + [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add_request(first)
    run_to_completion(sched)
    second = Request("second", shared + [4, 5], SamplingParams(max_tokens=2))
    sched.add_request(second)
    trace = Trace()
    out = step(sched, trace)
    # Two full 16-token blocks of the shared 40 tokens are cached; the rest is computed.
    (s,) = out.scheduled
    assert s.num_new_tokens == 42 - 32 and second.num_cached_tokens == 32
    assert trace.outputs["second"][0].num_cached_tokens == 32
    assert kv.stats.hits == 32
    run_to_completion(sched)
