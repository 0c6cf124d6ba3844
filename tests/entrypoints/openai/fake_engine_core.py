"""A stand-in engine core for the process/ZMQ plumbing test ONLY (test_engine_proc_plumbing).

It honours the EngineCore surface the engine process uses and nothing more: every step each
request gets one token, (previous token + 1) % VOCAB, until max_tokens. A prompt starting
with CRASH_TOKEN makes step() raise, to exercise the engine-died path.
"""
from __future__ import annotations

from wideserve.engine.engine_proc import EngineLoop
from wideserve.engine.errors import DuplicateRequestError
from wideserve.types.request import prompt_token_array
from wideserve.types.sched_output import EngineCoreOutput

VOCAB = 1000
CRASH_TOKEN = 999


class FakeEngineCore:
    loop_class = EngineLoop              # the plain loop (engine/engine_proc.py LoopEngine)

    def __init__(self, config) -> None:
        self.config = config
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.model_info = {"name": "fake", "max_model_len": 128, "vocab_size": VOCAB}

    def add_request(self, req) -> None:
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"request_id {req.request_id!r} is already in use")
        prompt = prompt_token_array(req.prompt_token_ids)    # int32 bytes on the wire
        if len(prompt) >= self.model_info["max_model_len"]:
            raise ValueError("prompt exceeds the maximum context length")
        self.requests[req.request_id] = ([int(t) for t in prompt],
                                         req.sampling_params.max_tokens or 16)

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.aborted)

    def step(self) -> list[EngineCoreOutput]:
        self.num_steps += 1
        outs = [EngineCoreOutput(request_id=rid, finish_reason="abort") for rid in self.aborted]
        self.aborted = []
        for rid, (tokens, max_tokens) in list(self.requests.items()):
            if tokens[0] == CRASH_TOKEN:
                raise RuntimeError("fake engine crashed on purpose")
            tokens.append((tokens[-1] + 1) % VOCAB)
            out = EngineCoreOutput(request_id=rid, new_token_ids=[tokens[-1]])
            self.requests[rid] = (tokens, max_tokens - 1)
            if max_tokens - 1 == 0:
                out.finish_reason = "length"
                del self.requests[rid]
            outs.append(out)
        return outs

    def get_stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "num_steps": self.num_steps}

    def check_integrity(self) -> None:
        if self.requests:
            raise AssertionError("not idle")
