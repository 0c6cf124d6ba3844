"""Admission is fair across client requests: one request's many sequences (prompts x n, one
group) cannot hold back a later request's first sequence; within a group and with one
sequence per request it stays first come, first served; outputs do not change."""
from __future__ import annotations

import pytest
from sched_harness import SchedulerFactory, make_request, run_to_completion, step

from wideserve.engine.request_queue import FCFSQueue


def _admission_order(trace) -> list[str]:
    return [s.request_id for out in trace.steps for s in out.scheduled if s.is_new_or_resumed]


def _greedy_alone(rid: str, prompt_len: int, seed: int, max_tokens: int) -> list[int]:
    sched, _ = SchedulerFactory()(max_num_seqs=1)
    sched.add_request(make_request(rid, prompt_len, seed=seed, max_tokens=max_tokens))
    return run_to_completion(sched).tokens(rid)


def test_a_huge_request_does_not_starve_a_later_one(make):
    sched, _ = make(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(200):                         # one HTTP request: 20 prompts x n=10
        r = make_request(f"big-{i}", 12, seed=i % 20, max_tokens=6)
        r.group_id = "big"
        sched.add_request(r)
    step(sched)                                  # the big one fills the running batch
    late = [make_request(f"small-{k}", 10, seed=100 + k, max_tokens=6) for k in range(3)]
    for r in late:
        sched.add_request(r)
    trace = run_to_completion(sched)
    order = _admission_order(trace)
    # Each small request is admitted among the next few admissions, not after 196 bigs.
    for k in range(3):
        assert order.index(f"small-{k}") <= 2 * k + 1, order[:10]
    bigs = [rid for rid in order if rid.startswith("big-")]
    assert bigs == sorted(bigs, key=lambda rid: int(rid.split("-")[1]))   # FCFS inside
    # Scheduling order changes nothing in what each sequence generates.
    for rid in ("small-0", "small-2", "big-7", "big-199"):
        seed = 100 + int(rid[6:]) if rid.startswith("small") else int(rid[4:]) % 20
        length = 10 if rid.startswith("small") else 12
        assert trace.tokens(rid) == _greedy_alone(rid, length, seed, 6)
        assert trace.final(rid).finish_reason == "length"


def test_one_sequence_per_request_is_plain_fcfs(make):
    sched, _ = make(max_num_seqs=2, max_num_batched_tokens=32)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", 9, seed=i, max_tokens=3))
    assert _admission_order(run_to_completion(sched)) == [f"r{i}" for i in range(8)]


def test_queue_round_robin_resume_and_remove():
    q = FCFSQueue()
    reqs = {}
    for rid, group in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", None),
                       ("b2", "B")]:
        reqs[rid] = make_request(rid, 4)
        reqs[rid].group_id = group
        q.add(reqs[rid])
    assert [r.request_id for r in q] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    q.remove(reqs["b1"])                          # aborted: B keeps its turn for b2
    assert [q.pop().request_id for _ in range(2)] == ["a1", "b2"]
    q.prepend(reqs["a1"])                         # preempted: resumes before everyone
    assert q.peek() is reqs["a1"] and len(q) == 4
    assert [q.pop().request_id for _ in range(4)] == ["a1", "c1", "a2", "a3"]
    assert len(q) == 0
    with pytest.raises(ValueError):
        q.remove(reqs["a1"])


def test_children_and_prompts_of_one_client_request_share_a_group():
    from wideserve.serving.output_processor import OutputProcessor
    from wideserve.types.sampling_params import SamplingParams

    proc = OutputProcessor(None)
    kids = proc.add_request("p", None, [1, 2], SamplingParams(n=3))
    assert [k.group_id for k in kids] == ["p"] * 3
    other = proc.add_request("cmpl-1-0", None, [1], SamplingParams(), group_id="cmpl-1")
    assert other[0].group_id == "cmpl-1"
