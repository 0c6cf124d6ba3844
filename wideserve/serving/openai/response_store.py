"""Where /v1/responses keeps the responses it stored, so `previous_response_id` can continue a
conversation and GET / DELETE / input_items can find them.

A record is the response object, the request's input items, and the conversation as chat
messages (every earlier turn plus this one's input and output, without `instructions`, which
OpenAI does not carry over): a follow-up's prompt is that history plus its new input, so the
earlier prompt is a prefix of the new one and the engine's prefix cache reuses its KV.

Two kinds (`--response-store`): `memory` (the default), and `sqlite` (the same records in a
SQLite file, `--response-store-path`, surviving restarts). Both are bounded: at most
`max_entries` records and `max_bytes` of serialized records; the least recently used go
first, and a record larger than the whole budget is not stored (logged; a later
previous_response_id naming it is a 404). SQLite calls run in a thread, off the event loop.
"""
from __future__ import annotations

import abc
import asyncio
import json
import logging
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("wideserve.server")

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(slots=True)
class StoreConfig:
    kind: str = "memory"                   # a key of STORES
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES
    path: str | None = None                # sqlite: the database file


class ResponseStore(abc.ABC):
    """Records by response id: {"response": ..., "input_items": [...], "history": [...]}."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config

    @abc.abstractmethod
    async def put(self, rid: str, record: dict[str, Any]) -> bool:
        """Store (or replace) a record; False when it is too large to keep."""

    @abc.abstractmethod
    async def get(self, rid: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def delete(self, rid: str) -> bool: ...

    def close(self) -> None:
        """Release files (sqlite); the memory store has none."""


class MemoryResponseStore(ResponseStore):
    """An LRU dict of serialized records (bytes: their size is what the budget counts, and a
    stored record cannot be changed through a reference a handler still holds)."""

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    async def put(self, rid: str, record: dict[str, Any]) -> bool:
        blob = json.dumps(record).encode()
        if len(blob) > self.config.max_bytes:
            logger.warning("response %s not stored: %d bytes exceed the store's budget of "
                           "%d (--response-store-max-bytes)", rid, len(blob),
                           self.config.max_bytes)
            await self.delete(rid)
            return False
        old = self._data.pop(rid, None)
        self._bytes -= len(old) if old is not None else 0
        self._data[rid] = blob
        self._bytes += len(blob)
        while len(self._data) > self.config.max_entries or self._bytes > self.config.max_bytes:
            _, evicted = self._data.popitem(last=False)
            self._bytes -= len(evicted)
        return True

    async def get(self, rid: str) -> dict[str, Any] | None:
        blob = self._data.get(rid)
        if blob is None:
            return None
        self._data.move_to_end(rid)
        return json.loads(blob)

    async def delete(self, rid: str) -> bool:
        blob = self._data.pop(rid, None)
        if blob is None:
            return False
        self._bytes -= len(blob)
        return True

    def __len__(self) -> int:
        return len(self._data)


class SqliteResponseStore(ResponseStore):
    """The records in a SQLite table (id, blob, size, last use), bounded like the memory store;
    one connection behind a lock, used from worker threads."""

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        if not config.path:
            raise ValueError("--response-store sqlite needs --response-store-path FILE")
        Path(config.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(Path(config.path).expanduser()),
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, "
                         "blob BLOB NOT NULL, size INTEGER NOT NULL, used INTEGER NOT NULL)")
        self._lock = threading.Lock()
        self._clock = self._db.execute("SELECT COALESCE(MAX(used), 0) FROM responses"
                                       ).fetchone()[0]

    async def _run(self, fn: Callable[[], Any]) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn()
        return await asyncio.to_thread(locked)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    async def put(self, rid: str, record: dict[str, Any]) -> bool:
        blob = json.dumps(record).encode()
        if len(blob) > self.config.max_bytes:
            logger.warning("response %s not stored: %d bytes exceed the store's budget of %d",
                           rid, len(blob), self.config.max_bytes)
            await self.delete(rid)
            return False

        def write() -> None:
            db = self._db
            db.execute("BEGIN")
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                       (rid, blob, len(blob), self._tick()))
            count, size = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
                                     ).fetchone()
            while count > self.config.max_entries or size > self.config.max_bytes:
                old_id, old_size = db.execute(
                    "SELECT id, size FROM responses ORDER BY used LIMIT 1").fetchone()
                db.execute("DELETE FROM responses WHERE id = ?", (old_id,))
                count, size = count - 1, size - old_size
            db.execute("COMMIT")
        await self._run(write)
        return True

    async def get(self, rid: str) -> dict[str, Any] | None:
        def read() -> bytes | None:
            row = self._db.execute("SELECT blob FROM responses WHERE id = ?", (rid,)).fetchone()
            if row is not None:
                self._db.execute("UPDATE responses SET used = ? WHERE id = ?",
                                 (self._tick(), rid))
            return None if row is None else row[0]
        blob = await self._run(read)
        return None if blob is None else json.loads(blob)

    async def delete(self, rid: str) -> bool:
        def remove() -> bool:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0
        return bool(await self._run(remove))

    def close(self) -> None:
        with self._lock:
            self._db.close()


STORES: dict[str, type[ResponseStore]] = {"memory": MemoryResponseStore,
                                          "sqlite": SqliteResponseStore}


def make_store(config: StoreConfig) -> ResponseStore:
    if config.kind not in STORES:
        raise ValueError(f"--response-store: {config.kind!r} is not one of {sorted(STORES)}")
    return STORES[config.kind](config)


def add_response_store_args(parser: Any) -> None:
    """The `wideserve serve` flags of the store."""
    from wideserve.config.arg_types import parse_bytes, parse_positive_int
    g = parser.add_argument_group("responses API store")
    g.add_argument("--response-store", choices=sorted(STORES), default="memory",
                   help="where /v1/responses keeps stored responses (previous_response_id, "
                        "GET /v1/responses/ID): memory, or sqlite (persistent)")
    g.add_argument("--response-store-path", default=None,
                   help="the SQLite file of --response-store sqlite")
    g.add_argument("--response-store-max-entries", type=parse_positive_int,
                   default=DEFAULT_MAX_ENTRIES,
                   help="stored responses kept at most (least recently used dropped first)")
    g.add_argument("--response-store-max-bytes", type=parse_bytes, default=DEFAULT_MAX_BYTES,
                   help="serialized size of the stored responses at most (e.g. 256MiB)")


def store_config_from_args(args: Any) -> StoreConfig:
    return StoreConfig(getattr(args, "response_store", "memory"),
                       getattr(args, "response_store_max_entries", DEFAULT_MAX_ENTRIES),
                       getattr(args, "response_store_max_bytes", DEFAULT_MAX_BYTES),
                       getattr(args, "response_store_path", None))
