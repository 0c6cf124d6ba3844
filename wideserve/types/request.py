"""A request as the engine core tracks it.

Invariant (docs/design.md, "The one scheduling rule"): all_token_ids = prompt + output; the
scheduler hands out tokens so num_computed_tokens catches up with num_tokens_with_spec.

A request holds its tokens as int32 buffers (`TokenIds`), never as Python lists of the
prompt: a prompt that arrives as int32 bytes (engine IPC, engine/engine_ipc.py) is kept as it
came, `all_token_ids` shares its buffer until the first output token is appended, and
whatever reads the whole context at admission (block hashing, P/D prompt digests, id range
checks) reads the buffer. A slice is the only per-token conversion, and it converts only
what it covers: a prefill chunk's tokens become a list in the step that computes them (the
"chunked copy"), so no step pays for a long prompt at once (docs/host_path.md).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

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
    prompt_token_ids: "TokenIds"             # a list, an int32 array or TokenIds on input
    sampling_params: "SamplingParams"
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: "TokenIds" = field(default_factory=list)    # default: the prompt
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

    def __post_init__(self) -> None:
        # A TokenIds of its own (a caller's TokenIds is read through a view, not frozen).
        prompt = self.prompt_token_ids = TokenIds(self.prompt_token_ids)
        prompt.freeze()
        self.all_token_ids = prompt.extendable() if not len(self.all_token_ids) \
            else TokenIds(self.all_token_ids)

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

    def token_array(self) -> np.ndarray:
        """all_token_ids as a read-only int32 array (a view: valid until the next append)."""
        return self.all_token_ids.array()

    def prompt_array(self) -> np.ndarray:
        """The prompt as a read-only int32 array."""
        return self.prompt_token_ids.array()


class TokenIds(Sequence[int]):
    """Token ids in one int32 buffer, read like a list of ints.

    Reads are what the engine does with a context: len, an index (an int), a slice (a Python
    list of the slice only), `np.asarray` (the buffer itself, no copy), iteration, `==`
    against a list. Appends store into spare capacity, doubling it when full. Several
    TokenIds may share one buffer: each reads only its first len() entries, and a frozen one
    (a prompt) refuses appends, so sharing never changes what another one holds."""

    __slots__ = ("_buf", "_n", "_frozen")

    def __init__(self, token_ids: "Sequence[int] | np.ndarray" = (), extra: int = 0) -> None:
        """token_ids: a list (one C loop of conversion), an int32 array (kept as it is, no
        copy, unless `extra` spare slots are asked for) or any array of ids in int32."""
        if isinstance(token_ids, TokenIds):
            token_ids = token_ids.array()
        if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int32 and not extra \
                and token_ids.ndim == 1:
            self._buf = token_ids
        else:
            self._buf = token_ids_to_int32(token_ids, extra)
        self._n = len(token_ids)
        self._frozen = False

    def freeze(self) -> None:
        """Refuse appends from now on (a prompt)."""
        self._frozen = True

    def extendable(self) -> "TokenIds":
        """A TokenIds with the same ids on the same buffer (no copy) that may be appended to:
        its first append past the buffer's end moves it to a buffer of its own."""
        out = TokenIds.__new__(TokenIds)
        # Exactly n slots: the first append cannot write into the shared buffer.
        out._buf, out._n, out._frozen = self._buf[:self._n], self._n, False
        return out

    def array(self) -> np.ndarray:
        """The ids as a read-only int32 array (a view: valid until the next append)."""
        view = self._buf[:self._n]
        view.flags.writeable = False
        return view

    def tolist(self) -> list[int]:
        return self._buf[:self._n].tolist()

    def append(self, token_id: int) -> None:
        self.extend((token_id,))

    def extend(self, token_ids: "Sequence[int]") -> None:
        if self._frozen:
            raise TypeError("these token ids are frozen (a prompt): append to all_token_ids")
        n, k = self._n, len(token_ids)
        if not k:
            return
        if n + k > len(self._buf) or not self._buf.flags.writeable:
            grown = np.empty(max(2 * n, n + k, 16), dtype=np.int32)
            grown[:n] = self._buf[:n]
            self._buf = grown
        try:
            self._buf[n:n + k] = token_ids
        except OverflowError as e:
            raise ValueError(f"token ids must fit in int32: {e}") from None
        self._n = n + k

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._buf[:self._n][i].tolist()
        if not -self._n <= i < self._n:
            raise IndexError(f"token index {i} out of range ({self._n} tokens)")
        return int(self._buf[i if i >= 0 else self._n + i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __contains__(self, token_id: object) -> bool:
        return isinstance(token_id, (int, np.integer)) and bool(
            (self._buf[:self._n] == token_id).any())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        view = self.array()
        return view if dtype is None else view.astype(dtype, copy=False)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenIds, np.ndarray)):
            return len(other) == self._n and bool(np.array_equal(self.array(), other))
        if isinstance(other, (list, tuple)):
            return len(other) == self._n and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None     # type: ignore[assignment]

    def __add__(self, other: "Sequence[int]") -> list[int]:
        return self.tolist() + list(other)

    def __radd__(self, other: "Sequence[int]") -> list[int]:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return repr(self.tolist())


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


def token_ids_to_bytes(token_ids: "Sequence[int] | np.ndarray") -> "bytes | Sequence[int]":
    """The wire form of a prompt (engine IPC, EngineCoreRequest.prompt_token_ids): its ids
    as little-endian int32 bytes, which the engine reads in place (`prompt_token_array`)
    instead of building a Python int per token. Anything else (ids outside int32, non-int
    values, an empty prompt) stays as it is, for the engine to refuse with its message."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or not arr.size or arr.dtype.kind not in "iu" \
            or int(arr.min()) < _INT32.min or int(arr.max()) > _INT32.max:
        return token_ids
    return arr.astype("<i4").tobytes()


def prompt_token_array(token_ids: "bytes | Sequence[int] | np.ndarray"
                       ) -> "np.ndarray | Sequence[int]":
    """A prompt as EngineCoreRequest carries it -> an int32 array (read-only, no copy) for
    the bytes form; a list or array is returned as it is (Request converts it)."""
    if not isinstance(token_ids, (bytes, bytearray, memoryview)):
        return token_ids
    if len(token_ids) % 4:
        raise ValueError(f"prompt_token_ids as bytes must be little-endian int32 "
                         f"(a multiple of 4 bytes), got {len(token_ids)} bytes")
    return np.frombuffer(token_ids, dtype="<i4")

