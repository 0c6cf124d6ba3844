"""The kernel choice (wideserve/kernels/choice.py): the measured-fastest candidate per bucket
(fake timings injected, nothing timed for real), the one-layout preference, pruning, the disk
cache and its key, the WIDESERVE_GEMM override, and the experts threshold."""
from __future__ import annotations

import json
import time
from typing import Callable

import pytest
import torch

from wideserve.kernels import candidates as cand
from wideserve.kernels import choice as ch
from wideserve.kernels.choice import BUCKETS, KernelChoice, KernelPolicy


class FakeTimer:
    """Seconds per (kernel, rows) from a table (a list per SAMPLE_ROWS, or a function of the
    rows); records every call."""

    def __init__(self, seconds: dict[str, list[float] | Callable[[int], float]]) -> None:
        self.seconds = seconds
        self.calls: list[tuple] = []

    def __call__(self, family: str, kernels: tuple[str, ...], shape: tuple[int, ...],
                 rows: int) -> dict[str, float]:
        self.calls.extend((family, c, *shape, rows) for c in kernels)
        return {c: self._at(self.seconds[c], rows) for c in kernels}

    @staticmethod
    def _at(times, rows: int) -> float:
        return times(rows) if callable(times) else times[ch.SAMPLE_ROWS.index(rows)]


ALL = ("micro", "brgemm", "onednn", "torch")


@pytest.fixture
def runnable_all(monkeypatch):
    """Every candidate runnable, whatever this CPU has (the choice logic is under test)."""
    monkeypatch.setattr(KernelChoice, "runnable",
                        lambda self, family, dtype: ch.FAMILY_KERNELS[family])


def _choice(tmp_path, timer, **policy) -> KernelChoice:
    return KernelChoice(KernelPolicy(cache_dir=tmp_path, **policy), timer=timer)


def test_bucket_of_matches_the_bucket_bounds() -> None:
    for i, (lo, hi) in enumerate(BUCKETS):
        assert ch.bucket_of(lo) == i
        if hi is not None:
            assert ch.bucket_of(hi) == i and ch.bucket_of(hi + 1) == i + 1
    assert ch.bucket_of(0) == 0 and ch.bucket_of(10 ** 6) == len(BUCKETS) - 1
    assert [ch.bucket_label(i) for i in range(len(BUCKETS))] == \
        ["1", "2-4", "5-16", "17-64", "65-256", ">256"]


def test_plan_picks_the_measured_fastest_per_bucket(tmp_path, runnable_all) -> None:
    # micro wins small M, brgemm the middle, onednn the top bucket by more than 10%
    timer = FakeTimer({"micro": [1, 2, 9, 40, 400, 900],
                       "brgemm": [3, 3, 4, 10, 30, 100],
                       "onednn": [5, 5, 6, 12, 33, 50],
                       "torch": [9, 9, 9, 20, 60, 120]})
    plan = _choice(tmp_path, timer).plan("linear", 96, 64, torch.bfloat16)
    assert plan == ("micro", "micro", "brgemm", "brgemm", "brgemm", "onednn")


def test_one_layout_is_kept_where_it_is_within_tolerance(tmp_path, runnable_all) -> None:
    # onednn is fastest at the top bucket, but brgemm (the micro-kernel's layout) is within
    # the default 5% there: one packed copy serves every bucket
    timer = FakeTimer({"micro": [1, 2, 9, 40, 400, 900],
                       "brgemm": [3, 3, 4, 10, 30, 52],
                       "onednn": [5, 5, 6, 12, 33, 50],
                       "torch": [9, 9, 9, 20, 60, 120]})
    plan = _choice(tmp_path, timer).plan("linear", 96, 64, torch.bfloat16)
    assert plan == ("micro", "micro", "brgemm", "brgemm", "brgemm", "brgemm")
    tight = _choice(tmp_path / "t", timer, share_tolerance=0.01).plan(
        "linear", 96, 64, torch.bfloat16)
    assert tight[-1] == "onednn"


