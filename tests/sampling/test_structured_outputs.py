"""Structured outputs (llguidance): the params and their errors, the sampler's mask order
on crafted logits, sampled SmolLM2 outputs that always parse and validate against a dozen
JSON schemas, regex / choice / json_object, speculative decoding under a grammar, and the
server's fields and 400s."""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from refengine.core.engine import LLM  # noqa: E402
from refengine.sampler import Sampler  # noqa: E402
from refengine.sampling_params import SamplingParams  # noqa: E402
from refengine.structured_output import StructuredOutputsParams  # noqa: E402
from tests.helpers import FakeSeq as SamplerSeq, http_server  # noqa: E402


FakeSeq = functools.partial(SamplerSeq, prompt=[1])  # the sequence fields the sampler reads, a one-token prompt


class FixedGrammar:
    """A stand-in for the StructuredOutputManager: every grammar row allows ``allowed``."""

    def __init__(self, allowed, vocab):
        self.mask = np.zeros(vocab, dtype=bool)
        self.mask[list(allowed)] = True
        self.calls = []

    def allowed(self, owners, params, histories):
        self.calls.append([list(h) for h in histories])
        return np.tile(self.mask, (len(owners), 1))


REGEX = StructuredOutputsParams(regex="[0-9]+")  # any grammar: FixedGrammar decides the mask


# --- the params -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragments", [
    (dict(regex="a(b"), ["regex", "unclosed group"]),
    (dict(json={"type": "foo"}), ["Invalid type: foo"]),
    (dict(json={"type": "integer", "minimum": "x"}), ["minimum"]),
    (dict(json="{not json"), ["not valid JSON"]),
    (dict(json=[1, 2]), ["dict or its JSON text"]),
    (dict(), ["exactly one of", "none"]),
    (dict(regex="a", choice=["b"]), ["exactly one of", "regex, choice"]),
    (dict(choice=[]), ["non-empty list of strings"]),
    (dict(choice=["a", 1]), ["non-empty list of strings"]),
    (dict(grammar=""), ["non-empty string"]),
    (dict(json_object="yes"), ["json_object"]),
])
def test_invalid_structured_outputs_name_the_problem(kwargs, fragments):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    msg = str(e.value)
    assert msg.startswith("SamplingParams.structured_outputs=StructuredOutputsParams(")
    for fragment in fragments:
        assert fragment in msg, msg


def test_sampling_params_take_only_structured_outputs_params():
    with pytest.raises(ValueError, match=r"SamplingParams.structured_outputs=\{'json': \{\}\} is invalid"):
        SamplingParams(structured_outputs={"json": {}})
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert p.structured_outputs.kind == "choice" and "yes" in p.structured_outputs.llguidance_grammar


# --- the sampler's order, on crafted logits -----------------------------------------------

def sampler_with(allowed, vocab=8):
    s = Sampler(eos_token_id=7)
    s.structured = FixedGrammar(allowed, vocab)
    return s


def test_mask_is_applied_before_temperature_and_top_k():
    x = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]], dtype=np.float32)
    sampler = sampler_with({1, 3, 6})
    seq = FakeSeq(SamplingParams(temperature=2.0, top_k=2, structured_outputs=REGEX))
    out = sampler.process_logits(x, [seq], owners=[seq])
    # top-k 2 among the allowed {1, 3, 6}: 1 and 3, then divided by the temperature.
    # (Had top-k run first it would keep 0 and 1, and the grammar would then leave only 1.)
    expected = np.full(8, -np.inf, dtype=np.float32)
    expected[[1, 3]] = [2.0, 1.0]
    np.testing.assert_array_equal(out[0], expected)
    # sampling draws only allowed tokens, in proportion exp(2) : exp(1)
    draws = [int(sampler(x, [FakeSeq(seq.sampling_params, seed=s)]).token_ids[0]) for s in range(400)]
    assert set(draws) == {1, 3}
    share = draws.count(1) / len(draws)
    assert abs(share - 1 / (1 + np.exp(-1.0))) < 0.08  # 0.731; 400 draws: sd 0.022


