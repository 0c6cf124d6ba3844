"""Stop conditions: append a step's sampled tokens to a request, up to the first that ends it
(vLLM's v1/core/sched/utils.py `check_stop` draws the same line out of its scheduler).

A request stops (FINISHED_STOPPED) on an EOS id (the model's, or its own `eos_token_id`)
unless `ignore_eos`, or on one of its `stop_token_ids`, once it has `min_tokens` outputs; it
ends with FINISHED_LENGTH at `max_tokens` outputs or `max_model_len` tokens in all. Stop
strings are the front end's (text/detokenizer.py): they need text.
"""
from __future__ import annotations

from wideserve.types.request import Request, RequestStatus
from wideserve.types.sched_output import EngineCoreOutput, FinishReason

FINISH_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def append_and_check_stop(request: Request, new_ids: list[int], model_eos: frozenset[int],
                          max_model_len: int) -> EngineCoreOutput:
    """Append `new_ids` (1, or accepted drafts + 1) until the first stop condition; set the
    request's finished status and stop reason if one was met; the step's output for it."""
    sp = request.sampling_params
    eos_ids = model_eos
    if request.eos_token_id is not None and request.eos_token_id not in eos_ids:
        eos_ids = eos_ids | {request.eos_token_id}
    stop_ids = sp.stop_token_ids or ()
    max_tokens = sp.max_tokens if sp.max_tokens is not None else max_model_len
    status: RequestStatus | None = None
    stop_reason: int | None = None
    # One token at a time: several may arrive at once (accepted drafts) and none may be
    # appended after the first stop condition.
    output, all_ids = request.output_token_ids, request.all_token_ids
    for i, tok in enumerate(new_ids):
        request.append_output_token_ids([tok])
        if len(output) >= sp.min_tokens:
            if tok in eos_ids and not sp.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif tok in stop_ids:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, tok
        if status is None and (len(output) >= max_tokens or len(all_ids) >= max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            new_ids = new_ids[:i + 1]
            break
    if status is not None:
        request.status = status
        request.stop_reason = stop_reason
    return EngineCoreOutput(
        request.request_id, list(new_ids),
        finish_reason=FINISH_REASON[status] if status is not None else None,
        stop_reason=stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0))
