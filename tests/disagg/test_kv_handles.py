"""KV handles are bound to what their producer exported (docs/disaggregation.md, "Threat
model"): the lease table serves a lease only for its exact id and blocks, once, before it
expires, and counts everything else; a decode engine admits only a handle its producer
signed for this very prompt. The attack: request A's prompt on the prefill engine, then
hand the decode engine request B with a handle forged to reach A's blocks; B is refused and
not one byte of A's KV moves."""
from __future__ import annotations

import time

import pytest

from pd_harness import decode, greedy, make_engines, prefill, run_colocated, settle, write_config
from test_pd_faults import LLAMA, MAX_NEW
from wideserve.types.messages import EngineCoreRequest
from wideserve.disagg.leases import LeaseRef, LeaseTable
from wideserve.disagg.connector_metrics import families
from wideserve.disagg.params import RemoteKV, handle_problem, prompt_digest, sign_handle

ROWS = [[3, 4, 5], [0, 7, 8]]


def _ref(table: LeaseTable, rid: str = "a", rows=None, tokens: int = 40) -> LeaseRef:
    lease = table.grant(rid, 30.0, ROWS if rows is None else rows, tokens)
    return LeaseRef(rid, lease, [list(r) for r in (ROWS if rows is None else rows)], tokens)


# ----------------------------------------------------------------------------- lease table
def test_lease_served_once_for_its_exact_blocks():
    t = LeaseTable()
    ref = _ref(t)
    assert t.open(ref) == ""                            # a pull opens it ...
    assert "already served" in t.open(ref)              # ... once
    assert t.claim(ref)[0] is None                      # nor can it be pushed now
    assert t.release(ref) is True                       # the pull's confirmation
    assert t.take_released() == ["a"]
    assert t.release(ref) is False
    assert t.counters() == {"leases_refused_mismatch": 0, "leases_refused_unknown": 3}


def test_release_without_open_frees_but_confirms_nothing():
    t = LeaseTable()
    ref = _ref(t)
    assert t.release(ref) is False                      # a consumer that gave up
    assert t.take_released() == ["a"] and len(t) == 0


@pytest.mark.parametrize("field,value", [
    ("rows", [[3, 4, 6], [0, 7, 8]]),                  # one block id differs
    ("rows", [[3, 4, 5, 9], [0, 7, 8]]),               # one block more
    ("rows", [[3, 4], [0, 7, 8]]),                     # one block fewer
    ("lease", "0" * 32),                                # a guessed lease id
    ("num_tokens", 41),
])
def test_wrong_lease_or_blocks_are_refused_counted_and_leave_the_lease_intact(field, value):
    t = LeaseTable()
    ref = _ref(t)
    forged = LeaseRef(**{**{f: getattr(ref, f) for f in ref.__struct_fields__}, field: value})
    assert t.release(forged) is False
    why = "the handle does not match the lease (wrong lease id or block ids)"
    assert t.claim(forged) == (None, why) and t.open(forged) == why
    assert t.counters()["leases_refused_mismatch"] == 3
    assert t.take_released() == []                      # nothing freed for the forger ...
    assert t.open(ref) == ""                            # ... the real holder is served
    assert t.release(forged) is False                   # an opened lease is no easier
    assert t.release(ref) is True


def test_another_requests_lease_id_is_refused():
    t = LeaseTable()
    a, b = _ref(t, "a"), _ref(t, "b", rows=[[9], [10]])
    # B's lease id (and B's blocks) presented for A, and A's blocks under B's name.
    assert t.open(LeaseRef("a", b.lease, b.rows, b.num_tokens)) != ""
    assert t.open(LeaseRef("b", b.lease, a.rows, a.num_tokens)) != ""
    assert t.counters()["leases_refused_mismatch"] == 2
    assert t.open(a) == t.open(b) == ""
    assert t.release(a) and t.release(b)