def test_choose_directly() -> None:
    times = [{"micro": 1.0, "onednn": 2.0}, {"micro": 5.0, "onednn": 1.0}]
    assert ch.choose(times, 0.1) == ["micro", "onednn"]
    # within 100%: oneDNN's layout serves both (2x at the first), micro's does not (5x)
    assert ch.choose(times, 1.0) == ["onednn", "onednn"]
    assert ch.choose([{"micro": None, "torch": 3.0}], 0.1) == ["torch"]


def test_slow_candidates_are_pruned_from_larger_buckets(tmp_path, runnable_all) -> None:
    timer = FakeTimer({"micro": [1, 2, 50, 400, 4000, 9000],
                       "brgemm": [2, 3, 4, 10, 30, 50],
                       "onednn": [5, 5, 6, 12, 33, 50], "torch": [9, 9, 9, 20, 60, 120]})
    kc = _choice(tmp_path, timer)
    kc.plan("linear", 96, 64, torch.bfloat16)
    micro_rows = [c[4] for c in timer.calls if c[1] == "micro"]
    assert micro_rows == [1, 4, 16]       # 12.5x brgemm at 16 rows: never timed above
    row = kc.table()[0]
    assert row["buckets"][3]["times_us"]["micro"] is None
    assert row["buckets"][3]["times_us"]["brgemm"] == pytest.approx(10e6)


def test_cache_second_start_times_nothing(tmp_path, runnable_all) -> None:
    seconds = {k: [1.0 + i] * 6 for i, k in enumerate(ALL)}
    first = FakeTimer(seconds)
    plan = _choice(tmp_path, first).plan("qkv", 96, 64, torch.bfloat16)
    assert first.calls and plan == ("micro",) * 6
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    body = json.loads(files[0].read_text())
    assert body["key"]["threads"] == torch.get_num_threads()
    assert body["key"]["torch"] == torch.__version__ and "cpu" in body["key"]
    second = FakeTimer(seconds)
    assert _choice(tmp_path, second).plan("qkv", 96, 64, torch.bfloat16) == plan
    assert second.calls == []
    # another shape or family is timed once, then cached as well
    _choice(tmp_path, second).plan("linear", 96, 64, torch.bfloat16)
    assert {c[0] for c in second.calls} == {"linear"}


