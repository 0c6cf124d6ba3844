"""P/D in the simulator with a calibrated (measured) profile: the measured prefill table, the
NIXL link, per-KV-load admission cost, TTFT from the admitting decode step, finite benchmark
runs; plus the calibrate/sweep flags of `wideserve simulate` (docs/simulator.md)."""
from __future__ import annotations

import argparse
import itertools

import pytest

from wideserve.sim.eplb import eplb_schedule
from wideserve.sim.hardware import Profile
from wideserve.sim.pd import PDSettings, admission_s, shared_host_factor, transfer_s
from wideserve.sim.simulator import Layout, Simulation
from wideserve.sim.workload import SimRequest, fixed

from sim_helpers import profile, tiny_model

PREFILL = {"tokens": [100.0, 200.0], "s": [0.05, 0.10]}
NIXL = {"per_transfer_s": 1e-3, "bytes_per_s": 1e9}


def _measured(admission: dict | None = None) -> Profile:
    p = profile()
    p.ops = {"dense_forward": {"tokens": [1.0, 8.0], "s": [0.01, 0.01]},
             "expert": {"rows": [1], "s": [0.0]}}
    p.pd = {"prefill": PREFILL, "nixl": NIXL, **({"admission": admission} if admission else {})}
    return p


def _bench(prof: Profile, n: int, batch: int, cap: int | None = None):
    lay = Layout(dep=1, batch=batch, overlap_host=False, jitter=False,
                 pd=PDSettings(prefill_instances=1, prefill_ranks=1, transfer="push",
                               max_kv_loads_per_step=cap))
    hw = prof.as_hardware()
    sim = Simulation(tiny_model(), hw, prof, lay, itertools.islice(fixed(200, 5), n),
                     steady=False)
    return sim, sim.run_to_end(), hw


def test_profile_round_trip_keeps_pd_and_uses_nixl_as_the_kv_link():
    prof = _measured({"tokens": [100.0], "s": [0.002]})
    back = Profile.from_dict(prof.to_dict())
    assert back.pd == prof.pd
    hw = back.as_hardware()
    assert (hw.nic_bytes_per_s, hw.nic_latency_s) == (1e9, 1e-3)
    # measured per-transfer time already holds the software overhead: no 20 us added
    m = tiny_model()
    pd = PDSettings(transfer="push", caches=4)
    assert transfer_s(m, hw, pd, 200) == pytest.approx(4 * 1e-3 + (200 * m.kv_bytes_per_token
                                                                   + m.kv_bounded_bytes) / 1e9)


def test_benchmark_run_finishes_every_request_and_ttft_includes_prefill_and_transfer():
    sim, r, hw = _bench(_measured(), n=6, batch=2)
    assert len(sim.finished) == 6 and not sim.pending and not any(sim.running)
    assert sum(x.done_tokens for x in sim.finished) == pytest.approx(6 * 5)
    floor = 0.10 + transfer_s(sim.m, hw, sim.lay.pd, 200)     # the measured 200-token prefill
    assert r.ttft_p50_s >= floor
    # the first two prompts queue on one prefill instance: the second waits for the first
    first_two = sorted(x.first for x in sim.finished if x.arrival == 0.0)
    assert len(first_two) == 2 and first_two[1] >= 2 * 0.10


def test_prefill_batches_a_burst_within_the_token_budget():
    prof = _measured()
    for budget, expect in ((0, [0.10, 0.20]), (400, [0.20, 0.20]), (300, [0.10, 0.20])):
        lay = Layout(dep=1, batch=2, overlap_host=False, jitter=False,
                     pd=PDSettings(prefill_instances=1, prefill_ranks=1,
                                   prefill_batch_tokens=budget))
        sim = Simulation(tiny_model(), prof.as_hardware(), prof, lay,
                         itertools.islice(fixed(200, 5), 2), steady=False)
        # FIFO: 0.10 then 0.20; batched (400 tokens fit): both end with the 400-token batch,
        # whose measured cost is the table at 400 tokens (0.20, extrapolated)
        assert sorted(x.ready for x in sim.pending) == pytest.approx(expect)


