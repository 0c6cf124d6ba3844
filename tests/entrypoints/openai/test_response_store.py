"""The response store's bounds (entries, bytes, least recently used first, an oversized record
not kept), SQLite persistence across a reopen, and the ignored-fields header's hygiene."""
from __future__ import annotations

import asyncio

import pytest

from wideserve.serving.openai.lenient import IGNORED_HEADER, ignored_header
from wideserve.serving.openai.response_store import (MemoryResponseStore, SqliteResponseStore,
                                                     StoreConfig, make_store)


def _record(i: int, size: int = 10) -> dict:
    return {"response": {"id": f"r{i}", "status": "completed"}, "input_items": [],
            "history": [{"role": "user", "content": "x" * size}]}


def _stores(tmp_path, **kw):
    return [MemoryResponseStore(StoreConfig(**kw)),
            SqliteResponseStore(StoreConfig("sqlite", path=str(tmp_path / "s.db"), **kw))]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("kind", [0, 1], ids=["memory", "sqlite"])
def test_entry_bound_evicts_least_recently_used(tmp_path, kind):
    store = _stores(tmp_path, max_entries=3)[kind]

    async def go():
        for i in range(3):
            assert await store.put(f"r{i}", _record(i))
        assert await store.get("r0") is not None          # r0 used: r1 is now the oldest
        await store.put("r3", _record(3))
        return [await store.get(f"r{i}") is not None for i in range(4)]

    assert run(go()) == [True, False, True, True]


@pytest.mark.parametrize("kind", [0, 1], ids=["memory", "sqlite"])
def test_byte_bound_and_oversized_records(tmp_path, kind):
    store = _stores(tmp_path, max_bytes=600)[kind]

    async def go():
        for i in range(4):
            await store.put(f"r{i}", _record(i, 150))     # ~240 bytes each: 2 fit
        kept = [await store.get(f"r{i}") is not None for i in range(4)]
        too_big = await store.put("big", _record(9, 1000))
        return kept, too_big, await store.get("big")

    kept, too_big, big = run(go())
    assert kept == [False, False, True, True]
    assert too_big is False and big is None


def test_sqlite_persists_across_reopen_and_delete(tmp_path):
    path = str(tmp_path / "persist.db")
    first = make_store(StoreConfig("sqlite", path=path))
    run(first.put("r1", _record(1)))
    run(first.put("r2", _record(2)))
    first.close()
    again = make_store(StoreConfig("sqlite", path=path))
    assert run(again.get("r1")) == _record(1)
    assert run(again.delete("r2")) and not run(again.delete("r2"))
    assert run(again.get("r2")) is None


def test_bad_store_configs_name_the_flag():
    with pytest.raises(ValueError, match="--response-store-path"):
        make_store(StoreConfig("sqlite"))
    with pytest.raises(ValueError, match="--response-store"):
        make_store(StoreConfig("redis"))


def test_ignored_header_is_bounded_and_clean():
    assert ignored_header([]) == {}
    hostile = ["a\r\nSet-Cookie: x", "b" * 500, "ü,v"] + [f"f{i}" for i in range(40)]
    value = ignored_header(hostile)[IGNORED_HEADER]
    assert "\r" not in value and "\n" not in value and "ü" not in value
    assert len(value) < 2000 and "(43 in all)" in value
