"""Wire format between the API front end and the engine-core process.

Two ZMQ PUSH/PULL sockets (the front end binds both; the engine connects):
  front end --input-->  engine:  AddRequests | AbortRequests | UtilityCall | Shutdown
  front end <--output-- engine:  Ready | Outputs | UtilityResult | EngineDead
Every message is one msgpack frame encoded by msgspec: a tagged array whose payload types are
plain dataclasses/structs, so decoding is type-directed and nothing is ever unpickled.
Dataclass payloads are rebuilt through their constructor, so SamplingParams re-validates on
the engine side.

`Outputs` doubles as the heartbeat: the engine sends one (possibly with no outputs) at least
every `heartbeat_s` while idle, always carrying a fresh stats snapshot.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Union

import msgspec

from wideserve.types.messages import EngineCoreRequest, StepLogprobs
from wideserve.types.request import token_ids_to_bytes
from wideserve.types.sched_output import EngineCoreOutput


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[EngineCoreRequest]
    # Generation requests the front end holds behind these, not yet submitted
    # (serving/arrivals.py); -1: not counted (the engine then waits out its arrival gap).
    pending: int = -1


class _AddRequestsRaw(msgspec.Struct, tag="AddRequests", array_like=True):
    """The engine's view of AddRequests: each request decoded on its own, so one that fails
    validation is rejected by id instead of taking the whole batch (or the engine) down."""
    requests: list[msgspec.Raw]
    pending: int = -1


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str                                  # one of UTILITY_METHODS


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    model_info: dict[str, Any]
    pid: int


class Outputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: dict[str, Any] | None = None          # EngineStats as builtins
    timestamp: float = 0.0                       # time.monotonic() in the engine
    step_times: list[float] = []                 # wall seconds of each step since the last


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    reason: str


InputMessage = Union[AddRequests, AbortRequests, UtilityCall, Shutdown]
_EngineInputMessage = Union[_AddRequestsRaw, AbortRequests, UtilityCall, Shutdown]
OutputMessage = Union[Ready, Outputs, UtilityResult, EngineDead]

# Engine methods the front end may call by name; anything else is refused, so the socket is
# not a general RPC channel.
UTILITY_METHODS = frozenset({"get_stats", "check_integrity", "model_info", "request_ids",
                             "request_history"})


def _enc_hook(obj: Any) -> Any:
    # Sampler payloads (new_logprobs) may hold tensors or numpy arrays: send them as lists.
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    if hasattr(obj, "__dataclass_fields__") or hasattr(obj, "__struct_fields__"):
        return msgspec.to_builtins(obj, enc_hook=_enc_hook)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine peer")


def to_wire(request: EngineCoreRequest) -> EngineCoreRequest:
    """The request as sent: its prompt as int32 bytes, which the engine reads in place
    (a long prompt's ids as a msgpack array cost the engine a Python int each to decode)."""
    if not isinstance(request.prompt_token_ids, list):
        return request
    return dataclasses.replace(request,
                               prompt_token_ids=token_ids_to_bytes(request.prompt_token_ids))


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(_EngineInputMessage)


def decode_requests(msg: Any) -> tuple[list[EngineCoreRequest], list[tuple[str, str]]]:
    """AddRequests as the engine decoded it -> (valid requests, [(request_id, why)]).
    A request without a string id cannot be answered: it is logged (stderr) instead."""
    good: list[EngineCoreRequest] = []
    bad: list[tuple[str, str]] = []
    for raw in msg.requests:
        try:
            good.append(msgspec.msgpack.decode(raw, type=EngineCoreRequest))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            loose = _loose(bytes(raw))
            rid = _request_id_of(loose)
            if rid is not None:
                bad.append((rid, f"invalid request: {e}"))
            else:
                print(f"[engine] dropped a request without a string request_id ({e}): "
                      f"{repr(loose)[:300]}", file=sys.stderr, flush=True)
    return good, bad


def _loose(data: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None


def _request_id_of(obj: Any) -> str | None:
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def is_add_requests(msg: Any) -> bool:
    return isinstance(msg, (AddRequests, _AddRequestsRaw))


def make_output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(OutputMessage)


def to_builtins(obj: Any) -> Any:
    """Dataclass/struct/tensor tree -> plain msgpack-able values."""
    return msgspec.to_builtins(obj, enc_hook=_enc_hook)


def restore_outputs(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """new_logprobs travels untyped (the field is `Any`); give it back its type."""
    for out in outputs:
        if isinstance(out.new_logprobs, dict):
            out.new_logprobs = msgspec.convert(out.new_logprobs, StepLogprobs)
    return outputs
