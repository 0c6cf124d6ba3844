"""The project's EPLB policy runs inside the simulator, target and draft separately."""
from __future__ import annotations

import numpy as np
import pytest

from wideserve.parallel.eplb import policy
from wideserve.sim.eplb import EplbSettings, EplbState, zipf_shares
from wideserve.sim.simulator import Layout, Simulation
from wideserve.sim.workload import fixed

from sim_helpers import gpu, profile, tiny_model


def test_rebalance_calls_the_real_policy_and_raises_balancedness(monkeypatch):
    calls = []
    real = policy.rebalance

    def spy(load, num_slots, num_ranks, *a, **kw):
        calls.append((np.asarray(load).copy(), num_slots, num_ranks))
        return real(load, num_slots, num_ranks, *a, **kw)
    monkeypatch.setattr(policy, "rebalance", spy)
    shares = zipf_shares(4, 32, skew=1.2, seed=3)
    st = EplbState(shares, 8, EplbSettings(True, interval=10, window=4, redundant=8))
    before = st.balancedness()
    for step in range(10):
        st.after_step(step, total_rows=4096)
    assert len(calls) == 1 and calls[0][1:] == (40, 8)
    assert calls[0][0].sum() == 4 * 4 * 4096           # window: 4 steps x 4 layers of rows
    after = st.balancedness()
    assert after > before
    # the simulator's number is the policy's own metric on the policy's placement
    expect = policy.balancedness(policy.rank_loads(shares, st.phy2log, 8))
    assert after == pytest.approx(expect)
    assert st.history == [(0, before), (10, after)]


def test_target_and_draft_balanced_separately():
    lay = Layout(dep=4, batch=8, mtp_k=2, acceptance=(0.7, 0.5), skew=1.0, draft_skew=1.5,
                 eplb=EplbSettings(True, interval=20, window=10, redundant=0))
    m = tiny_model()
    sim = Simulation(m, gpu(), profile(), lay, fixed(256, 64))
    res = sim.run(41)
    tgt, dft = res.balancedness["target"], res.balancedness["draft"]
    assert [s for s, _ in tgt] == [0, 20, 40] == [s for s, _ in dft]
    assert sim.target.experts == m.experts and sim.draft.experts == m.draft_experts
    assert tgt[-1][1] > tgt[0][1] and dft[-1][1] > dft[0][1]


def test_eplb_off_keeps_identity_and_bad_slot_count_is_an_error():
    st = EplbState(zipf_shares(2, 16, 1.0), 4, EplbSettings(False))
    for step in range(5000):
        st.after_step(step, 100)
    assert st.rebalances == 0
    with pytest.raises(ValueError, match="multiple of the DEP size"):
        EplbState(zipf_shares(2, 16, 1.0), 4, EplbSettings(True, redundant=3))