def test_mask_before_top_p_and_min_p_and_greedy():
    x = np.array([[9.0, 1.0, 0.0, 0.5, -3.0, 8.0, 2.0, 0.0]], dtype=np.float32)
    sampler = sampler_with({2, 3, 4})
    # top_p 0.5 over the allowed tokens keeps only 3 (p = 0.50 of {3, 2, 4}); min_p would not matter
    seq = FakeSeq(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, structured_outputs=REGEX))
    out = sampler.process_logits(x, [seq], owners=[seq])
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [3]
    greedy = FakeSeq(SamplingParams(temperature=0.0, structured_outputs=REGEX))
    assert sampler(x, [greedy]).token_ids.tolist() == [3]


def test_rows_without_a_grammar_are_untouched_and_histories_are_passed():
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    sampler = sampler_with({0})
    plain = FakeSeq(SamplingParams(temperature=0.0))
    guided = FakeSeq(SamplingParams(temperature=0.0, structured_outputs=REGEX), output=[4, 5])
    out = sampler.process_logits(x, [plain, guided], owners=[plain, guided])
    np.testing.assert_array_equal(out[0], x[0])
    assert np.isfinite(out[1]).tolist() == [True] + [False] * 7
    assert sampler.structured.calls == [[[4, 5]]]
    assert sampler(x, [plain, guided]).token_ids.tolist() == [7, 0]
    # without owners (a draft model's proposals) no grammar applies
    np.testing.assert_array_equal(sampler.process_logits(x, [plain, guided]), x)


def test_the_grammar_wins_over_masks_that_would_empty_its_row():
    x = np.zeros((1, 8), dtype=np.float32)
    sampler = sampler_with({7})  # the grammar is complete: EOS only
    seq = FakeSeq(SamplingParams(temperature=0.0, min_tokens=5, max_tokens=8, structured_outputs=REGEX))
    assert sampler(x, [seq]).token_ids.tolist() == [7]
    seq = FakeSeq(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2], structured_outputs=REGEX))
    assert sampler(x, [seq]).token_ids.tolist() == [7]


def test_request_stop_ids_end_the_output_only_where_the_grammar_may_end():
    x = np.array([[0.0, 0.0, 0.0, 9.0, 1.0, 8.0, 0.0, 0.0]], dtype=np.float32)
    seq = FakeSeq(SamplingParams(temperature=0.0, stop_token_ids=[3, 5], structured_outputs=REGEX))
    # mid-value: the grammar takes 3 (say '"' inside a JSON string) but may not end (no EOS 7)
    assert sampler_with({3, 4})(x, [seq]).token_ids.tolist() == [4]
    # the grammar may end: the stop ids may end it, as EOS may, even one it would not take
    assert sampler_with({4, 7})(x, [seq]).token_ids.tolist() == [3]
    x[0, 3] = -np.inf
    assert sampler_with({4, 7})(x, [seq]).token_ids.tolist() == [5]


# --- the real model ---------------------------------------------------------------------

def bounded_int(lo, hi):
    return {"type": "integer", "minimum": lo, "maximum": hi}


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "person": obj({"name": {"type": "string", "maxLength": 20}, "age": bounded_int(0, 120)}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}),
    "int_array": obj({"scores": {"type": "array", "items": bounded_int(0, 9), "minItems": 2, "maxItems": 4}}),
    "nested": obj({"user": obj({"id": bounded_int(1, 1000),
                                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
                   "active": {"type": "boolean"}}),
    "number_bounds": obj({"price": {"type": "number", "minimum": 0, "maximum": 100},
                          "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "object_array": obj({"points": {"type": "array", "items": obj({"x": bounded_int(-9, 9), "y": bounded_int(-9, 9)}),
                                    "minItems": 1, "maxItems": 3}}),
    "bool_null": obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    "any_of": obj({"value": {"anyOf": [bounded_int(0, 99), {"type": "string", "maxLength": 10}]}}),
    "optional": obj({"title": {"type": "string", "maxLength": 15}, "year": bounded_int(1900, 2100),
                     "tag": {"type": "string", "maxLength": 8}}, required=["title"]),
    "top_level_array": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 5},
    "matrix": obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2,
                            "items": {"type": "array", "items": bounded_int(0, 9), "minItems": 2, "maxItems": 2}}}),
}
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """SmolLM2 on one numba thread: the sampled tokens do not depend on the thread count
    (batch invariance), and one thread spares its start the warm-up of the parallel kernels."""
    return LLM(model=smollm2_dir, max_model_len=1024, log_stats=False, num_threads=1)


