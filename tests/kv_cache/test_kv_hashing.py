from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from kv_testing import make_request

from wideserve.kv_cache.hashing import (NONE_HASH, BlockHasher, encode_extra_keys,
                                        hash_block_tokens, hash_token_blocks, sub_block_key)

BS = 16


def reference_chain(tokens: list[int], bs: int, extra: bytes = b"") -> list[bytes]:
    """The documented formula, written out with plain struct packing (no numpy)."""
    out, parent = [], NONE_HASH
    for i in range(len(tokens) // bs):
        block = tokens[i * bs:(i + 1) * bs]
        payload = parent + struct.pack("<I", len(extra)) + extra + struct.pack(f"<{bs}q", *block)
        parent = hashlib.blake2b(payload, digest_size=32).digest()
        out.append(parent)
    return out


def test_chain_matches_the_formula_and_only_full_blocks():
    toks = list(range(1000, 1000 + 3 * BS + 5))
    hashes = hash_token_blocks(toks, BS)
    assert len(hashes) == 3
    assert hashes == reference_chain(toks, BS)
    assert hash_block_tokens(None, np.array(toks[:BS], dtype="<i8").tobytes()) == hashes[0]


def test_chain_dependence():
    toks = list(range(4 * BS))
    base = hash_token_blocks(toks, BS)
    changed_first = hash_token_blocks([7] + toks[1:], BS)
    assert all(a != b for a, b in zip(base, changed_first))       # every later hash moves
    changed_third = toks[:2 * BS] + [99] + toks[2 * BS + 1:]
    got = hash_token_blocks(changed_third, BS)
    assert got[:2] == base[:2] and got[2] != base[2] and got[3] != base[3]
    # Same block content under different parents hashes differently.
    assert hash_token_blocks(toks[BS:2 * BS], BS)[0] != base[1]


def test_extra_keys():
    toks = list(range(BS))
    plain = hash_token_blocks(toks, BS)[0]
    salted = hash_token_blocks(toks, BS, extra_keys=encode_extra_keys("salt"))[0]
    lora = hash_token_blocks(toks, BS, extra_keys=encode_extra_keys(3))[0]
    assert len({plain, salted, lora}) == 3
    assert salted == reference_chain(toks, BS, encode_extra_keys("salt"))[0]
    # Encoding is unambiguous.
    assert encode_extra_keys("ab", "c") != encode_extra_keys("a", "bc")
    assert encode_extra_keys(1) != encode_extra_keys("1") != encode_extra_keys(b"1")
    assert encode_extra_keys(None, "x") == encode_extra_keys("x")
    with pytest.raises(TypeError):
        encode_extra_keys(1.5)  # type: ignore[arg-type]


def test_block_hasher_incremental_equals_batch_and_per_block_extra_keys():
    toks = [int(t) for t in np.random.default_rng(0).integers(0, 50_000, 5 * BS + 3)]
    req = make_request("a", toks[:BS + 3])
    hasher = BlockHasher(BS)
    assert hasher(req) == req.block_hashes and len(req.block_hashes) == 1
    assert hasher(req) == []                                  # idempotent
    for t in toks[BS + 3:]:
        req.append_output_token_ids([t])
        hasher(req)
    assert req.block_hashes == hash_token_blocks(toks, BS)

    salted = BlockHasher(BS, extra_keys=lambda r, i: encode_extra_keys("s") if i == 0 else b"")
    req2 = make_request("b", toks)
    salted(req2)
    assert req2.block_hashes[0] != req.block_hashes[0]
    assert req2.block_hashes[1] == hash_block_tokens(
        req2.block_hashes[0], np.array(toks[BS:2 * BS], dtype="<i8").tobytes())


def test_draft_tokens_are_never_hashed():
    req = make_request("d", list(range(BS - 2)))
    req.spec_token_ids = [5, 6, 7]            # would complete the block if it were hashed
    hasher = BlockHasher(BS)
    assert hasher(req) == [] and req.block_hashes == []
    req.append_output_token_ids([1, 2])       # verified tokens complete it
    assert len(hasher(req)) == 1
    assert req.block_hashes == hash_token_blocks(list(range(BS - 2)) + [1, 2], BS)


def test_sub_block_key_is_distinct_per_page():
    h = hash_token_blocks(list(range(BS)), BS)[0]
    keys = {sub_block_key(h, k) for k in range(4)}
    assert len(keys) == 4 and h not in keys


def test_deterministic_across_processes():
    toks = list(range(300, 300 + 3 * BS))
    code = ("from wideserve.kv_cache.hashing import hash_token_blocks, encode_extra_keys;"
            f"print(','.join(x.hex() for x in hash_token_blocks({toks!r}, {BS}, "
            "extra_keys=encode_extra_keys('salt', 7))))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, timeout=120).stdout.strip()
    here = hash_token_blocks(toks, BS, extra_keys=encode_extra_keys("salt", 7))
    assert out.split(",") == [x.hex() for x in here]


def test_hashing_is_cheap():
    # 256k tokens = 1,000 blocks of 256: one numpy conversion plus one blake2b per block.
    toks = list(range(256 * 1000))
    req = make_request("big", toks)
    # This thread's CPU time, not the wall clock: on a loaded machine the thread may wait
    # for a core far longer than it computes (the bound is unchanged).
    t0 = time.thread_time()
    BlockHasher(256)(req)
    elapsed = time.thread_time() - t0
    assert len(req.block_hashes) == 1000
    assert elapsed < 1.0, f"hashing 256k tokens took {elapsed:.3f} s of CPU"


def test_image_digests_key_the_blocks_holding_the_span():
    """Two prompts with the same ids (the image span all placeholder ids) and different
    images share the blocks before the span only; the same image: every block; a text
    prompt's hashes are the plain chain."""
    from wideserve.types.multimodal import ImageInput, image_digest
    from wideserve.types.request import Request
    from wideserve.types.sampling_params import SamplingParams

    def image(content: bytes) -> ImageInput:
        grid = [8, 8, 2, 2, 1, 1]
        return ImageInput(10, 5, grid, content, image_digest(grid, content))

    ids = list(range(1, 10)) + [99] * 5 + list(range(20, 38))       # 32 ids, span [10, 15)
    hasher = BlockHasher(8)

    def hashes(images):
        r = Request("r", ids, SamplingParams(max_tokens=1), images=images)
        hasher(r)
        return r.block_hashes
    a, b, a2 = hashes([image(b"a" * 8)]), hashes([image(b"b" * 8)]), hashes([image(b"a" * 8)])
    text = hashes(None)
    assert a == a2 and len(a) == 4
    assert a[0] == b[0] == text[0]          # block 0 ([0, 8)) holds no image row
    assert all(x != y for x, y in zip(a[1:], b[1:]))   # blocks 1.. hold it or follow it
    assert text == reference_chain(ids, 8)
