"""The int32 admission path: the request's token buffer, hashes from it, bulk block pops.

The hash chain is what prefix hits and P/D handles compare across processes and versions, so
the hashes from the int32 buffer are checked against the pre-buffer implementation, kept
here verbatim (`old_hash_token_blocks`, `old_block_hasher`)."""
from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import pytest
from kv_testing import make_manager, make_request, v4_specs

from wideserve.kv_cache.block_pool import BlockPool
from wideserve.kv_cache.hashing import BlockHasher, hash_token_blocks
from wideserve.types.request import Request, token_ids_to_int32
from wideserve.types.sampling_params import SamplingParams


# ------------------------------------------------------------- the old implementation
def old_hash_block_tokens(parent, token_bytes, extra_keys=b""):
    h = hashlib.blake2b(digest_size=32)
    h.update(NONE_HASH if parent is None else parent)
    h.update(struct.pack("<I", len(extra_keys)))
    h.update(extra_keys)
    h.update(token_bytes)
    return h.digest()


NONE_HASH = hashlib.blake2b(b"wideserve/prefix-cache/v1", digest_size=32).digest()


def old_hash_token_blocks(token_ids, block_size, parent=None, extra_keys=b""):
    n_full = len(token_ids) // block_size
    raw = memoryview(np.asarray(token_ids[:n_full * block_size], dtype="<i8").tobytes())
    step = 8 * block_size
    out = []
    for i in range(n_full):
        extra = extra_keys(i) if callable(extra_keys) else extra_keys
        parent = old_hash_block_tokens(parent, raw[i * step:(i + 1) * step], extra)
        out.append(parent)
    return out


def old_block_hasher(block_size, extra_keys, all_token_ids, hashes):
    """BlockHasher.__call__ before the int32 buffer: slices the Python list."""
    start, n_full = len(hashes), len(all_token_ids) // block_size
    if n_full <= start:
        return []
    new = old_hash_token_blocks(
        all_token_ids[start * block_size:n_full * block_size], block_size,
        hashes[-1] if hashes else None,
        (lambda i: extra_keys(None, start + i)) if extra_keys else b"")
    hashes.extend(new)
    return new


# ------------------------------------------------------------------------- hashes
@pytest.mark.parametrize("seed", range(6))
def test_hashes_from_the_int32_buffer_equal_the_old_chain(seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 4, 16, 256]))
    n = int(rng.integers(0, 40 * bs))
    # Ids across the whole int32 range (a sign or width mistake changes the bytes).
    prompt = rng.integers(0, 2**31 - 1, n).tolist()
    if n:
        prompt[0] = 2**31 - 1
    extra = None if seed % 2 else (lambda req, i: b"salt" + bytes([i % 7]) * (i % 3))
    req = Request(f"r{seed}", prompt, SamplingParams())
    hasher = BlockHasher(bs, extra)
    old: list[bytes] = []
    assert hasher(req) == old_block_hasher(bs, extra, list(prompt), old)
    # Output tokens arrive a few at a time; every increment hashes the same as before.
    all_ids = list(prompt)
    for _ in range(8):
        out = rng.integers(0, 200_000, int(rng.integers(1, 3 * bs + 2))).tolist()
        req.append_output_token_ids(out)
        all_ids += out
        assert hasher(req) == old_block_hasher(bs, extra, all_ids, old)
    assert req.block_hashes == old and len(old) == len(all_ids) // bs


def test_hash_token_blocks_accepts_lists_and_arrays_alike():
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 2**31 - 1, 1000).tolist()
    ref = old_hash_token_blocks(toks, 16, b"p" * 32, b"x")
    assert hash_token_blocks(toks, 16, b"p" * 32, b"x") == ref
    assert hash_token_blocks(np.array(toks, dtype=np.int32), 16, b"p" * 32, b"x") == ref
    assert hash_token_blocks(np.array(toks, dtype=np.int64), 16, b"p" * 32, b"x") == ref
    # A wrong byte width (int32 bytes hashed as such) would give another chain.
    assert hash_token_blocks(toks[:16], 16) != [old_hash_block_tokens(
        None, np.array(toks[:16], dtype="<i4").tobytes())]


