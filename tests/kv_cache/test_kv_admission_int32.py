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
from kv_testing import make_manager, make_request, run_prefill, v4_specs

from wideserve.kv_cache.block_pool import BlockPool
from wideserve.kv_cache.hashing import BlockHasher, hash_token_blocks
from wideserve.kv_cache.kv_cache_manager import LOOKUP_HASH_BATCH, PUBLISH_BLOCKS_PER_CALL
from wideserve.types.request import (Request, TokenIds, prompt_token_array, token_ids_to_bytes,
                                     token_ids_to_int32)
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


def test_token_buffer_refuses_ids_outside_int32_and_has_no_second_copy():
    with pytest.raises(ValueError, match="int32"):
        Request("r", [1, 2**31], SamplingParams())
    with pytest.raises(ValueError, match="int32"):
        token_ids_to_int32(np.array([-2**31 - 1], dtype=np.int64))
    req = Request("r", [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="int32"):
        req.append_output_token_ids([2**31])
    # all_token_ids IS the buffer: an append by any route is what the hashes read.
    req.all_token_ids.append(4)
    assert req.token_array().tolist() == [1, 2, 3, 4] and BlockHasher(2)(req) == \
        old_hash_token_blocks([1, 2, 3, 4], 2)
    with pytest.raises(TypeError, match="frozen"):
        req.prompt_token_ids.append(5)          # a prompt never changes


# ------------------------------------------------------------- TokenIds, the wire form
def test_token_ids_read_like_the_list_they_replace():
    rng = np.random.default_rng(3)
    ref = rng.integers(0, 2**31 - 1, 300).tolist()
    ids = TokenIds(ref[:100])
    ids.extend(ref[100:250])
    for t in ref[250:]:
        ids.append(t)
    assert len(ids) == len(ref) and ids == ref and list(ids) == ref and ids.tolist() == ref
    for i in (0, 1, 299, -1, -300):
        assert ids[i] == ref[i] and type(ids[i]) is int
    for sl in (slice(0, 10), slice(5, 5), slice(290, 400), slice(-7, None), slice(None, 3)):
        assert ids[sl] == ref[sl] and type(ids[sl]) is list
    with pytest.raises(IndexError):
        ids[300]
    assert ref[7] in ids and -1 not in ids and sum(ids) == sum(ref)
    assert ids + [1] == ref + [1] and [1] + ids == [1] + ref
    assert np.asarray(ids, dtype=np.int64).tolist() == ref and repr(ids) == repr(ref)
    assert ids != ref[:-1] and ids == TokenIds(np.array(ref, dtype=np.int32))


def test_a_prompt_sent_as_bytes_is_read_in_place_and_never_written():
    prompt = [(37 * i) % 50_000 for i in range(1000)]
    wire = token_ids_to_bytes(prompt)
    assert isinstance(wire, bytes) and len(wire) == 4 * len(prompt)
    arr = prompt_token_array(wire)
    req = Request("r", arr, SamplingParams())
    # No copy at admission: the prompt and all_token_ids read the received bytes.
    assert np.shares_memory(req.prompt_array(), arr) and np.shares_memory(req.token_array(), arr)
    req.append_output_token_ids([7, 8])
    assert req.all_token_ids == prompt + [7, 8] and req.prompt_token_ids == prompt
    assert bytes(wire) == np.array(prompt, dtype="<i4").tobytes()    # the bytes untouched
    # What the engine must refuse itself stays a list; bytes that are not int32 are an error.
    for bad in ([], [1, 2**31], [-2**31 - 1], ["a"]):
        assert token_ids_to_bytes(bad) is bad
    with pytest.raises(ValueError, match="multiple of 4"):
        prompt_token_array(b"\x01\x00\x00")


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
    # Lazy lookup: a new prompt hashes one batch of blocks (the first one misses), not all 20.
    assert num_hit == 0 and len(req.block_hashes) == LOOKUP_HASH_BATCH < n // 256
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


# ------------------------------------------------------------------- lazy hashing
def full_specs():
    import torch
    from kv_testing import FULL
    from wideserve.kv_cache.spec import KVCacheSpec
    return {f"l{i}": KVCacheSpec(FULL, "kv", 64, torch.bfloat16) for i in range(2)}


def test_lookup_hashes_only_as_far_as_a_hit_can_reach():
    """A lookup stops hashing at the first block the cache does not hold (a chain hash: no
    later block can hit); the hit and the hashes it made equal the full chain's."""
    bs, n = 16, 16 * 100 + 3
    mgr, _ = make_manager(full_specs(), num_blocks=400, block_size=bs)
    shared = [(7 * i) % 997 for i in range(n)]
    first = make_request("a", shared)
    run_prefill(mgr, first, chunk=64)
    mgr.free(first)
    chain = old_hash_token_blocks(shared, bs)
    for hit_blocks in (0, 1, 30, 100):
        req = make_request(f"b{hit_blocks}", shared[:hit_blocks * bs] + [5000] * (n - hit_blocks * bs))
        _, num_hit = mgr.get_computed_blocks(req)
        hashed = len(req.block_hashes)
        assert num_hit == min(hit_blocks, (n - 1) // bs) * bs
        assert req.block_hashes == chain[:hashed] if hit_blocks == 100 else \
            req.block_hashes[:hit_blocks] == chain[:hit_blocks]
        # Bounded by twice the hit plus one batch, not the prompt's 100 blocks.
        assert hashed <= min(2 * hit_blocks + LOOKUP_HASH_BATCH, n // bs)
        assert hit_blocks == 100 or hashed < n // bs
    mgr.check_integrity()


@pytest.mark.parametrize("specs, mode", [(full_specs, "keep"), (v4_specs, "replay"),
                                         (v4_specs, "keep")])
def test_a_long_load_publishes_a_bounded_number_of_blocks_per_call(specs, mode):
    """A P/D-style admission whose KV arrives whole: its blocks are hashed and published at
    most PUBLISH_BLOCKS_PER_CALL per allocate_slots call (a decode step), the same chain as
    hashing it whole; in the end every block is published, so the same prompt hits in full."""
    bs, blocks = 256, 3 * PUBLISH_BLOCKS_PER_CALL + 5
    n = bs * blocks + 9
    replay = 600 if mode == "replay" else None
    mgr, _ = make_manager(specs(), num_blocks=4 * blocks + 64, mode=mode, replay_tokens=replay)
    prompt = [(11 * i) % 30_000 for i in range(n)]
    req = make_request("r", prompt)
    hit, num_hit = mgr.get_computed_blocks(req)
    assert len(req.block_hashes) == LOOKUP_HASH_BATCH
    assert mgr.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) is not None
    req.num_computed_tokens = n - 1                       # the load arrived
    calls = 0
    while len(req.block_hashes) < blocks:
        before = len(req.block_hashes)
        assert mgr.allocate_slots(req, 1) is not None     # one decode step each
        req.append_output_token_ids([1])
        req.num_computed_tokens += 1
        calls += 1
        assert len(req.block_hashes) - before <= PUBLISH_BLOCKS_PER_CALL
    assert calls == math.ceil(blocks / PUBLISH_BLOCKS_PER_CALL)
    assert req.block_hashes == old_hash_token_blocks(prompt, bs)
    other = make_request("again", prompt)
    _, num_hit = mgr.get_computed_blocks(other)
    full_hit = blocks * bs
    # V4 in keep mode: a load leaves only the last window's sliding pages, which do not
    # reach back to a logical boundary here, so no boundary has its window (as before).
    expect = full_hit - replay if mode == "replay" else full_hit if specs is full_specs else 0
    assert num_hit == expect
    mgr.free(req)
    mgr.check_integrity()


def full_and_window_specs():
    import torch
    from kv_testing import FULL, SLIDING
    from wideserve.kv_cache.spec import KVCacheSpec
    return {"l0.kv": KVCacheSpec(FULL, "kv", 64, torch.bfloat16),
            "l1.win": KVCacheSpec(SLIDING, "window", 64, torch.bfloat16, window=128)}


@pytest.mark.parametrize("tail", [1, 126, 127])
def test_keep_mode_publishing_lags_without_losing_a_sliding_hit(monkeypatch, tail):
    """Keep mode, a growing and a 128-token sliding group: the lagging publication gives a
    later request the hit that publishing all at once gives. With a tail of 126-127 tokens
    past the last boundary, the window page that hit needs leaves the window in the first
    steps after the load, before the capped publication reaches it: it is published first."""
    import wideserve.kv_cache.kv_cache_manager as kvm
    bs, blocks = 256, 3 * PUBLISH_BLOCKS_PER_CALL + 5
    n = bs * blocks + tail
    prompt = [(17 * i) % 30_000 for i in range(n)]
    hits = {}
    for cap in (PUBLISH_BLOCKS_PER_CALL, 10**9):
        monkeypatch.setattr(kvm, "PUBLISH_BLOCKS_PER_CALL", cap)
        mgr, _ = make_manager(full_and_window_specs(), num_blocks=4 * blocks + 64)
        req = make_request("r", prompt)
        hit, num_hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, 0, hit, num_hit, num_external_tokens=n - 1) is not None
        req.num_computed_tokens = n - 1
        seen = []
        for step in range(1, 41):
            assert mgr.allocate_slots(req, 1) is not None
            req.append_output_token_ids([3])
            req.num_computed_tokens += 1
            if step in (1, 5, 40):                        # a later request's hit, meanwhile
                probe = make_request(f"p{step}", req.all_token_ids.tolist() + [9])
                seen.append(mgr.get_computed_blocks(probe)[1])
        hits[cap] = seen
        mgr.free(req)
        mgr.check_integrity()
    # While lagging a hit may come a few steps later, never smaller once caught up.
    assert hits[10**9] == [blocks * bs] * 3
    assert hits[PUBLISH_BLOCKS_PER_CALL][1:] == hits[10**9][1:]