def test_kv_load_starts_at_admission_and_the_request_decodes_from_the_next_step():
    """The engine admits a KV load in one step's schedule, transfers during that step and
    decodes the request from the next step on (disagg/connector.py): the first token comes
    one whole decode step later than it would if the admitting step decoded it."""
    sim = Simulation(tiny_model(), _measured().as_hardware(), _measured(), Layout(
        dep=1, batch=1, overlap_host=False, jitter=False,
        pd=PDSettings(prefill_instances=1, prefill_ranks=1)),
        itertools.islice(fixed(200, 5), 1), steady=False)
    (req,) = sim.pending
    link = transfer_s(sim.m, sim.hw, sim.lay.pd, 200)
    assert req.ready == pytest.approx(0.10)          # reached decode when its prefill ended
    sim.now = req.ready
    sim.step(0)                                      # admits it: transfer starts, no token
    assert req.first is None and sim.loading == [req]
    assert req.loaded == pytest.approx(0.10 + link)
    admitted_step_end = sim.now
    sim.now = max(sim.now, req.loaded)
    sim.step(1)                                      # its first decode step
    assert req.first == pytest.approx(sim.now) and req.first > admitted_step_end


def test_admission_cost_is_measured_per_load_and_the_cap_spreads_it():
    adm = {"tokens": [100.0, 300.0], "s": [0.01, 0.03]}
    prof = _measured(adm)
    assert admission_s(prof, prof.as_hardware(), 200) == pytest.approx(0.02)
    assert admission_s(profile(), prof.as_hardware(), 200) == 0.0     # not measured: free
    free = _bench(_measured(), n=8, batch=4)[1]
    paid = _bench(prof, n=8, batch=4)[1]
    assert paid.seconds > free.seconds
    sim = Simulation(tiny_model(), prof.as_hardware(), prof, Layout(
        dep=1, batch=4, overlap_host=False, jitter=False,
        pd=PDSettings(prefill_instances=1, prefill_ranks=1, max_kv_loads_per_step=1)),
        itertools.islice(fixed(200, 5), 4), steady=False)
    sim.now = 10.0                      # every KV has arrived: the cap admits one per step
    assert sim._admit() == [pytest.approx(0.02)] and len(sim.pending) == 3
    assert len(sim.loading) == 1


def test_eplb_schedule_fits_the_run_and_warns_when_it_cannot():
    interval, window, warn = eplb_schedule(200, None, None)
    assert interval < 200 and 0 < window <= interval and warn is None
    assert "never rebalances" in eplb_schedule(200, 3000, 1000)[2]
    with pytest.raises(ValueError, match="--eplb-window"):
        eplb_schedule(200, 10, 20)


def test_calibrate_rank_counts_flag():
    from wideserve.entrypoints import simulate
    ap = argparse.ArgumentParser()
    simulate.add_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["simulate", "calibrate", "--ranks", "2", "4", "--pd", "--out", "x"])
    assert args.ranks == [2, 4] and args.pd
    bad = ap.parse_args(
        ["simulate", "calibrate", "--ranks", "1", "--out", "x"])
    assert simulate.run(bad) == 2          # a clear error naming --ranks, before measuring


SERVING = {"batch": [1.0, 4.0], "s": [0.02, 0.05], "loop_s": [0.01, 0.02]}


def test_serving_table_splits_the_served_step_into_loop_and_contention():
    from wideserve.sim.calibrate_pd import serving_table
    inproc = [{"batch": 1.0, "host": 0.01, "forward": 0.09},
              {"batch": 4.0, "host": 0.02, "forward": 0.18}]
    served = [{"batch": 4.0, "period": 0.26, "engine": 0.23},
              {"batch": 1.0, "period": 0.13, "engine": 0.11}]
    t = serving_table(inproc, served)
    assert t["batch"] == [1.0, 4.0]
    assert t["s"] == pytest.approx([0.03, 0.06])        # period - in-process step
    assert t["loop_s"] == pytest.approx([0.02, 0.03])   # period - served engine step
    assert t["inprocess_s"] == pytest.approx([0.10, 0.20])
    # a served run faster than in-process (noise) adds nothing rather than a negative cost
    assert serving_table(inproc[:1], [{"batch": 1.0, "period": 0.05, "engine": 0.06}])["s"] \
        == [0.0]
    with pytest.raises(ValueError, match="batch 2"):
        serving_table(inproc, [{"batch": 2.0, "period": 0.1, "engine": 0.1}])


