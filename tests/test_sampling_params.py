"""SamplingParams validation: every bad value raises ValueError naming its field."""
from __future__ import annotations

import pytest

from wideserve.types.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

BAD = [
    ("temperature", -1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "0.5"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1),
    ("seed", 1.0), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("n", 0), ("n", MAX_N + 1),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", 2.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("frequency_penalty", "1"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("stop", 5), ("stop", [""]), ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["1"]),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize("name, value", BAD)
def test_bad_value_names_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        SamplingParams(**{name: value})


def test_message_shows_the_value():
    with pytest.raises(ValueError, match=r"temperature must be >= 0 and finite, got -1"):
        SamplingParams(temperature=-1)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)      # no limit: any min_tokens is fine


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.is_greedy and not p.has_penalties
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bcd")).stop == ["a", "bcd"]
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[7, 9])
    assert p.all_stop_token_ids({1, 2}) == {1, 2, 7, 9}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids({1}) == {7}
    assert SamplingParams().all_stop_token_ids(None) == set()
