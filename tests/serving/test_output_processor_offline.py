"""OutputProcessor(stream=False), the offline LLM's: the same finished outputs as the
streaming processor, and no outputs or deltas for requests that have not finished."""
from __future__ import annotations

import random
from pathlib import Path

from wideserve.serving.output_processor import OutputProcessor
from wideserve.types.sched_output import EngineCoreOutput
from wideserve.types.sampling_params import SamplingParams
from wideserve.text.tokenizer import Tokenizer

ASSET = Path(__file__).resolve().parents[2] / "wideserve" / "assets" / "shakespeare-v4-tiny"


def test_offline_processor_matches_streaming_one():
    tok = Tokenizer.from_pretrained(ASSET)
    rng = random.Random(0)
    vocab = tok.vocab_size
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, stop=["e ", "th"]),
              SamplingParams(max_tokens=40, stop=["a"], include_stop_str_in_output=True),
              SamplingParams(max_tokens=40, n=2, seed=1),
              SamplingParams(max_tokens=40, skip_special_tokens=False)]
    procs = [OutputProcessor(tok), OutputProcessor(tok, stream=False)]
    children: dict[str, int] = {}
    for k, sp in enumerate(params):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        reqs = [p.add_request(f"r{k}", None, prompt, sp) for p in procs]
        assert [r.request_id for r in reqs[0]] == [r.request_id for r in reqs[1]]
        for r in reqs[0]:
            children[r.request_id] = rng.randint(5, 40)        # when the core ends it
    finished: list[dict] = [{}, {}]
    for step in range(40):
        outs = [EngineCoreOutput(cid, [rng.randrange(vocab)],
                                 finish_reason="length" if step + 1 == end else None)
                for cid, end in children.items() if step < end]
        for i, proc in enumerate(procs):
            got = proc.process_outputs(outs, now=float(step))
            for out in got.request_outputs:
                assert out.finished or i == 0
                if out.finished:
                    finished[i][out.request_id] = [(c.text, c.token_ids, c.finish_reason,
                                                    c.stop_reason) for c in out.outputs]
            if i == 1:
                assert not any(got.deltas.values())
    assert finished[0] == finished[1] and len(finished[0]) == len(params)
    assert any(o[0][2] == "stop" for o in finished[0].values())     # a stop string ended one
    assert not procs[1].has_unfinished_requests()