def test_a_served_step_pays_the_serving_loop_measured_beside_it():
    from wideserve.sim.hardware import load_hardware
    from wideserve.sim.step import StepInputs, StepModel
    prof = _measured()
    prof.host["serving"] = SERVING
    for hw in (prof.as_hardware(), load_hardware("gb200")):
        charged = 0.01 + 0.01 / 3                   # loop_s at B=2, not s
        sm = StepModel(tiny_model(), hw, prof)
        plain = sm.step(StepInputs(1, [2], [100.0], overlap_host=False))
        served = sm.step(StepInputs(1, [2], [100.0], overlap_host=False, served=True))
        assert served.step_s - plain.step_s == pytest.approx(charged)   # the table at B=2
        assert served.parts["serving"] == pytest.approx(charged)
        assert plain.parts["serving"] == 0.0
    # the P/D benchmark: slower output and a later first token behind servers
    runs, first = {}, {}
    for served in (False, True):
        lay = Layout(dep=1, batch=2, overlap_host=False, jitter=False, served=served,
                     pd=PDSettings(prefill_instances=1, prefill_ranks=1))
        sim = Simulation(tiny_model(), prof.as_hardware(), prof, lay,
                         itertools.islice(fixed(200, 5), 4), steady=False)
        runs[served] = sim.run_to_end()
        # the first request (nothing queued ahead of it): its prefill batch and its decode
        # steps each pay the loop
        first[served] = min(x.first - x.arrival for x in sim.finished)
    assert runs[True].seconds > runs[False].seconds
    assert first[True] > first[False]
    assert runs[True].breakdown_ms["serving"] > 0


def test_shared_host_factor_is_the_fair_share_of_the_cores():
    # 2 cores, calibrated beside 2 polling agents (3 runnable): one more compute thread
    # takes the engine from 2/3 of a core to 1/2
    assert shared_host_factor(2, 3, 1) == pytest.approx(4 / 3)
    assert shared_host_factor(2, 1, 1) == 1.0        # a core to spare: no slow-down
    assert shared_host_factor(4, 3, 1) == 1.0
    assert shared_host_factor(0, 3, 1) == 1.0        # instances on their own hosts
    assert shared_host_factor(2, 3, 0) == 1.0
    assert shared_host_factor(2, 3, 2) > shared_host_factor(2, 3, 1)


def _shared_run(host_cores: int, resident: int):
    prof = _measured()
    prof.pd["resident_threads"] = resident
    lay = Layout(dep=1, batch=2, overlap_host=False, jitter=False, served=False,
                 pd=PDSettings(prefill_instances=1, prefill_ranks=1, host_cores=host_cores))
    # unequal outputs, so that requests finish (and new prompts prefill) while others decode
    work = iter([SimRequest(200, n) for n in (3, 9, 4, 8, 5, 7)])
    sim = Simulation(tiny_model(), prof.as_hardware(), prof, lay, work, steady=False)
    return sim, sim.run_to_end()


def test_a_prefill_beside_a_computing_decode_rank_takes_the_shared_time():
    from wideserve.sim.simulator import _Req
    for cores, busy, want in ((2, False, 0.10), (2, True, 4 / 3 * 0.10), (0, True, 0.10)):
        prof = _measured()
        prof.pd["resident_threads"] = 3
        lay = Layout(dep=1, batch=1, overlap_host=False, jitter=False, served=False,
                     pd=PDSettings(prefill_instances=1, prefill_ranks=1, host_cores=cores))
        sim = Simulation(tiny_model(), prof.as_hardware(), prof, lay, iter(()), steady=False)
        if busy:
            sim.running[0].append(_Req(0, 5.0, 200.0, arrival=0.0))
        sim._prefill(_Req(0, 5.0, 200.0, arrival=0.0), 200, 0)
        span = sim.prefill_spans[-1]
        assert span["end"] - span["start"] == pytest.approx(want)


