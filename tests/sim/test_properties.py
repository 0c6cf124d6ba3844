"""Conservation and monotonicity of the simulator's model (docs/simulator.md)."""
from __future__ import annotations

import numpy as np
import pytest

from wideserve.sim.costs import allreduce_s, alltoall_s, interp
from wideserve.sim.pd import PDSettings, kv_bytes, transfer_s
from wideserve.sim.simulator import Layout, Simulation
from wideserve.sim.step import StepInputs, StepModel
from wideserve.sim.workload import fixed

from sim_helpers import gpu, profile, tiny_model


def _step(hw, ranks=4, reqs=16, ctx=4096.0, k=0, rows=None, overlap=True):
    sm = StepModel(tiny_model(), hw, profile())
    return sm.step(StepInputs(ranks, [reqs] * ranks, [ctx] * ranks, k, rank_rows=rows,
                              overlap_host=overlap))


@pytest.mark.parametrize("field", ["mem_bytes_per_s", "scaleup_bytes_per_s", "nic_bytes_per_s"])
def test_more_bandwidth_never_slower(field):
    for ranks in (1, 2, 8, 128):
        for overlap in (True, False):
            slow = _step(gpu(), ranks, overlap=overlap).step_s
            fast = _step(gpu(**{field: 2.0}), ranks, overlap=overlap).step_s
            assert fast <= slow + 1e-15
    m = tiny_model()
    for ctx in (1, 1000, 100_000):
        for mode in ("pull", "push"):
            pd = PDSettings(transfer=mode)
            assert transfer_s(m, gpu(nic_bytes_per_s=2.0), pd, ctx) <= transfer_s(m, gpu(), pd, ctx)


def test_more_ranks_never_more_weight_bytes_per_rank():
    m = tiny_model()
    sm = StepModel(m, gpu(), profile())
    prev = np.inf
    for ranks in (1, 2, 4, 8, 16, 32):
        b = sm.weight_bytes_per_rank(ranks, total_rows=64 * 8 * m.top_k)
        assert b <= prev
        prev = b


def test_lockstep_step_at_least_every_rank_own_time():
    rng = np.random.default_rng(1)
    sm = StepModel(tiny_model(), gpu(), profile())
    for overlap in (True, False):
        for _ in range(20):
            ranks = int(rng.integers(2, 9))
            reqs = rng.integers(0, 64, ranks).tolist()
            rows = rng.random((8, ranks)) * 500
            st = sm.step(StepInputs(ranks, reqs, (rng.random(ranks) * 1e5).tolist(), 0,
                                    rank_rows=rows, overlap_host=overlap,
                                    jitter=(rng.random(ranks) * 1e-3).tolist()))
            assert st.step_s >= max(st.per_rank_s) - 1e-15


def test_skewed_rank_sets_the_step():
    even = np.full((8, 4), 1e5)          # compute-bound expert GEMMs: rows matter
    skew = even.copy()
    skew[:, 0] *= 3
    # in series (the host does not hide the device): the overloaded rank sets the step
    assert _step(gpu(), rows=skew, overlap=False).step_s > \
        _step(gpu(), rows=even, overlap=False).step_s


def test_collectives():
    assert allreduce_s(1, 16, 1e-5, 1e9, "ring") == 0.0 == alltoall_s(1, 1e6, 1e-5, 1e9)
    for n in (4, 8, 32):     # a tiny message: latency-bound, recursive doubling wins
        assert allreduce_s(n, 16, 1e-5, 1e9, "rd") < allreduce_s(n, 16, 1e-5, 1e9, "ring")
    assert allreduce_s(32, 16, 1e-5, 1e9, "ring") > allreduce_s(16, 16, 1e-5, 1e9, "ring")
    with pytest.raises(ValueError, match="ring or rd"):
        allreduce_s(4, 16, 1e-5, 1e9, "tree")


def test_interp_through_points():
    assert interp([1, 4, 8], [1.0, 2.0, 4.0], 4) == 2.0
    assert interp([1, 4, 8], [1.0, 2.0, 4.0], 6) == 3.0
    assert interp([1, 4, 8], [1.0, 2.0, 4.0], 16) == 8.0


def test_kv_bytes_and_packed_push():
    m = tiny_model()
    assert kv_bytes(m, 1000) == 1000 * 300 + 100_000
    pull = transfer_s(m, gpu(), PDSettings(transfer="pull"), 100_000)
    push = transfer_s(m, gpu(), PDSettings(transfer="push"), 100_000)
    assert push < pull


