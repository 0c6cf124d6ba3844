"""Invariants of the block pools and the group managers, checked from scratch.

For every bucket: each usable block is in exactly one state (free, cached, used), so
free + cached + used == pool size; the free queue's links are consistent and hold exactly the
unreferenced blocks; the (hash, group) map and the blocks' hashes agree one-to-one; every
block's ref count equals the number of live request tables holding it; a block belongs to one
group at a time and appears at most once in a request's table; the null block is untouched.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from wideserve.kv_cache.block_pool import BlockPool

if TYPE_CHECKING:
    from wideserve.kv_cache.group_managers import GroupManager


def _check_queue(pool: BlockPool, bucket: int, problems: list[str]) -> set[int]:
    in_queue: set[int] = set()
    prev = pool.free_queue._head
    for block in pool.free_queue:
        if block.prev is not prev:
            problems.append(f"bucket {bucket}: broken free-queue link before block "
                            f"{block.block_id}")
        if block.block_id in in_queue:
            problems.append(f"bucket {bucket}: block {block.block_id} twice in the free queue")
            break
        if block.is_null or pool.blocks[block.block_id] is not block:
            problems.append(f"bucket {bucket}: foreign or null block {block!r} in the free queue")
        in_queue.add(block.block_id)
        prev = block
    if len(in_queue) != pool.free_queue.num_free:
        problems.append(f"bucket {bucket}: free queue holds {len(in_queue)} blocks but counts "
                        f"{pool.free_queue.num_free}")
    return in_queue


def _check_hashes(pool: BlockPool, bucket: int, problems: list[str]) -> None:
    for (h, g), block in pool.cached.items():
        if block.block_hash != h or block.hash_group != g:
            problems.append(f"bucket {bucket}: map entry (hash {h.hex()[:8]}, group {g}) points "
                            f"at {block!r}")
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    for b in hashed:
        if pool.cached.get((b.block_hash, b.hash_group)) is not b:  # type: ignore[arg-type]
            problems.append(f"bucket {bucket}: {b!r} has a hash but is not in the map")
    if len(hashed) != len(pool.cached):
        problems.append(f"bucket {bucket}: {len(pool.cached)} map entries for "
                        f"{len(hashed)} hashed blocks")


def _expected_refs(managers: Iterable[GroupManager], pools: list[BlockPool],
                   problems: list[str]) -> list[Counter[int]]:
    refs: list[Counter[int]] = [Counter() for _ in pools]
    owner: list[dict[int, int]] = [{} for _ in pools]
    for m in managers:
        bucket = m.group.bucket_id
        for rid, table in m.req_tables.items():
            ids = [i for i in table if i]
            if len(ids) != len(set(ids)):
                problems.append(f"group {m.group_id}: request {rid!r} holds a block twice: "
                                f"{sorted(i for i, c in Counter(ids).items() if c > 1)}")
            for i in ids:
                if not 0 < i < pools[bucket].num_blocks:
                    problems.append(f"group {m.group_id}: request {rid!r} holds block id {i}, "
                                    f"outside bucket {bucket}")
                    continue
                other = owner[bucket].setdefault(i, m.group_id)
                if other != m.group_id:
                    problems.append(f"bucket {bucket}: block {i} held by groups "
                                    f"{other} and {m.group_id}")
                refs[bucket][i] += 1
    return refs


def check_manager_integrity(pools: list[BlockPool], managers: list[GroupManager],
                            requests: set[str],
                            write_start_ids: set[str],
                            quarantined: frozenset[str] | set[str] = frozenset()
                            ) -> dict[int, dict[str, int]]:
    """`quarantined`: keys holding blocks outside any request (KVCacheManager.quarantine);
    they count as live tables, and their blocks also as "quarantined"."""
    problems: list[str] = []
    refs = _expected_refs(managers, pools, problems)
    counts: dict[int, dict[str, int]] = {}
    for bucket, pool in enumerate(pools):
        null = pool.null_block
        if null.ref_cnt or null.block_hash is not None or null.prev or null.next:
            problems.append(f"bucket {bucket}: null block was touched: {null!r}")
        in_queue = _check_queue(pool, bucket, problems)
        _check_hashes(pool, bucket, problems)
        free = cached = used = 0
        for block in pool.blocks[1:]:
            want = refs[bucket].get(block.block_id, 0)
            if block.ref_cnt != want:
                problems.append(f"bucket {bucket}: {block!r} has ref_cnt {block.ref_cnt}, "
                                f"live requests hold it {want} times")
            if (block.ref_cnt == 0) != (block.block_id in in_queue):
                problems.append(f"bucket {bucket}: {block!r} is "
                                f"{'in' if block.block_id in in_queue else 'not in'} the free "
                                f"queue with ref_cnt {block.ref_cnt}")
            if block.ref_cnt > 0:
                used += 1
            elif block.block_hash is not None:
                cached += 1
            else:
                free += 1
        if free + cached + used != pool.num_usable:
            problems.append(f"bucket {bucket}: free {free} + cached {cached} + used {used} "
                            f"!= {pool.num_usable}")
        held = {i for m in managers if m.group.bucket_id == bucket
                for k in quarantined for i in m.req_tables.get(k, ()) if i}
        counts[bucket] = {"free": free, "cached": cached, "used": used,
                          "quarantined": len(held)}
    if requests & set(quarantined):
        problems.append(f"keys both requests and quarantined: {sorted(requests & quarantined)}")
    tracked = requests | set(quarantined)
    for m in managers:
        if set(m.req_tables) != tracked:
            problems.append(f"group {m.group_id}: tracks requests "
                            f"{sorted(set(m.req_tables) ^ tracked)} inconsistently")
        skipped = m.skipped_entries()
        if skipped is not None:
            for rid, table in m.req_tables.items():
                k = skipped.get(rid, 0)
                if any(table[:k]) or 0 in table[k:]:
                    problems.append(f"group {m.group_id}: request {rid!r} table {table} is not "
                                    f"{k} null entries followed by live blocks")
    if not write_start_ids <= requests:
        problems.append(f"kv_write_start kept for freed requests "
                        f"{sorted(write_start_ids - requests)}")
    if problems:
        raise AssertionError("KV cache integrity check failed:\n  " + "\n  ".join(problems))
    return counts