def test_instances_sharing_a_host_slow_each_other_by_the_fair_share():
    _, own = _shared_run(0, 3)
    sim, shared = _shared_run(2, 3)
    assert own.breakdown_ms["shared_host"] == 0.0
    # decode steps that overlap a prefill are stretched, and prefills that start while the
    # decode rank computes take 4/3 of their measured time
    assert shared.breakdown_ms["shared_host"] > 0
    assert shared.seconds > own.seconds and shared.ttft_p50_s > own.ttft_p50_s
    assert len(sim.finished) == 6
    # with a core to spare (no resident agents on 2 cores) sharing costs nothing
    _, spare = _shared_run(2, 1)
    assert spare.seconds == pytest.approx(own.seconds)
    assert spare.breakdown_ms["shared_host"] == pytest.approx(0.0, abs=1e-9)


def test_calibrate_serving_needs_a_model_with_a_tokenizer(tmp_path):
    from wideserve.entrypoints import simulate
    ap = argparse.ArgumentParser()
    simulate.add_parser(ap.add_subparsers(dest="cmd"))
    assert simulate.run(ap.parse_args(["simulate", "calibrate", "--serving", "--out",
                                       str(tmp_path / "p.json")])) == 2
    (tmp_path / "config.json").write_text("{}")
    assert simulate.run(ap.parse_args(["simulate", "calibrate", "--serving", "--model",
                                       str(tmp_path), "--out", str(tmp_path / "p.json")])) == 2
    assert not (tmp_path / "p.json").exists()


def test_pd_host_cores_flag_reaches_the_layout_and_refuses_a_negative_count():
    from wideserve.entrypoints import simulate
    ap = argparse.ArgumentParser()
    simulate.add_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["simulate", "run", "m", "--profile", "p", "--pd-host-cores", "2"])
    assert simulate._base(args).pd.host_cores == 2
    bad = ap.parse_args(["simulate", "run", "m", "--profile", "p", "--pd-host-cores", "-1"])
    with pytest.raises(ValueError, match="--pd-host-cores"):
        simulate._base(bad)


def _first_and_seconds(prof: Profile, pd_instances: int) -> tuple[float, float]:
    lay = Layout(dep=1, batch=2, overlap_host=False, jitter=False, served=True,
                 pd=PDSettings(prefill_instances=pd_instances, prefill_ranks=1))
    sim = Simulation(tiny_model(), prof.as_hardware(), prof, lay,
                     itertools.islice(fixed(200, 5), 4), steady=False)
    r = sim.run_to_end()
    return min(x.first - x.arrival for x in sim.finished), r.seconds, r.ttft_p50_s


def test_a_served_request_pays_its_latency_outside_the_steps_once_per_server_leg():
    plain, latent = _measured(), _measured()
    plain.host["serving"] = SERVING
    latent.host["serving"] = {**SERVING, "request_s": 0.004}
    # P/D: the prefill leg's answer reaches the router, then the decode leg the decode
    # engine: the first request (nothing ahead of it) is admitted 2 latencies later
    f0, s0, _ = _first_and_seconds(plain, 1)
    f1, s1, _ = _first_and_seconds(latent, 1)
    assert f1 - f0 == pytest.approx(2 * 0.004)
    assert s1 > s0              # each request's decode starts later: the run is longer
    # colocated: one server, one latency, outside the engine's steps (the run's steps and
    # length unchanged; its TTFT one latency longer)
    _, c0, t0 = _first_and_seconds(plain, 0)
    _, c1, t1 = _first_and_seconds(latent, 0)
    assert c1 == pytest.approx(c0) and t1 - t0 == pytest.approx(0.004)
    # a profile without the measurement (older calibrations) charges nothing
    from wideserve.sim.step import StepModel
    assert StepModel(tiny_model(), plain.as_hardware(), plain).request_s() == 0.0


def test_calibrate_temperature_flag_refuses_a_value_outside_the_api_range(tmp_path, capsys):
    from wideserve.entrypoints import simulate
    ap = argparse.ArgumentParser()
    simulate.add_parser(ap.add_subparsers(dest="cmd"))
    assert simulate.run(ap.parse_args(["simulate", "calibrate", "--temperature", "2.5",
                                       "--out", str(tmp_path / "p.json")])) == 2
    assert "--temperature" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