class _Clock:
    """The lease table's clock, moved by the test: expiry is decided by the deadline alone,
    never by how long the (loaded) machine took between two lines of the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_expired_lease_is_not_served(monkeypatch):
    from wideserve.disagg import leases
    clock = _Clock()
    monkeypatch.setattr(leases, "time", clock)
    t = LeaseTable()
    ref = LeaseRef("a", t.grant("a", 0.01, ROWS, 40), ROWS, 40)
    clock.now += 0.01                                   # the deadline itself: expired
    assert t.claim(ref) == (None, "this instance no longer held the blocks (lease expired)")
    assert t.take_released() == ["a"]                   # freed at once
    ref1 = LeaseRef("c", t.grant("c", 0.01, ROWS, 40), ROWS, 40)
    clock.now += 0.02
    assert t.open(ref1) == "this instance no longer held the blocks (lease expired)"
    assert t.take_released() == ["c"]
    ref3 = LeaseRef("d", t.grant("d", 0.05, ROWS, 40), ROWS, 40)
    clock.now += 0.049                                  # still held: served
    assert t.open(ref3) == ""
    assert t.take_expired() == []
    clock.now += 0.002                                  # expired mid-pull
    assert t.take_expired() == ["d"] and t.release(ref3) is False
    ref2 = LeaseRef("b", t.grant("b", 0.01, ROWS, 40), ROWS, 40)
    clock.now += 0.02
    assert t.take_expired() == ["b"]
    assert t.release(ref2) is False
    assert t.counters()["leases_refused_unknown"] == 2     # both late releases


def test_claim_holds_until_the_write_stops_and_only_once():
    t = LeaseTable()
    ref = _ref(t)
    assert t.claim(ref) == (ROWS, "")
    assert t.take_expired(time.monotonic() + 100) == []     # a claimed lease cannot expire
    assert t.claim(ref)[0] is None and t.release(ref) is False
    t.finish_claim("a")
    assert t.take_released() == ["a"] and len(t) == 0


# --------------------------------------------------------------------------------- handles
def _handle(secret: bytes, prompt: list[int]) -> RemoteKV:
    return sign_handle(secret, RemoteKV(
        remote_engine_id="P", remote_host="10.0.0.1", remote_port=5555,
        remote_request_id="a", remote_block_ids=ROWS, remote_num_tokens=len(prompt),
        remote_layout="f" * 32, remote_lease="1" * 32,
        remote_prompt_digest=prompt_digest(prompt)))


@pytest.mark.parametrize("field,value", [
    ("remote_block_ids", [[3, 4, 9], [0, 7, 8]]), ("remote_request_id", "b"),
    ("remote_lease", "2" * 32), ("remote_host", "10.6.6.6"), ("remote_port", 5556),
    ("remote_engine_id", "Q"), ("remote_num_tokens", 4)])
def test_every_field_of_a_handle_is_signed(field, value):
    secret, prompt = b"k" * 32, [5, 6, 7]
    h = _handle(secret, prompt)
    assert handle_problem(secret, h, prompt) is None
    setattr(h, field, value)
    assert "signature does not verify" in handle_problem(secret, h, prompt)


def test_handle_is_refused_unsigned_for_another_prompt_or_secret():
    secret, prompt = b"k" * 32, [5, 6, 7]
    h = _handle(secret, prompt)
    assert "for a different prompt" in handle_problem(secret, h, [5, 6, 8])
    assert "signature does not verify" in handle_problem(b"x" * 32, h, prompt)
    h.remote_mac = ""
    assert "not signed" in handle_problem(secret, h, prompt)


def test_handle_of_an_image_prompt_is_bound_to_its_images():
    """The ids of an image span are all image_token_id: the digest covers each image's
    offset, length and content digest, so another image (or none, or the image elsewhere)
    is another prompt; a prompt without images keeps the ids-only digest."""
    from wideserve.types.multimodal import ImageInput
    secret, prompt = b"k" * 32, [5, 9, 9, 9, 6]
    image = ImageInput(1, 3, [8, 8, 2, 2, 1, 1], b"", b"a" * 16)
    h = _handle(secret, prompt)
    h.remote_prompt_digest = prompt_digest(prompt, [image])
    sign_handle(secret, h)
    assert handle_problem(secret, h, prompt, [image]) is None
    for other in ([ImageInput(1, 3, image.grid, b"", b"b" * 16)], None,
                  [ImageInput(2, 3, image.grid, b"", image.digest)]):
        assert "for a different prompt" in handle_problem(secret, h, prompt, other)
    assert prompt_digest(prompt, []) == prompt_digest(prompt)


# ------------------------------------------------------------------ the attack on engines
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("llama"), LLAMA)


def test_forged_handles_for_another_requests_blocks_are_refused(model):
    p, d, ref = make_engines(model, load_format="dummy", block_size=16,
                             kv_cache_memory=1 << 22)
    a_prompt = [2 + (5 * j) % 150 for j in range(40)]
    b_prompt = [3 + (11 * j) % 150 for j in range(40)]         # B: same length, own content
    h_a, h_b = prefill(p, [a_prompt, b_prompt])
    # What an attacker can try with B: its own (real) handle re-pointed at A's blocks; A's
    # handle (leaked) as is, or re-signed by nobody; a handle built from scratch for A.
    attempts = {
        "b_with_a_blocks": {**h_b, "remote_block_ids": h_a["remote_block_ids"]},
        "a_handle_for_b": h_a,
        "a_handle_renamed": {**h_a, "remote_request_id": h_b["remote_request_id"]},
        "unsigned": {k: v for k, v in h_a.items() if k != "remote_mac"},
        "a_with_b_lease": {**h_a, "remote_lease": h_b["remote_lease"]},
    }
    before = d.kv_connector.scheduler.snapshot()
    for i, (name, forged) in enumerate(attempts.items()):
        with pytest.raises(ValueError, match="kv_transfer_params: the handle") as e:
            d.add_request(EngineCoreRequest(f"x{i}", b_prompt, greedy(MAX_NEW, forged)))
        assert "signature" in str(e.value) or "different prompt" in str(e.value) \
            or "not signed" in str(e.value), name
    after = d.kv_connector.scheduler.snapshot()
    # Not one byte moved, no load started; every refusal counted (and exported).
    for key in ("bytes_loaded", "pages_loaded", "loads_started", "tokens_loaded"):
        assert after[key] == before[key] == 0, key
    assert after["handles_refused"] == len(attempts)
    exported = {f.name: f.samples[0].value for f in families(after, "m")}
    assert exported["wideserve:kv_transfer_handles_refused"] == len(attempts)
    # A's and B's leases are still held for their real holders, who get their own KV.
    assert p.kv_connector.scheduler.num_held == 2
    expected = run_colocated(ref, [a_prompt, b_prompt], MAX_NEW)
    outs = decode(d, p, [a_prompt, b_prompt], [h_a, h_b], MAX_NEW)
    assert [outs["d0"]["tokens"], outs["d1"]["tokens"]] == expected
    assert d.kv_connector.scheduler.stats.loads_done == 2
    assert p.kv_connector.scheduler.snapshot()["leases_refused_mismatch"] == 0
    settle(p, d, ref)
