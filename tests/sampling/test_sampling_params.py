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


# --- one declaration: each parameter's flag and server field come from its field ----------------

import dataclasses  # noqa: E402

import click  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from refengine.cli_options import build_params, flag_fields, sampling_options  # noqa: E402
from refengine.sampling_params import ApiField, Flag, check_number, sampling_field  # noqa: E402

# Today's surface, so that a flag or a server field cannot disappear unnoticed.
FLAGS = ["temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
         "ignore_eos", "logprobs"]
SERVER_FIELDS = ["n", *FLAGS[:-1], "logprobs", "skip_special_tokens", "logit_bias", "allowed_token_ids",
                 "bad_words", "structured_outputs"]


def api_fields(params_class=SamplingParams) -> list[str]:
    return [f.name for f in dataclasses.fields(params_class) if f.metadata.get("api")]


def parse_flags(args: list[str], params_class=SamplingParams):
    """``params_class`` from a command that has only the sampling flags, given ``args``."""
    got = {}

    def probe(**kw):
        got["params"] = build_params(kw, params_class)

    command = click.command()(sampling_options(probe, params_class))
    res = CliRunner().invoke(command, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return got["params"], command


def test_every_declared_flag_is_a_flag_of_generate_and_chat():
    from refengine.cli import chat, generate

    assert [f.name for f in flag_fields()] == FLAGS
    for command in (generate, chat):
        options = {p.name: p for p in command.params}
        for name in FLAGS:
            assert options[name].opts == ["--" + name.replace("_", "-")], (command.name, name)
    params, _ = parse_flags([])  # the CLI's defaults: the field's, or the flag's where it has its own
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (256, 0.0, 1.0, None)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.logprobs) == (None, [], False, None)
    params, _ = parse_flags(["--stop", "a", "--stop", "b", "--stop-token-ids", "2,13", "--ignore-eos",
                             "--top-k", "5", "--min-p", "0.25"])
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.top_k, params.min_p) == (
        ["a", "b"], [2, 13], True, 5, 0.25)


# A request's JSON value of each server field -> the SamplingParams value it becomes.
SERVER_VALUES = {
    "n": (2, 2), "temperature": (0.5, 0.5), "top_k": (3, 3), "top_p": (0.9, 0.9), "min_p": (0.1, 0.1),
    "seed": (7, 7), "presence_penalty": (0.5, 0.5), "frequency_penalty": (-0.5, -0.5),
    "repetition_penalty": (1.2, 1.2), "min_tokens": (2, 2), "stop": (["##"], ["##"]),
    "stop_token_ids": ([5, 5, 6], [5, 6]), "include_stop_str_in_output": (True, True), "ignore_eos": (True, True),
    "skip_special_tokens": (False, False), "logit_bias": ({"5": 1.5}, {5: 1.5}),
    "allowed_token_ids": ([1, 2], [1, 2]), "bad_words": (["no"], ["no"]),
}


def test_every_declared_server_field_is_a_request_field_and_reaches_the_params():
    pytest.importorskip("pydantic")
    from refengine.server.protocol import PER_ENDPOINT_FIELDS, ChatCompletionRequest, CompletionRequest

    assert api_fields() == SERVER_FIELDS
    for request in (CompletionRequest, ChatCompletionRequest):
        assert set(SERVER_FIELDS) <= set(request.model_fields), request.__name__
    # every field read back generically has a value here (structured_outputs: below)
    assert set(SERVER_VALUES) == set(SERVER_FIELDS) - set(PER_ENDPOINT_FIELDS) - {"structured_outputs"}
    body = {name: json for name, (json, _) in SERVER_VALUES.items()}
    for request in (CompletionRequest(prompt="hi", **body),
                    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)):
        params = request.sampling_params(max_tokens=9, logprobs=1)
        for name, (_, want) in SERVER_VALUES.items():
            assert getattr(params, name) == want, (type(request).__name__, name)
        assert (params.max_tokens, params.logprobs) == (9, 1)


@dataclasses.dataclass
class WithTypicalP(SamplingParams):
    """``SamplingParams`` and one more declared parameter (any name would do)."""

    # the annotation as text, as refengine's modules have it (from __future__ import annotations)
    typical_p: "float" = sampling_field(1.0, check_number(lambda p: 0.0 < p <= 1.0, "in (0, 1]"),
                                        flag=Flag("keep the typical tokens whose probabilities sum to this"),
                                        api=ApiField("float"))


def test_a_parameter_added_to_the_declaration_reaches_the_cli_and_the_server():
    """The declaration is all a new parameter needs to get its flag and its request field;
    how the request's fields come back as params is checked field by field above."""
    params, command = parse_flags(["--typical-p", "0.5", "--top-k", "3"], WithTypicalP)
    assert (params.typical_p, params.top_k) == (0.5, 3)
    assert "--typical-p" in CliRunner().invoke(command, ["--help"]).output
    assert parse_flags([], WithTypicalP)[0].typical_p == 1.0
    with pytest.raises(ValueError, match=r"^SamplingParams\.typical_p=2\.0 is invalid: must be in \(0, 1\]$"):
        parse_flags(["--typical-p", "2"], WithTypicalP)

    pydantic = pytest.importorskip("pydantic")
    from refengine.server import protocol

    for endpoint in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        request = pydantic.create_model("Request", __base__=endpoint, __module__=protocol.__name__,
                                        **protocol.sampling_fields(WithTypicalP))
        assert set(request.model_fields) == set(endpoint.model_fields) | {"typical_p"}
        assert request.model_validate({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                                       "typical_p": 0.5}).typical_p == 0.5