def test_cache_is_keyed_by_thread_count(tmp_path, runnable_all) -> None:
    seconds = {k: [1.0 + i] * 6 for i, k in enumerate(ALL)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _choice(tmp_path, FakeTimer(seconds)).plan("linear", 32, 32, torch.bfloat16)
        torch.set_num_threads(2)
        timer = FakeTimer(seconds)
        _choice(tmp_path, timer).plan("linear", 32, 32, torch.bfloat16)
        assert timer.calls                   # a table per thread count
        assert len(list(tmp_path.glob("*.json"))) == 2
    finally:
        torch.set_num_threads(threads)


def test_machine_key_changes_the_file(tmp_path, runnable_all, monkeypatch) -> None:
    seconds = {k: [1.0 + i] * 6 for i, k in enumerate(ALL)}
    _choice(tmp_path, FakeTimer(seconds)).plan("linear", 32, 32, torch.bfloat16)
    real = ch.machine_key
    monkeypatch.setattr(ch, "machine_key", lambda: {**real(), "cpu": "another CPU"})
    timer = FakeTimer(seconds)
    _choice(tmp_path, timer).plan("linear", 32, 32, torch.bfloat16)
    assert timer.calls and len(list(tmp_path.glob("*.json"))) == 2


def test_unreadable_cache_is_re_timed(tmp_path, runnable_all) -> None:
    seconds = {k: [1.0 + i] * 6 for i, k in enumerate(ALL)}
    _choice(tmp_path, FakeTimer(seconds)).plan("linear", 32, 32, torch.bfloat16)
    next(tmp_path.glob("*.json")).write_text("{not json")
    timer = FakeTimer(seconds)
    assert _choice(tmp_path, timer).plan("linear", 32, 32, torch.bfloat16) == ("micro",) * 6
    assert timer.calls


def test_force_overrides_and_env(tmp_path, runnable_all, monkeypatch) -> None:
    timer = FakeTimer({k: [1.0] * 6 for k in ALL})
    kc = _choice(tmp_path, timer, force="onednn")
    assert kc.plan("linear", 32, 32, torch.bfloat16) == ("onednn",) * 6
    assert kc.plan("experts", 32, 32, torch.bfloat16) == ("micro",) * 6   # not a candidate
    assert timer.calls == []
    monkeypatch.setenv(ch.ENV_FORCE, "brgemm")
    assert KernelPolicy.from_env().force == "brgemm"
    monkeypatch.setenv(ch.ENV_FORCE, "fastest")
    with pytest.raises(ValueError, match="WIDESERVE_GEMM"):
        KernelPolicy.from_env()


def test_allowed_limits_the_candidates(tmp_path, runnable_all) -> None:
    timer = FakeTimer({"micro": [1.0] * 6, "brgemm": [0.5] * 6, "onednn": [2.0] * 6,
                       "torch": [3.0] * 6})
    plan = _choice(tmp_path, timer).plan("linear", 32, 32, torch.bfloat16,
                                         allowed=("onednn", "torch"))
    assert plan == ("onednn",) * 6
    assert {c[1] for c in timer.calls} == {"onednn", "torch"}


def test_fp32_is_plain_torch(tmp_path) -> None:
    kc = _choice(tmp_path, FakeTimer({}))
    assert kc.plan("linear", 32, 32, torch.float32) == ("torch",) * 6
    assert kc.plan("experts", 32, 32, torch.float32) == ("",) * 6
    # fp32 inputs: the quantised experts' op has no brgemm for them, nothing is timed
    assert kc.brgemm_from("quant_experts", 32, 32, torch.float32, extra=(1, 1, 32, 1)) is None


def test_brgemm_min_rows() -> None:
    assert ch.brgemm_min_rows(("micro",) * 6) is None
    assert ch.brgemm_min_rows(("brgemm",) * 6) == 1
    assert ch.brgemm_min_rows(("micro", "micro", "brgemm", "brgemm", "brgemm", "brgemm")) == 5
    # a non-monotonic plan: brgemm from the last bucket where it holds to the top
    assert ch.brgemm_min_rows(("micro", "brgemm", "micro", "brgemm", "brgemm", "brgemm")) == 17


# micro 10 + r, brgemm 15 + r / 2 (us): brgemm is faster from 11 rows on
CROSSING = {"micro": lambda r: (10 + r) * 1e-6, "brgemm": lambda r: (15 + r / 2) * 1e-6}


@pytest.mark.parametrize("family", ["experts", "quant_experts"])
def test_expert_threshold_is_narrowed_inside_the_crossover_bucket(tmp_path, runnable_all,
                                                                  family) -> None:
    # the buckets say brgemm from 5 rows (timed at 16); three timings inside 5-16 find 11
    timer = FakeTimer(CROSSING)
    kc = _choice(tmp_path, timer)
    extra = (1, 1, 32, 1) if family == "quant_experts" else ()
    assert kc.plan(family, 64, 32, torch.bfloat16, extra=extra) == \
        ("micro", "micro") + ("brgemm",) * 4
    assert kc.brgemm_from(family, 64, 32, torch.bfloat16, extra=extra) == 11
    inside = sorted({c[-1] for c in timer.calls} - set(ch.SAMPLE_ROWS))
    assert inside == [10, 11, 13]
    assert all(c[2:-1] == (64, 32) + extra for c in timer.calls)
    assert "[brgemm from 11 rows]" in "".join(kc.describe())
    assert "[brgemm from 11 rows]" in "".join(kc.summary())
    # a second start reads the threshold and its timings from the disk table
    again = _choice(tmp_path, FakeTimer({}))
    assert again.brgemm_from(family, 64, 32, torch.bfloat16, extra=extra) == 11
    assert sorted(again.table()[0]["crossover_us"]) == [10, 11, 13]
    # another format of the same (I, d) is a shape of its own
    if extra:
        other = _choice(tmp_path, timer)
        assert other.brgemm_from(family, 64, 32, torch.bfloat16, extra=(0, 128, 128, 4)) == 11
        assert len(other.table()) == 2


def test_expert_threshold_in_a_wide_bucket_is_narrowed_to_the_resolution(tmp_path,
                                                                         runnable_all) -> None:
    # micro 10 + r, brgemm 45 + r / 2 (us): brgemm is faster from 71 rows on, inside the
    # 65-256 bucket. Three fixed timings (160, 112, 88) stopped at 88; the bisection goes on
    # until at most a sixteenth of the lower rows are left: 76, 70, 73 -> 73.
    timer = FakeTimer({"micro": lambda r: (10 + r) * 1e-6,
                       "brgemm": lambda r: (45 + r / 2) * 1e-6})
    kc = _choice(tmp_path, timer)
    assert kc.plan("experts", 64, 32, torch.bfloat16) == ("micro",) * 4 + ("brgemm",) * 2
    assert kc.brgemm_from("experts", 64, 32, torch.bfloat16) == 73
    inside = [c[-1] for c in timer.calls if c[-1] not in ch.SAMPLE_ROWS and c[1] == "brgemm"]
    assert list(dict.fromkeys(inside)) == [160, 112, 88, 76, 70, 73]   # close calls re-timed
    # a coarser resolution stops earlier; the step cap bounds the timings whatever it is
    coarse = FakeTimer(timer.seconds)
    assert _choice(tmp_path / "c", coarse, crossover_resolution=1 / 8) \
        .brgemm_from("experts", 64, 32, torch.bfloat16) == 76
    capped = FakeTimer(timer.seconds)
    assert _choice(tmp_path / "s", capped, crossover_steps=3) \
        .brgemm_from("experts", 64, 32, torch.bfloat16) == 88


def test_expert_threshold_without_a_crossover(tmp_path, runnable_all) -> None:
    never = FakeTimer({"micro": [1e-6] * 6, "brgemm": [2e-6] * 6})
    assert _choice(tmp_path / "n", never).brgemm_from("experts", 8, 8, torch.bfloat16) is None
    always = FakeTimer({"micro": [2e-6] * 6, "brgemm": [1e-6] * 6})
    assert _choice(tmp_path / "a", always).brgemm_from("experts", 8, 8, torch.bfloat16) == 1
    assert not [c for c in always.calls + never.calls if c[-1] not in ch.SAMPLE_ROWS]
    # forced, and the batch-invariant mode's one kernel: nothing timed inside a bucket
    for force, want in (("micro", None), ("brgemm", 1)):
        kc = _choice(tmp_path / force, FakeTimer({}), force=force)
        assert kc.brgemm_from("quant_experts", 8, 8, torch.bfloat16, extra=(1, 1, 32, 1)) \
            == want
    invariant = _choice(tmp_path / "i", FakeTimer(CROSSING))     # brgemm's summed ratio wins
    assert invariant.brgemm_from("experts", 8, 8, torch.bfloat16, invariant=True) == 1


def test_describe_lists_every_bucket(tmp_path, runnable_all) -> None:
    timer = FakeTimer({"micro": [1e-6, 2e-6, 9e-6, 4e-5, 4e-4, 9e-4],
                       "brgemm": [3e-6, 3e-6, 4e-6, 1e-5, 3e-5, 5e-5],
                       "onednn": [5e-6] * 6, "torch": [9e-6] * 6})
    kc = _choice(tmp_path, timer)
    kc.plan("linear", 96, 64, torch.bfloat16)
    lines = kc.describe()
    assert "96x64" in lines[1] and "1: micro 1/3" in lines[1] and ">256: onednn" in lines[1]


def test_plan_attention_from_timings(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(KernelChoice, "runnable",
                        lambda self, family, dtype: ch.FAMILY_KERNELS[family])
    monkeypatch.setattr(ch.sdpa_context, "flash_compiled", lambda: True)
    timer = FakeTimer({"own": [1, 2, 8, 30, 200, 800], "sdpa": [3, 3, 5, 10, 50, 150],
                       "flash": [4, 4, 6, 8, 30, 100]})
    kc = _choice(tmp_path, timer)
    want = ("own",) * 2 + ("sdpa",) + ("flash",) * 3
    assert kc.plan_attention(16, 4, 64, torch.bfloat16) == want
    assert {c[2:5] for c in timer.calls} == {(16, 4, 64)}
    assert _choice(tmp_path, FakeTimer({})).plan_attention(16, 4, 64, torch.bfloat16) == \
        want                                          # cached
    # heads the flash kernel does not take (not a multiple of 32): never timed nor picked
    assert kc.plan_attention(16, 4, 48, torch.bfloat16) == ("own",) * 2 + ("sdpa",) * 4
    assert not [c for c in timer.calls if c[2:5] == (16, 4, 48) and c[1] == "flash"]
    forced = _choice(tmp_path / "f", FakeTimer({}), force="micro")
    assert forced.plan_attention(16, 4, 64, torch.bfloat16) == ("own",) * 6


def test_real_candidates_run_on_tiny_shapes() -> None:
    """Every runnable candidate of every family builds and runs (what the timer calls)."""
    from wideserve.kernels import loader
    loader.build()
    kc = KernelChoice(KernelPolicy(cache_dir=None))
    quant = [("quant_experts", cand.quant_shape(48, 64, fmt, block, scale_bytes))
             for fmt, block, scale_bytes in ((0, (16, 32), 1), (0, (16, 32), 4), (1, (1, 32), 1),
                                             (2, (1, 16), 1))]
    for family, shape in [("linear", (40, 32)), ("qkv", (40, 32)), ("router", (8, 32)),
                          ("experts", (24, 32)), ("attention", (4, 2, 32)),
                          ("attention_ctx", (4, 2, 32))] + quant:
        for kernel in kc.runnable(family, torch.bfloat16):
            for rows in (1, 5):
                ch.candidate(family, kernel, shape, rows)()


def test_near_ties_are_timed_again(tmp_path, runnable_all) -> None:
    """Two candidates within the tolerance are re-timed together, and the better of both
    timings decides (here the second timing reverses the first)."""
    class Flip(FakeTimer):
        def __call__(self, family, kernels, shape, rows):
            got = super().__call__(family, kernels, shape, rows)
            if len(kernels) == 2 and rows == 256:           # the re-timing
                return {"brgemm": 40, "onednn": 20}
            return got
    timer = Flip({"micro": [1, 2, 9, 40, 400, 900], "brgemm": [3, 3, 4, 10, 30, 60],
                  "onednn": [5, 5, 6, 12, 32, 50], "torch": [9, 9, 9, 20, 60, 120]})
    kc = _choice(tmp_path, timer, share_tolerance=0.1)
    plan = kc.plan("linear", 96, 64, torch.bfloat16)
    assert [c for c in timer.calls if c[4] == 256][-2:] == [
        ("linear", "brgemm", 96, 64, 256), ("linear", "onednn", 96, 64, 256)]
    assert plan[4] == "onednn" and plan[5] == "onednn"


def test_summary_merges_buckets_and_shows_the_chosen_times(tmp_path, runnable_all) -> None:
    timer = FakeTimer({"micro": [1e-6, 2e-6, 9e-6, 40e-6, 400e-6, 900e-6],
                       "brgemm": [3e-6, 3e-6, 4e-6, 10e-6, 30e-6, 100e-6],
                       "onednn": [5e-6, 5e-6, 6e-6, 12e-6, 33e-6, 50e-6],
                       "torch": [9e-6, 9e-6, 9e-6, 20e-6, 60e-6, 120e-6]})
    kc = _choice(tmp_path, timer)
    kc.plan("linear", 96, 64, torch.bfloat16)
    kc.plan("qkv", 32, 64, torch.bfloat16)
    lines = kc.summary({("linear", "96x64")}, threads=torch.get_num_threads())
    assert lines[0].startswith("GEMM kernel per token bucket (")
    assert len(lines) == 2 and lines[1].split() == [
        "linear", "96x64", "micro", "1-4,", "brgemm", "5-256,", "onednn", "257+",
        "(1", "2", "4", "10", "30", "50", "us)"]
    assert len(kc.summary(threads=torch.get_num_threads())) == 3      # every shape measured
    assert kc.summary({("router", "8x64")}, threads=torch.get_num_threads()) == [
        f"GEMM kernel choice: no shape measured at {torch.get_num_threads()} threads"]
    forced = KernelChoice(KernelPolicy(force="micro", cache_dir=None))
    assert forced.summary() == ["GEMM kernel micro for every family and token count "
                                "(WIDESERVE_GEMM=micro; nothing measured)"]


def test_a_lone_outlier_timing_decides_nothing(tmp_path, runnable_all) -> None:
    """A close call is timed `rechecks` more times and each kernel's median timing decides:
    one lucky first timing of brgemm (10 against 11) is outvoted by two later ones (14)."""
    class Lucky(FakeTimer):
        def __call__(self, family, kernels, shape, rows):
            got = super().__call__(family, kernels, shape, rows)
            if rows == 64 and len(kernels) == 2:              # the re-timings
                return {"brgemm": 14, "onednn": 11}
            return got
    timer = Lucky({"micro": [1, 2, 9, 400, 4000, 9000], "brgemm": [3, 3, 4, 10, 30, 60],
                   "onednn": [5, 5, 6, 11, 40, 80], "torch": [9, 9, 9, 20, 60, 120]})
    kc = _choice(tmp_path, timer, share_tolerance=0.0)
    plan = kc.plan("linear", 96, 64, torch.bfloat16)
    assert plan[3] == "onednn"
    assert [c[1] for c in timer.calls if c[4] == 64] == \
        ["micro", "brgemm", "onednn", "torch"] + ["brgemm", "onednn"] * 2
    assert kc.table()[0]["buckets"][3]["times_us"]["brgemm"] == pytest.approx(14e6)


def test_clear_winners_are_timed_once(tmp_path, runnable_all) -> None:
    timer = FakeTimer({"micro": [1, 2, 9, 40, 400, 900], "brgemm": [3, 3, 4, 10, 30, 60],
                       "onednn": [5, 5, 6, 14, 40, 80], "torch": [9, 9, 9, 20, 60, 120]})
    _choice(tmp_path, timer).plan("linear", 96, 64, torch.bfloat16)
    for rows in ch.SAMPLE_ROWS:                      # nothing within 15% of the fastest
        kernels = [c[1] for c in timer.calls if c[4] == rows]
        assert len(kernels) == len(set(kernels)), (rows, kernels)


def test_time_interleaved_rotates_the_order() -> None:
    order: list[str] = []
    fns = {c: (lambda c=c: order.append(c)) for c in "abc"}
    samples = ch.time_interleaved(fns, min_reps=3, max_reps=3, min_time_s=0.0, clock="wall")
    assert order[:3] == ["a", "b", "c"]                      # the warm-up calls
    assert order[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {c: len(v) for c, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    # min_time_s is never reached by no-op calls: max_reps bounds the rounds
    capped = ch.time_interleaved(fns, min_reps=2, max_reps=7, min_time_s=60.0, clock="wall")
    assert {len(v) for v in capped.values()} == {7}


def test_clock_is_cpu_time_at_one_thread(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert ch.clock_of("auto") is time.thread_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert ch.clock_of("auto") is time.perf_counter
    assert ch.clock_of("cpu") is time.thread_time
    with pytest.raises(ValueError, match="clock"):
        KernelPolicy(clock="tsc", cache_dir=None)


def test_plan_attention_with_context_is_its_own_family(tmp_path, monkeypatch) -> None:
    """A chunk after a context is timed as family attention_ctx (own entry, own plan)."""
    monkeypatch.setattr(KernelChoice, "runnable", lambda self, family, dtype: ("own", "sdpa"))
    timer = FakeTimer({"own": [1, 2, 8, 30, 200, 800], "sdpa": [3, 3, 5, 10, 50, 150]})
    kc = _choice(tmp_path, timer)
    ctx = kc.plan_attention(16, 4, 64, torch.bfloat16, context=True)
    assert ctx == ("own", "own", "sdpa", "sdpa", "sdpa", "sdpa")
    assert {c[0] for c in timer.calls} == {"attention_ctx"}
    assert [r["family"] for r in kc.table()] == ["attention_ctx"]


def test_decode_rows_are_timed_on_weights_read_from_memory(monkeypatch):
    # a decode step reads every weight from memory: the candidates of buckets up to
    # COLD_ROWS rotate through copies that together exceed twice the last-level cache
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 8 << 20)
    assert cand.cold_copies(2 << 20, 1) == 8 and cand.cold_copies(2 << 20, cand.COLD_ROWS) == 8
    assert cand.cold_copies(2 << 20, cand.COLD_ROWS + 1) == 1           # prefill rows: warm
    assert cand.cold_copies(3 << 20, 16) == 6                           # rounded up
    assert cand.cold_copies(64 << 20, 16) == 1
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 1 << 30)
    assert cand.cold_copies(1 << 20, 1) == cand.COLD_BYTES >> 20           # capped
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 0)       # none reported
    assert cand.cold_copies(1 << 20, 1) == cand.COLD_BYTES >> 20
    # a tiny weight: no more copies than a bucket's timing ever reads (each timed call
    # still reads one that no call before it touched: none is read twice)
    assert cand.cold_copies(512, 1) == cand.COLD_MAX_COPIES
    assert KernelPolicy().max_reps + 1 <= cand.COLD_MAX_COPIES
    seen = []
    run = cand._rotating(["a", "b", "c"], seen.append)
    for _ in range(7):
        run()
    assert seen == ["b", "c", "a", "b", "c", "a", "b"]


def test_cold_buckets_are_timed_after_the_caches_are_cleared(monkeypatch):
    # the copies are built (written, so cached) first, then twice the last-level cache is
    # overwritten: the decode-sized buckets only
    events = []
    monkeypatch.setattr(ch, "candidate", lambda family, c, shape, rows, pools=None:
                        (events.append(("build", rows)), lambda: events.append(("call", rows)))[1])
    monkeypatch.setattr(ch, "evict_caches", lambda: events.append(("evict", None)))
    kc = ch.KernelChoice(KernelPolicy(cache_dir=None, min_reps=1, max_reps=1, min_time_s=0))
    kc._time("linear", ("micro", "torch"), (8, 8), 1)
    assert events[:3] == [("build", 1), ("build", 1), ("evict", None)]
    assert [e for e in events if e[0] == "call"] == [("call", 1)] * 4   # warm + one round
    events.clear()
    kc._time("linear", ("micro", "torch"), (8, 8), cand.COLD_ROWS + 1)
    assert ("evict", None) not in events
    events.clear()
    kc._time("attention", ("own", "sdpa"), (2, 1, 8), 16)
    assert ("evict", None) not in events


def test_a_shapes_buckets_share_their_weight_copies(monkeypatch):
    # one shape's buckets and re-timings read the same copies, built once per kernel
    seen = []
    monkeypatch.setattr(ch, "candidate", lambda family, c, shape, rows, pools=None:
                        (seen.append(pools), lambda: None)[1])
    # no pruning: two no-op candidates can time 4x apart on a loaded machine, and a pruned
    # candidate is not built at the larger buckets
    kc = ch.KernelChoice(KernelPolicy(cache_dir=None, min_reps=1, max_reps=1, min_time_s=0,
                                      prune_ratio=float("inf")))
    kc._measure("linear", (8, 8), ("micro", "torch"))
    assert len(seen) >= 2 * len(ch.SAMPLE_ROWS) and seen[0] is not None
    assert all(p is seen[0] for p in seen) and kc._pools is None
    built = []
    real = cand._linear_pool
    monkeypatch.setattr(cand, "_linear_pool", lambda *a: (built.append(a), real(*a))[1])
    pools = cand.Pools()
    for rows in (1, 4, cand.COLD_ROWS + 1):
        for kernel in ("torch", "torch"):
            cand.candidate("linear", kernel, (32, 64), rows, pools)()
    assert [a[-1] for a in built] == [cand.cold_copies(32 * 64 * 2, 1), 1]   # cold, warm


def test_evict_caches_writes_twice_the_last_level_cache(monkeypatch):
    sizes = []
    monkeypatch.setattr(cand.torch, "ones", lambda n, dtype: sizes.append(n * 4))
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 8 << 20)
    cand.evict_caches()
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 1 << 30)
    cand.evict_caches()
    assert sizes == [16 << 20, cand.COLD_BYTES]


