"""SamplingParams: vLLM defaults, normalisation, and one clear error per bad field."""

import math

import numpy as np
import pytest

from refengine.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop_strings == ["a", "bc"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_boundary_values_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, top_k=-1)
    SamplingParams(temperature=1e-6, top_p=1e-9, min_p=0.0, top_k=1)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3)
    SamplingParams(max_tokens=1, min_tokens=0, logprobs=0, seed=0)
    SamplingParams(max_tokens=None, min_tokens=5)
    # numpy scalars are numbers too
    SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), seed=np.int64(3))


@pytest.mark.parametrize("field, value, expected_range", [
    ("n", 0, "an integer >= 1"),
    ("n", True, "an integer >= 1"),
    ("temperature", -0.1, "a finite number >= 0"),
    ("temperature", math.nan, "a finite number >= 0"),
    ("temperature", math.inf, "a finite number >= 0"),
    ("top_k", -2, "-1, 0 (off) or a positive integer"),
    ("top_k", 2.5, "-1, 0 (off) or a positive integer"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.01, "in (0, 1]"),
    ("top_p", math.nan, "a number"),
    ("min_p", -0.01, "in [0, 1]"),
    ("min_p", 1.5, "in [0, 1]"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("frequency_penalty", -2.01, "in [-2, 2]"),
    ("repetition_penalty", 0.0, "finite and > 0"),
    ("repetition_penalty", math.inf, "finite and > 0"),
    ("max_tokens", -1, "None or an integer >= 1"),
    ("max_tokens", 0, "None or an integer >= 1"),
    ("min_tokens", -1, "an integer >= 0"),
    ("logprobs", -1, "None or an integer >= 0"),
    ("seed", 1.5, "None or an integer"),
    ("stop", "", "a non-empty string or a list of non-empty strings"),
    ("stop", ["ok", 3], "a non-empty string or a list of non-empty strings"),
    ("stop_token_ids", [1, -1], "a list of integers >= 0"),
])
def test_bad_field_names_field_value_and_range(field, value, expected_range):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert f"SamplingParams.{field}=" in msg
    assert repr(value) in msg
    assert expected_range in msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens=5 .*<= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