def chat_prompt(llm, text: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def test_sampled_json_always_parses_and_validates(smol):
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        prompt = chat_prompt(smol, f"Reply with a JSON value for this schema: {json.dumps(schema)}")
        for seed in SEEDS:
            prompts.append(prompt)
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            names.append(name)
    outs = smol.generate(prompts, params, use_tqdm=False)
    eos = smol.llm_engine.eos_token_ids
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in eos, (name, c.text)  # the grammar completed
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMAS[name])


def test_json_object_regex_and_choice(smol):
    # any JSON object: a 135M model's unconstrained objects can run on past any max_tokens
    # at temperature 1 (valid JSON all the way, never closed; seeds 1 and 2 do here)
    prompt = chat_prompt(smol, 'Reply with a small JSON object, like {"name": "Tom", "age": 3}, describing a cat.')
    so = StructuredOutputsParams
    cases = ([("object", SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=so(
        json_object=True))) for s in (0, 3, 4)]  # seeds whose objects close within 200 tokens
        + [("regex", SamplingParams(temperature=1.0, seed=s, max_tokens=30,
                                    structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2,4}"))) for s in SEEDS]
        + [("choice", SamplingParams(temperature=1.0, seed=s, max_tokens=10,
                                     structured_outputs=so(choice=["yes", "no", "maybe so"]))) for s in SEEDS])
    outs = smol.generate([prompt] * len(cases), [p for _, p in cases], use_tqdm=False)
    for (kind, _), out in zip(cases, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (kind, text)
        if kind == "object":
            assert isinstance(json.loads(text), dict)
        elif kind == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        else:
            assert text in ("yes", "no", "maybe so")


def test_a_stop_id_inside_a_value_does_not_end_it(smol):
    """stop_token_ids = the id of '"': seed 3 once ended inside the object at its 37th
    token with finish_reason "stop" (the grammar takes '"' mid-value); "stop" now means a
    whole value."""
    quote = smol.get_tokenizer().encode('"')
    assert len(quote) == 1
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # more keys allowed: the model writes on
    prompt = chat_prompt(smol, "A person as JSON.")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, stop_token_ids=quote,
                            structured_outputs=StructuredOutputsParams(json=schema))
    c = smol.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert c.stop_reason is None, c.text
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.text), schema)
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == 40