@pytest.mark.parametrize("family,kernel", [("linear", "torch"), ("linear", "micro"),
                                           ("linear", "brgemm"), ("linear", "onednn"),
                                           ("experts", "micro"), ("experts", "brgemm")])
def test_cold_candidates_compute_what_a_warm_one_does(monkeypatch, family, kernel):
    cands = ch.KernelChoice(KernelPolicy(cache_dir=None)).runnable(family, torch.bfloat16)
    if kernel not in cands:
        pytest.skip(f"{kernel} does not run here")
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 1 << 20)
    cold = cand.candidate(family, kernel, (40, 64), 3)
    monkeypatch.setattr(cand, "COLD_ROWS", 0)
    warm = cand.candidate(family, kernel, (40, 64), 3)
    outs = [cold() for _ in range(3)]
    assert all(torch.equal(o, warm()) for o in outs)


@pytest.mark.parametrize("kernel", ["micro", "brgemm"])
@pytest.mark.parametrize("fmt,block,scale_bytes", [(0, (16, 32), 1), (0, (16, 32), 4),
                                                   (1, (1, 32), 1), (2, (1, 16), 1)])
def test_cold_quant_experts_candidates_compute_what_a_warm_one_does(monkeypatch, kernel, fmt,
                                                                    block, scale_bytes):
    if kernel not in ch.KernelChoice(KernelPolicy(cache_dir=None)).runnable(
            "quant_experts", torch.bfloat16):
        pytest.skip(f"{kernel} does not run here")
    shape = cand.quant_shape(48, 64, fmt, block, scale_bytes)
    monkeypatch.setattr(cand, "last_level_cache_bytes", lambda: 1 << 16)
    cold = cand.candidate("quant_experts", kernel, shape, 3)
    monkeypatch.setattr(cand, "COLD_ROWS", 0)
    warm = cand.candidate("quant_experts", kernel, shape, 3)
    outs = [cold() for _ in range(3)]
    assert all(torch.equal(o, warm()) for o in outs)
    assert outs[0].shape == (3, 64) and torch.isfinite(outs[0]).any()
