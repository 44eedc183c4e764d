"""Every public entry point through a table of bad values (issue 11): every EngineArgs option,
every SamplingParams field, add_request's arguments. Each is a ValueError whose message
names the field and what is allowed, raised before anything is allocated or queued.
(The model directory's files: tests/formats/test_bad_model_files.py; the CLI: tests/cli/test_cli_errors.py.)"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from refengine import SamplingParams
from refengine.core.engine import LLMEngine
from refengine.engine_args import EngineArgs

NAN, INF = math.nan, math.inf


# --- EngineArgs: every option --------------------------------------------------------------

def bad_engine_values(fld: dataclasses.Field) -> list:
    """Values of the wrong type, bool for int, negative, zero, NaN, inf, empty and the wrong
    container, as far as each is wrong for this field's type."""
    kind = str(fld.type).split("|")[0].strip()
    optional = "None" in str(fld.type)
    if kind == "int":
        values = [True, "8", 1.5, NAN, INF, [8], -1]
        values += [0] if fld.metadata["minimum"] == 1 else []
    elif kind == "float":
        values = [True, "0.5", NAN, INF, -INF, [0.5], -0.5, 0.0]
    elif kind == "bool":
        values = ["yes", 1, 0.0, [True]] + ([] if optional else [None])
    elif kind == "dict":
        values = [1, "{}", ["ngram"], True]
    else:  # str: a choice or a path
        values = [1, "", ["cpu"], b"cpu"] + (["tpu"] if fld.metadata["choices"] else [])
        values += [] if optional else [None]
    return values


ENGINE_CASES = [(f.name, v) for f in dataclasses.fields(EngineArgs) for v in bad_engine_values(f)]


def test_every_engine_option_is_in_the_table():
    assert {name for name, _ in ENGINE_CASES} == {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("name, value", ENGINE_CASES, ids=lambda x: repr(x)[:20])
def test_bad_engine_option(tiny_llama_dir, nothing_allocated, name, value):
    kwargs = {name: value} if name != "model" else {}
    model = value if name == "model" else tiny_llama_dir
    with pytest.raises(ValueError) as e:
        LLMEngine(model, **kwargs)
    message = str(e.value)
    # the option, the value, and what is allowed
    assert message.startswith(f"{name}={value!r} "), message
    assert re.search(r"is invalid: must be (an integer|a finite number|True or False|a non-empty str|a dict"
                     r"|one of '\w+')|is not one of '\w+', '", message), message


# Values of the right type that no engine can run with: refused from the model's sizes,
# still before the weights are read or the pool allocated.
HUGE_ENGINE_CASES = [
    ({"block_size": 10**12}, r"kv_cache_memory=2147483648 bytes holds no KV block"),
    ({"max_model_len": 10**12}, r"max_model_len=1000000000000 exceeds the model's context"),
    ({"num_kv_blocks": 10**12}, r"num_kv_blocks=1000000000000 makes a KV pool of .* GiB .* more than this "
                                r"machine's .* GiB of memory"),
    ({"kv_cache_memory": 10**18}, r"kv_cache_memory=1000000000000000000 makes a KV pool"),
    ({"kv_cache_memory": 1}, r"kv_cache_memory=1 bytes holds no KV block: one block of block_size=16 tokens"),
    ({"max_model_len": 300, "num_kv_blocks": 4}, r"max_model_len=300 exceeds the model's context "
                                                 r"\(max_position_embeddings=256 in config.json\)"),
    ({"max_model_len": 100, "num_kv_blocks": 4}, r"max_model_len=100 needs 7 KV blocks but the pool holds 4"),
    ({"device": "cpu", "dtype": "float16"}, r"dtype='float16' is not supported on the CPU"),
]


@pytest.mark.parametrize("kwargs, message", HUGE_ENGINE_CASES)
def test_engine_options_that_cannot_work(tiny_llama_dir, nothing_allocated, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_llama_dir, **kwargs)


# --- SamplingParams: every field --------------------------------------------------------------

WRONG_TYPES_INT = [True, "1", 1.5, NAN, INF, [1], None]
WRONG_TYPES_FLOAT = [True, "0.5", NAN, [0.5], None]
SAMPLING_CASES = {
    "n": WRONG_TYPES_INT + [0, -1],
    "temperature": WRONG_TYPES_FLOAT + [-0.5, INF, -INF],
    "top_k": WRONG_TYPES_INT + [-2],
    "top_p": WRONG_TYPES_FLOAT + [0.0, -0.5, 1.5, INF, 1e308],
    "min_p": WRONG_TYPES_FLOAT + [-0.5, 1.5, INF, 1e308],
    "seed": [True, "1", 1.5, NAN, INF, [1], -1, 2**64],
    "presence_penalty": WRONG_TYPES_FLOAT + [-2.5, 2.5, INF, -INF, 1e308],
    "frequency_penalty": WRONG_TYPES_FLOAT + [-2.5, 2.5, INF, -INF, 1e308],
    "repetition_penalty": WRONG_TYPES_FLOAT + [0.0, -1.0, INF],
    "max_tokens": [True, "1", 1.5, NAN, INF, [1], 0, -1],
    "min_tokens": WRONG_TYPES_INT + [-1, 17],  # 17 > the default max_tokens, 16
    "stop": [123, 1.5, True, b"x", {"x"}, {"x": 1}, "", [""], ["ok", 3], [None], "a\udce9", ["\ud800"]],
    "stop_token_ids": [5, "5", 1.5, {5}, {5: 1}, b"\x05", [True], [1.5], [-1], ["5"], [None]],
    "include_stop_str_in_output": ["yes", 1, None, [True]],
    "ignore_eos": ["yes", 1, None, [True]],
    "logprobs": [True, "1", 1.5, NAN, INF, [1], -1],
    "skip_special_tokens": ["yes", 0, None, [False]],
    "prompt_logprobs": [True, "1", 1.5, NAN, INF, [1], -1],
    "output_kind": ["delta", 1, None, True],
    "logit_bias": [[1], "x", {-1: 1.0}, {"5": 1.0}, {True: 1.0}, {5: 101}, {5: -100.5}, {5: NAN}, {5: INF},
                   {5: "1"}, {i: 0.0 for i in range(301)}],
    "allowed_token_ids": [[], 5, "5", {5}, [-1], [1.5], [True], ["5"], [None]],
    "bad_words": ["word", 5, [""], ["  "], [5], [None], {"word"}],
    "structured_outputs": [{"json": {}}, "json", 5],
}


def test_every_sampling_field_is_in_the_table():
    fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert set(SAMPLING_CASES) == fields


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in SAMPLING_CASES.items() for v in vs],
                         ids=lambda x: repr(x)[:20])