def test_speculative_decoding_keeps_the_grammar(smollm2_dir, smol):
    """n-gram proposals under a grammar: greedy output equals plain greedy decoding token
    for token (every verified row masked in the state after its proposals, rejected ones
    rolled back), sampled outputs validate."""
    schema = SCHEMAS["object_array"]
    prompt = chat_prompt(smol, 'Points as JSON: {"points": [{"x": 1, "y": 2}, {"x": 1, "y": 2}]}')
    so = StructuredOutputsParams(json=schema)
    greedy = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so) for s in SEEDS]
    plain = smol.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    spec = LLM(model=smollm2_dir, max_model_len=1024, log_stats=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 1})
    outs = spec.generate([prompt] * (1 + len(sampled)), [greedy] + sampled, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain.token_ids
    assert spec.llm_engine.metrics.spec_totals["num_accepted_tokens"] > 0
    assert spec.llm_engine.metrics.spec_totals["num_draft_tokens"] > spec.llm_engine.metrics.spec_totals[
        "num_accepted_tokens"]  # some proposals were rejected (and rolled back)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_engine_refuses_a_grammar_without_a_tokenizer(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, log_stats=False)
    with pytest.raises(ValueError, match="structured_outputs.*needs a tokenizer"):
        llm.llm_engine.add_request("r", [1, 2], SamplingParams(structured_outputs=REGEX))
    assert not llm.llm_engine.has_unfinished_requests()


def test_character_tokenizer_and_n_completions(tiny_llama_tok_dir):
    """A tokenizer.json llguidance cannot read (a Fuse decoder) goes through each token's
    text; n completions of one request each follow their own grammar state."""
    llm = LLM(model=tiny_llama_tok_dir, log_stats=False)
    p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20,
                       structured_outputs=StructuredOutputsParams(regex=r"ab[0-9]{2,5}(x|yz)"))
    out = llm.generate(["hello"], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(r"ab[0-9]{2,5}(x|yz)", c.text), c.text
        assert c.finish_reason == "stop"
    assert len({c.text for c in out.outputs}) > 1


# --- the server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smol):
    with http_server(smol.llm_engine, "smol", timeout=120) as h:
        yield h


def chat(h, **body):
    return h.post("/v1/chat/completions", json={"model": "smol", "messages": [
        {"role": "user", "content": body.pop("content", "Give me a JSON answer.")}], **body})


def test_server_response_format_and_guided_fields(server):
    schema = SCHEMAS["person"]
    r = chat(server, temperature=1.0, seed=5, max_tokens=100, content="A person as JSON.",
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                     "strict": True}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)

    r = chat(server, temperature=1.0, seed=1, max_tokens=200,
             response_format={"type": "json_object"}, structured_outputs=None)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)

    r = chat(server, temperature=1.0, seed=2, max_tokens=20, guided_regex=r"[A-Z][a-z]{2,6}!")
    assert re.fullmatch(r"[A-Z][a-z]{2,6}!", r.json()["choices"][0]["message"]["content"])
    r = chat(server, temperature=1.0, seed=2, max_tokens=20, guided_choice=["left", "right"])
    assert r.json()["choices"][0]["message"]["content"] in ("left", "right")
    r = chat(server, temperature=1.0, seed=2, max_tokens=20, structured_outputs={"choice": ["up", "down"]})
    assert r.json()["choices"][0]["message"]["content"] in ("up", "down")
    # /v1/completions takes them too
    r = server.post("/v1/completions", json={"model": "smol", "prompt": "My favourite number is", "max_tokens": 10,
                                             "guided_json": {"type": "integer", "minimum": 10, "maximum": 99}})
    assert r.status_code == 200, r.text
    assert 10 <= json.loads(r.json()["choices"][0]["text"]) <= 99


@pytest.mark.parametrize("body, param, fragments", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format", ["Invalid type: foo"]),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}}), "response_format",
     ["minimum"]),
    (dict(guided_json={"type": "object", "properties": {"a": {"type": "nope"}}}), "guided_json", ["nope"]),
    (dict(guided_regex="a(b"), "guided_regex", ["unclosed group"]),
    (dict(guided_choice=[]), "guided_choice", ["non-empty list"]),
    (dict(response_format={"type": "json_schema"}), None, ["json_schema"]),
    (dict(response_format={"type": "yaml"}), None, ["'yaml'", "json_object"]),
    (dict(guided_regex="a", guided_choice=["a"]), None, ["at most one of", "guided_regex, guided_choice"]),
    (dict(structured_outputs={"regexp": "a"}), None, ["unknown keys", "regexp"]),
])
def test_server_refuses_bad_grammars_and_keeps_serving(server, body, param, fragments):
    r = chat(server, max_tokens=5, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    ok = chat(server, max_tokens=5, temperature=0.0, guided_choice=["fine"])
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