def test_simulation_conserves_users_and_tokens():
    lay = Layout(dep=2, batch=4, mtp_k=1, acceptance=(0.5,),
                 pd=PDSettings(prefill_instances=1, prefill_ranks=2))
    sim = Simulation(tiny_model(), gpu(), profile([0.0, 1e-4]), lay, fixed(512, 16))
    for i in range(60):
        sim.step(i)
        users = sum(len(r) for r in sim.running) + len(sim.pending) + len(sim.loading)
        assert users == lay.dep * lay.batch          # closed loop: one request per user
    res = sim._result(60, {"step": sim.now})
    assert res.tok_s_per_gpu > 0 and res.ttft_p50_s is not None
    assert lay.tokens_per_step() == 1.5


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="input-len"):
        next(fixed(0, 4))
    with pytest.raises(ValueError, match="pull or push"):
        transfer_s(tiny_model(), gpu(), PDSettings(transfer="carrier pigeon"), 10)
    lay = Layout(dep=1, batch=1)
    with pytest.raises(ValueError, match="steps"):
        Simulation(tiny_model(), gpu(), profile(), lay, fixed(8, 4)).run(0)


def test_host_noise_from_samples():
    from wideserve.sim.noise import HostNoise
    samples = [1e-3] * 98 + [5e-3, 9e-3]           # two interrupted runs of a 1 ms task
    n = HostNoise(samples)
    assert n.rate == pytest.approx(2 / sum(samples))
    assert sorted(n.delays.tolist()) == pytest.approx([4e-3, 8e-3])
    rng = np.random.default_rng(0)
    assert n.lockstep_wait(12, 1e-3, 1, rng) == 0.0          # a lone rank waits for no one
    waits = [n.lockstep_wait(200, 10e-3, r, rng) for r in (2, 8)]
    assert 0 < waits[0] < waits[1]                           # more ranks, longer waits
    assert HostNoise([1e-3] * 10).lockstep_wait(12, 1.0, 4, rng) == 0.0   # no interruptions


def test_the_report_reads_the_weight_bytes_of_its_layout():
    """`simulate run` prints the weight bytes a rank reads per step (StepModel's expectation
    for every rank's rows of one step, drafts included); more ranks print no more."""
    from wideserve.sim.report import describe
    m, printed = tiny_model(), []
    for dep in (1, 4):
        lay = Layout(dep=dep, batch=8, mtp_k=1, acceptance=(0.5,))
        res = Simulation(m, gpu(), profile(), lay, fixed(64, 8)).run(20)
        line = next(x for x in describe(res, m, gpu(), profile())
                    if "weights read per rank per step" in x)
        want = StepModel(m, gpu(), profile()).weight_bytes_per_rank(dep, dep * 8 * 2 * m.top_k)
        assert f"{want / 1e9:,.2f} GB" in line
        printed.append(want)
    assert printed[1] <= printed[0]


def test_measured_meetings_set_the_lockstep_wait():
    """On a calibrated machine each exchange of the forward (3 per MoE layer + 1 per step,
    layers/ep_dispatch.py) costs the measured meeting time at the step's host work between
    exchanges, less the all-to-all latency already booked; ranks without a table at that
    count fall back to the noise model; one rank never waits."""
    prof = profile()
    prof.ops = {"dense_forward": {"tokens": [1.0, 64.0], "s": [0.02, 0.02]},
                "expert": {"rows": [1.0, 64.0], "s": [1e-4, 1e-4]}}
    prof.collectives["meeting"] = {"2": {"segment_cpu_s": [1e-4, 1e-2], "s": [1e-3, 2e-3]}}
    prof.host["cpu_share"] = 0.5        # the forward's wall time, half of it on the CPU
    sm = StepModel(tiny_model(), prof.as_hardware(), prof)
    m = sm.m
    points = 3 * m.moe_layers + 1
    rows = np.zeros((m.moe_layers, 2))
    expert = sm.experts_s(rows, m.experts / 2, m.expert_params_each(), m.expert_format)
    seg = 0.5 * (0.02 + float(expert.max())) / points
    meet = interp([1e-4, 1e-2], [1e-3, 2e-3], seg)
    st = sm.step(StepInputs(2, [4, 4], [64.0, 64.0], rank_rows=rows, overlap_host=False,
                            noise=True))
    assert st.parts["lockstep_wait"] == pytest.approx(points * meet
                                                      - 3 * m.moe_layers * 1e-5)
    one = sm.step(StepInputs(1, [4], [64.0], overlap_host=False, noise=True))
    assert one.parts["lockstep_wait"] == 0.0
    four = sm.step(StepInputs(4, [4] * 4, [64.0] * 4, overlap_host=False, noise=True))
    assert four.parts["lockstep_wait"] == 0.0      # no table at 4 ranks, noise-free profile


