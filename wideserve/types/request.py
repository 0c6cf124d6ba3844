"""A request as the engine core tracks it.

Invariant (docs/design.md, "The one scheduling rule"): all_token_ids = prompt + output; the
scheduler hands out tokens so num_computed_tokens catches up with num_tokens_with_spec.

Besides the Python lists, a request holds the same tokens as one int32 numpy buffer
(`token_array()`), made once here at creation and appended to with the output tokens
(amortised doubling, so an append is a slice store). Everything that reads the whole context
at admission (block hashing, P/D prompt digests, id range checks) reads the buffer, so no
per-token Python work is repeated for a long prompt.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from wideserve.types.multimodal import ImageInput
    from wideserve.types.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    # Blocks allocated, KV arriving from a prefill instance (disagg/); in no queue.
    WAITING_FOR_REMOTE_KV = 7

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: "SamplingParams"
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1              # prefix-cache hit at first scheduling; -1 = not yet
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of full prompt/output blocks
    stop_reason: int | str | None = None
    group_id: str | None = None              # the client request it belongs to (None: itself)
    # P/D disaggregation (disagg/params.py): what the router asked of this request.
    kv_transfer_params: dict[str, Any] | None = None
    # Image spans of the prompt, in order (types/multimodal.py): their rows take the vision
    # tower's embeddings (worker/images.py) and their digests key the prefix cache.
    images: "list[ImageInput] | None" = None
    # all_token_ids as int32 in buf[:num_tokens]; capacity beyond it for output tokens.
    _token_buf: np.ndarray = field(init=False, repr=False)
    _buf_len: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        ids = self.all_token_ids
        self._token_buf = token_ids_to_int32(ids, extra=16)
        self._buf_len = len(ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        n, k = self._buf_len, len(token_ids)
        if n + k > len(self._token_buf):
            grown = np.empty(max(2 * len(self._token_buf), n + k), dtype=np.int32)
            grown[:n] = self._token_buf[:n]
            self._token_buf = grown
        self._token_buf[n:n + k] = token_ids
        self._buf_len = n + k

    def token_array(self) -> np.ndarray:
        """all_token_ids as a read-only int32 array (a view: valid until the next append)."""
        n = self._buf_len
        if n != len(self.all_token_ids):
            raise RuntimeError(f"request {self.request_id!r}: all_token_ids was changed "
                               f"outside append_output_token_ids ({len(self.all_token_ids)} "
                               f"tokens, {n} in the int32 buffer)")
        view = self._token_buf[:n]
        view.flags.writeable = False
        return view

    def prompt_array(self) -> np.ndarray:
        """The prompt as a read-only int32 array (a view of the token buffer)."""
        return self.token_array()[:len(self.prompt_token_ids)]


def token_ids_to_int32(token_ids: list[int] | np.ndarray, extra: int = 0) -> np.ndarray:
    """token_ids as a new int32 array with `extra` spare slots at the end (one C loop, the
    fastest conversion of a Python int list numpy has); ids outside int32 are a ValueError."""
    n = len(token_ids)
    out = np.empty(n + extra, dtype=np.int32)
    if isinstance(token_ids, np.ndarray):
        # An array store wraps silently where a Python int overflows: check the range first.
        if n and token_ids.dtype != np.int32 and (
                token_ids.min() < _INT32.min or token_ids.max() > _INT32.max):
            raise ValueError("token ids must fit in int32")
        out[:n] = token_ids
        return out
    try:
        out[:n] = np.fromiter(token_ids, dtype=np.int32, count=n)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None
    return out


_INT32 = np.iinfo(np.int32)