# ------------------------------------------------------------------ token buffer
def test_token_buffer_follows_appends_and_growth():
    req = Request("r", [5, 6, 7], SamplingParams())
    assert req.token_array().dtype == np.int32
    for k in range(1, 60):                      # past several doublings of the capacity
        req.append_output_token_ids(list(range(k)))
    assert req.token_array().tolist() == req.all_token_ids
    assert req.prompt_array().tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        req.token_array()[0] = 1                # read-only: hashes are taken from it


def test_token_buffer_refuses_ids_outside_int32_and_detects_bypassed_appends():
    with pytest.raises(ValueError, match="int32"):
        Request("r", [1, 2**31], SamplingParams())
    with pytest.raises(ValueError, match="int32"):
        token_ids_to_int32(np.array([-2**31 - 1], dtype=np.int64))
    req = Request("r", [1, 2, 3], SamplingParams())
    req.all_token_ids.append(4)                 # not through append_output_token_ids
    with pytest.raises(RuntimeError, match="outside append_output_token_ids"):
        BlockHasher(2)(req)


# --------------------------------------------------------------------- bulk pops
def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


@pytest.mark.parametrize("n", [0, 1, 5, 19])
def test_get_new_blocks_takes_exactly_n_from_the_head(n):
    pool = BlockPool(20)
    for i in (3, 4):                            # cached blocks: evicted when handed out
        assert pool.cache_block(pool.blocks[i], bytes([i]) * 32, 0)
    before = queue_ids(pool)
    got = pool.get_new_blocks(n)
    assert [b.block_id for b in got] == before[:n]
    assert queue_ids(pool) == before[n:] and pool.num_free_blocks == 19 - n
    assert all(b.ref_cnt == 1 and b.prev is None and b.next is None for b in got)
    assert all(b.block_hash is None for b in got)
    assert sorted(pool.cached) == sorted((bytes([i]) * 32, 0) for i in (3, 4) if i > n)
    # The remaining queue is still linked both ways.
    node, back = pool.free_queue._tail.prev, []
    while node is not pool.free_queue._head:
        back.append(node.block_id)
        node = node.prev
    assert back[::-1] == before[n:]
    pool.free_blocks(reversed(got))
    assert pool.num_free_blocks == 19


def test_get_new_blocks_refuses_more_than_free_and_changes_nothing():
    pool = BlockPool(8)
    pool.get_new_blocks(3)
    before = queue_ids(pool)
    with pytest.raises(ValueError, match="only 4 free"):
        pool.get_new_blocks(5)
    assert queue_ids(pool) == before and pool.num_free_blocks == 4


def test_long_admission_gets_the_right_block_counts_per_group():
    """A P/D admission of a long prompt on the V4 layout: growing groups get one page per
    `page` positions, sliding groups only the pages the window after the prompt reads."""
    n = 20 * 256 + 17
    mgr, cfg = make_manager(v4_specs(), num_blocks=400)
    req = make_request("r", [(13 * i) % 9000 for i in range(n)])
    hit, num_hit = mgr.get_computed_blocks(req)
    assert num_hit == 0 and len(req.block_hashes) == n // 256
    free_before = mgr.free_blocks_per_bucket
    assert mgr.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) is not None
    taken = [a - b for a, b in zip(free_before, mgr.free_blocks_per_bucket)]
    expect = [0] * len(free_before)
    for g, row in zip(cfg.groups, mgr.block_rows("r")):
        pages = math.ceil((n - 1) / g.block_size)
        assert len(row) == pages
        live = [b for b in row if b]
        if g.is_sliding:
            first = max(0, n - 1 - g.spec.window + 1) // g.block_size
            assert live == row[first:] and all(b == 0 for b in row[:first])
        else:
            assert len(live) == pages
        assert len(set(live)) == len(live)
        expect[g.bucket_id] += len(live)
    assert taken == expect
    mgr.free(req)
    assert mgr.free_blocks_per_bucket == free_before
    mgr.check_integrity()