def test_drawn_acceptance_keeps_the_mean_and_a_batch_waits_for_its_unluckiest_request():
    """Drawn per request and step, the accepted length averages the profile's expectation,
    but a finite batch run to the end emits fewer tokens per step than that mean: it lasts
    as long as its slowest request, and its last steps run part-filled."""
    acc = (0.8, 0.7, 0.7)
    prof = profile()
    mean = Layout(mtp_k=3, acceptance=acc).tokens_per_step()
    per_step, draws = [], []
    for seed in range(20):
        lay = Layout(dep=1, batch=8, mtp_k=3, acceptance=acc, jitter=False,
                     draw_acceptance=True)
        sim = Simulation(tiny_model(), gpu(), prof, lay,
                         iter([next(fixed(8, 33)) for _ in range(8)]), seed=seed,
                         steady=False)
        draws += [sim._draw_tokens() for _ in range(200)]
        r = sim.run_to_end()
        assert len(sim.finished) == 8
        assert sum(x.done_tokens for x in sim.finished) == pytest.approx(8 * 33)
        per_step.append((8 * 33 - 8) / (r.steps - 1) / 8)       # decode steps, per request
    assert np.mean(draws) == pytest.approx(mean, rel=0.05)
    assert np.mean(per_step) < 0.95 * mean


def _ep_profile():
    prof = profile()
    prof.ops = {"dense_forward": {"tokens": [1.0, 64.0], "s": [0.02, 0.04]},
                "expert": {"rows": [1.0, 64.0], "s": [1e-4, 3e-4]}}
    prof.host["cpu_share"] = 0.5
    prof.collectives["ep_layer"] = {"2": {
        "tokens": [1.0, 8.0], "layer_s": [3e-3, 5e-3], "a2a_s": [2e-3, 3e-3],
        "expert_s": [5e-4, 1.5e-3], "step_s": [7e-4, 9e-4]}}
    return prof


def test_measured_ep_layer_sets_the_moe_layers_of_a_dep_step():
    """With the EP layer measured at n ranks (calibrate_ep.py) every MoE layer of a DEP step
    costs the table at the busiest rank's tokens, split into the grouped MLP, the exchanges
    and the dispatcher's own work, plus the step header once; the dense part is the one-rank
    table in CPU seconds; no rank count without a table uses it; one rank never does."""
    prof = _ep_profile()
    sm = StepModel(tiny_model(), prof.as_hardware(), prof)
    L = sm.m.moe_layers
    st = sm.step(StepInputs(2, [4, 8], [64.0, 64.0], overlap_host=False, noise=True))
    p = st.parts
    assert p["moe"] == pytest.approx(L * 1.5e-3)
    assert p["all_to_all"] == pytest.approx(L * 3e-3)
    assert p["ep_dispatch"] == pytest.approx(L * (5e-3 - 3e-3 - 1.5e-3))
    assert p["ep_step"] == pytest.approx(9e-4)
    assert p["lockstep_wait"] == 0.0
    assert p["dense"] == pytest.approx(0.5 * interp([1.0, 64.0], [0.02, 0.04], 8))
    assert st.step_s >= max(st.per_rank_s) - 1e-15       # lock-step: never below a rank
    small = sm.step(StepInputs(2, [1, 1], [64.0, 64.0], overlap_host=False, noise=True))
    assert small.step_s < st.step_s                       # fewer tokens per rank: cheaper
    four = sm.step(StepInputs(4, [4] * 4, [64.0] * 4, overlap_host=False, noise=True))
    assert "ep_dispatch" not in four.parts                 # no table at 4 ranks
    one = sm.step(StepInputs(1, [4], [64.0], overlap_host=False, noise=True))
    assert "ep_dispatch" not in one.parts


def test_measured_ep_layer_scales_the_busiest_ranks_experts_with_skew():
    """Skewed routing (EPLB off) loads one rank's experts more: its grouped MLP scales by its
    expert time over the uniform routing's, and the lock-step step follows the busiest."""
    prof = _ep_profile()
    sm = StepModel(tiny_model(), prof.as_hardware(), prof)
    L = sm.m.moe_layers
    even = sm.step(StepInputs(2, [8, 8], [64.0] * 2, rank_rows=np.full((L, 2), 32.0),
                              overlap_host=False, noise=True))
    skew = sm.step(StepInputs(2, [8, 8], [64.0] * 2,
                              rank_rows=np.tile([[56.0, 8.0]], (L, 1)),
                              overlap_host=False, noise=True))
    assert even.parts["moe"] == pytest.approx(L * 1.5e-3)
    assert skew.parts["moe"] > even.parts["moe"]
    assert skew.step_s > even.step_s
