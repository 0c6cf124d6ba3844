"""Output types: logprob entries built from the sampler's tensors, and request metrics."""
from __future__ import annotations

import torch

from wideserve.worker.sampler import Sampler, build_sampling_metadata
from wideserve.types.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput,
                                     make_logprobs_entry)
from wideserve.types.sampling_params import SamplingParams


def test_logprobs_entry_from_sampler_row():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.1, 5.0, 0.2]])
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0,
                                                                          logprobs=3)]
    md = build_sampling_metadata(params, [[], []], None, {}, "cpu", 4)
    out = Sampler()(logits, md)
    ids, lps, ranks = out.logprobs.tolists()
    ref = torch.log_softmax(logits, -1)
    e0 = make_logprobs_entry(ids[0], lps[0], ranks[0], 1, decode=lambda t: f"<{t}>")
    assert list(e0) == [0]                             # sampled == top-1: one entry
    assert e0[0].rank == 1 and e0[0].decoded_token == "<0>"
    assert abs(e0[0].logprob - float(ref[0, 0])) < 1e-6
    e1 = make_logprobs_entry(ids[1], lps[1], ranks[1], 3)
    assert list(e1) == [2, 3, 1] and [e1[t].rank for t in e1] == [1, 2, 3]
    # a request asking for fewer than the batch max keeps only its own N
    assert list(make_logprobs_entry(ids[1], lps[1], ranks[1], 1)) == [2]
    # a sampled token outside the top N keeps its true rank
    entry = make_logprobs_entry([3, 0, 2], [-3.2, -0.4, -1.4], 4, 2)
    assert entry[3] == Logprob(-3.2, 4) and entry[0].rank == 1 and entry[2].rank == 2


def test_metrics_and_output():
    m = RequestMetrics(arrival_time=10.0)
    assert m.ttft is None and m.queue_time is None and m.tpot is None
    m.first_scheduled_time, m.first_token_time = 10.5, 11.0
    m.last_token_time, m.finished_time, m.num_generation_tokens = 13.0, 13.5, 5
    m.num_cached_tokens = 256
    assert (m.queue_time, m.ttft, m.tpot) == (0.5, 1.0, 0.5)
    c = CompletionOutput(index=0, text="hi", token_ids=[5, 6])
    assert not c.finished
    c.finish_reason, c.stop_reason = "stop", "###"
    out = RequestOutput("r1", "prompt", [1, 2], None, [c], finished=True, metrics=m)
    assert out.num_cached_tokens == 256 and out.outputs[0].finished
    assert RequestOutput("r2", None, [1], None, [], False).num_cached_tokens == 0