def test_bad_sampling_field(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    message = str(e.value)
    if isinstance(value, str) and re.search(r"[\ud800-\udfff]", value) or value == ["\ud800"]:
        assert re.match(r"SamplingParams.stop='.*' is not valid Unicode: lone surrogate U\+D[89A-F]\w\w "
                        r"at position \d", message), message
    else:
        assert message.startswith(f"SamplingParams.{name}="), message
        assert " is invalid: must be " in message, message


def test_a_lone_surrogate_names_the_byte():
    with pytest.raises(ValueError, match=r"SamplingParams.stop='caf\\udce9' is not valid Unicode: lone surrogate U\+DCE9 at "
                                         r"position 3: the byte 0xE9 is not UTF-8"):
        SamplingParams(stop="caf\udce9")


def test_good_values_of_the_same_kinds_are_accepted():
    """The table's edges from the good side: the checks refuse only what is wrong."""
    p = SamplingParams(seed=2**64 - 1, stop=("a", "b"), stop_token_ids=(5, np.int64(6)), top_p=1e-300,
                       temperature=1e300, ignore_eos=np.bool_(True), logprobs=0, n=2)
    assert p.stop_strings == ["a", "b"] and p.stop_token_ids == [5, 6] and type(p.stop_token_ids[1]) is int
    EngineArgs(max_num_seqs=np.int64(4), gpu_memory_utilization=np.float32(0.5), kv_cache_memory=2**20,
               enable_chunked_prefill=np.bool_(False), max_logprobs=0)


# --- add_request: every argument -------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_llama_tok_dir) -> LLMEngine:
    return LLMEngine(tiny_llama_tok_dir, block_size=4, num_kv_blocks=12, max_model_len=40, max_num_seqs=4,
                     max_logprobs=5, log_stats=False)


def nothing_queued(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return (not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
            and bm.num_free_blocks == bm.num_blocks)


GOOD = SamplingParams(max_tokens=2, temperature=0.0)
ADD_REQUEST_CASES = [
    # (request_id, prompt, params, arrival_time, message)
    ("r", b"hello", GOOD, None, r"a prompt must be a string or a list of token ids, got bytes \(decode it first"),
    ("r", bytearray(b"hi"), GOOD, None, r"got bytearray"),
    ("r", {5, 6}, GOOD, None, r"a prompt must be a string or a list of token ids, got set"),
    ("r", {5: 6}, GOOD, None, r"got dict"),
    ("r", 5, GOOD, None, r"got int"),
    ("r", None, GOOD, None, r"got NoneType"),
    ("r", iter([5, 6]), GOOD, None, r"got list_iterator"),
    ("r", np.array([[5, 6]]), GOOD, None, r"got ndarray"),
    ("r", [[5, 6]], GOOD, None, r"prompt token ids must be integers, got \[5, 6\] \(list\)"),
    ("r", [5, 1.5], GOOD, None, r"prompt token ids must be integers, got 1.5 \(float\)"),
    ("r", [5, True], GOOD, None, r"prompt token ids must be integers, got True \(bool\)"),
    ("r", np.array([5.0, 6.0]), GOOD, None, r"prompt token ids must be integers, got 5.0"),
    ("r", [], GOOD, None, r"the prompt is empty"),
    ("r", "", GOOD, None, r"the prompt is empty"),
    ("r", [-1], GOOD, None, r"prompt token id -1 is outside the vocabulary \[0, 211\)"),
    ("r", [211], GOOD, None, r"prompt token id 211 is outside the vocabulary \[0, 211\)"),
    ("r", [5] * 40, GOOD, None, r"the prompt has 40 tokens but max_model_len is 40"),
    ("r", "x" * 10**5, GOOD, None, r"the prompt has 100000 tokens but max_model_len is 40"),
    ("r", "caf\udce9", GOOD, None, r"the prompt is not valid Unicode: lone surrogate U\+DCE9 at position 3: "
                                   r"the byte 0xE9 is not UTF-8"),
    ("r", "ok \ud83d", GOOD, None, r"the prompt is not valid Unicode: lone surrogate U\+D83D at position 3"),
    (5, [5], GOOD, None, r"request_id must be a str, got 5 \(int\)"),
    (None, [5], GOOD, None, r"request_id must be a str, got None"),
    ("r", [5], {"max_tokens": 2}, None, r"sampling_params must be a SamplingParams or None, got dict"),
    ("r", [5], SamplingParams(logprobs=6), None, r"SamplingParams.logprobs=6 is more than this engine's "
                                                  r"max_logprobs=5"),
    ("r", [5], SamplingParams(n=5), None, r"SamplingParams.n=5 is more than max_num_seqs=4"),
    ("r", [5], SamplingParams(stop_token_ids=[10**9]), None, r"SamplingParams.stop_token_ids=\[1000000000\] is "
                                                             r"invalid: 1000000000 is outside the vocabulary \[0, 211\)"),
    ("r", [5], GOOD, NAN, r"arrival_time=nan is invalid: must be None or finite seconds"),
    ("r", [5], GOOD, "now", r"arrival_time='now' is invalid"),
]


@pytest.mark.parametrize("request_id, prompt, params, arrival_time, message", ADD_REQUEST_CASES,
                         ids=lambda x: repr(x)[:24])
def test_bad_add_request(engine, request_id, prompt, params, arrival_time, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_id, prompt, params, arrival_time)
    assert nothing_queued(engine)


def test_the_engine_serves_after_every_refusal(engine):
    for request_id, prompt, params, arrival_time, _ in ADD_REQUEST_CASES:
        with pytest.raises(ValueError):
            engine.add_request(request_id, prompt, params, arrival_time)
    engine.add_request("ok", "hi", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    (out,) = done
    assert len(out.outputs[0].token_ids) == 3 and all(len(lp) in (5, 6) for lp in out.outputs[0].logprobs)
    assert nothing_queued(engine)
