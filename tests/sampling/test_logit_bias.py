"""logit_bias (OpenAI), allowed_token_ids and bad_words (vLLM): SamplingParams' checks,
the sampler's exact numbers on crafted logits, the engine (its vocabulary checks, bad
words through a tokenizer) and the server's fields and 400s."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from refengine.core.engine import LLM
from refengine.sampler import NO_TOKEN, Sampler
from refengine.sampling_params import SamplingParams
from refengine.structured_output import banned_by_bad_words, bad_words_token_ids
from tests.helpers import FakeSeq as SamplerSeq, http_server


FakeSeq = functools.partial(SamplerSeq, prompt=[1])  # the sequence fields the sampler reads, a one-token prompt


class CharTokenizer:
    """Each character one token: 'a' = 0, 'b' = 1, ..., ' ' = 26."""

    vocab_size = 27

    @staticmethod
    def encode(text, add_special_tokens=False):
        return [26 if c == " " else ord(c) - ord("a") for c in text]


# --- SamplingParams ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragments", [
    (dict(logit_bias={5: 100.5}), ["logit_bias", "[-100, 100]", "100.5", "token 5"]),
    (dict(logit_bias={5: -101}), ["[-100, 100]", "-101"]),
    (dict(logit_bias={5: float("nan")}), ["[-100, 100]", "nan"]),
    (dict(logit_bias={-1: 1.0}), ["token ids >= 0", "-1"]),
    (dict(logit_bias={"5": 1.0}), ["token ids >= 0", "'5'"]),
    (dict(logit_bias={i: 1.0 for i in range(301)}), ["301 entries", "at most 300"]),
    (dict(logit_bias=[1, 2]), ["dict"]),
    (dict(allowed_token_ids=[]), ["allowed_token_ids", "non-empty"]),
    (dict(allowed_token_ids=[1, -2]), ["allowed_token_ids", "-2"]),
    (dict(allowed_token_ids=[True]), ["allowed_token_ids"]),
    (dict(bad_words="word"), ["bad_words", "list of non-empty strings"]),
    (dict(bad_words=["ok", " "]), ["bad_words", "list of non-empty strings"]),
])
def test_sampling_params_refuse(kwargs, fragments):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(f"SamplingParams.{next(iter(kwargs))}=")
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_sampling_params_normalise():
    p = SamplingParams(logit_bias={np.int64(3): 2, 4: -100}, allowed_token_ids=(np.int32(1), 2),
                       bad_words=("x",))
    assert p.logit_bias == {3: 2.0, 4: -100.0} and all(type(t) is int for t in p.logit_bias)
    assert p.allowed_token_ids == [1, 2] and p.bad_words == ["x"]
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(300)}).logit_bias) == 300


# --- the sampler --------------------------------------------------------------------------

X = np.array([[3.0, 2.0, 1.0, 0.0, -1.0, 4.0]], dtype=np.float32)


def test_logit_bias_is_added_before_temperature():
    seq = FakeSeq(SamplingParams(temperature=2.0, logit_bias={0: 10.0, 5: -100.0, 3: 0.5}))
    out = Sampler().process_logits(X, [seq])
    np.testing.assert_allclose(out[0], np.array([13.0, 2.0, 1.0, 0.5, -1.0, -96.0]) / 2.0, rtol=1e-6)
    greedy = FakeSeq(SamplingParams(temperature=0.0, logit_bias={2: 3.5}))
    assert Sampler()(X, [greedy]).token_ids.tolist() == [2]  # 1 + 3.5 beats 4
    # the raw logprobs are the model's, before the bias
    lp = Sampler()(X, [FakeSeq(SamplingParams(temperature=0.0, logit_bias={2: 3.5}, logprobs=0))]).logprobs[0]
    shifted = X[0] - X[0].max()
    assert lp[2] == pytest.approx(float(shifted[2] - np.log(np.exp(shifted).sum())), rel=1e-6)


def test_logit_bias_ignores_ids_past_the_logits():
    seq = FakeSeq(SamplingParams(temperature=0.0, logit_bias={1: 5.0, 99: 100.0}))
    np.testing.assert_array_equal(Sampler().process_logits(X, [seq])[0], X[0] + np.array([0, 5, 0, 0, 0, 0]))


def test_allowed_token_ids_and_top_k():
    # allowed first, then top-k 1 over {1, 2, 4}: only 1 survives
    seq = FakeSeq(SamplingParams(temperature=1.0, top_k=1, allowed_token_ids=[4, 2, 1]))
    out = Sampler().process_logits(X, [seq])
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [1]
    draws = {int(Sampler()(X, [FakeSeq(SamplingParams(temperature=5.0, allowed_token_ids=[2, 4]), seed=s)]).token_ids[0])
             for s in range(50)}
    assert draws == {2, 4}


def test_rows_are_independent():
    x = np.tile(X, (2, 1))
    a = FakeSeq(SamplingParams(temperature=0.0, allowed_token_ids=[3]))
    b = FakeSeq(SamplingParams(temperature=0.0))
    out = Sampler().process_logits(x, [a, b])
    np.testing.assert_array_equal(out[1], X[0])
    assert Sampler()(x, [a, b]).token_ids.tolist() == [3, 5]


def test_bad_words_token_ids_with_and_without_a_space():
    tok = CharTokenizer()
    # " cd" as written is already " cd": kept once
    assert bad_words_token_ids(tok, ["ab", " cd", "e"]) == [[0, 1], [26, 0, 1], [26, 2, 3], [4], [26, 4]]


@pytest.mark.parametrize("history, banned", [
    ([], [4]),                       # only the one-token word
    ([7, 0], [1, 4]),                # "…a": the b of "ab"
    ([26, 0], [1, 4]),               # " a": "ab" and " ab" both end with b
    ([7, 26], [4]),                  # "… ": " ab" needs " a" first
    ([7, 26, 0], [1, 4]),            # "… a": the b of " ab" (and of "ab")
    ([0, 7], [4]),
])
def test_banned_by_bad_words(history, banned):
    seqs = [[0, 1], [26, 0, 1], [4]]
    assert sorted(set(banned_by_bad_words(seqs, history))) == banned


def test_sampler_bans_bad_words():
    tok = CharTokenizer()
    sampler = Sampler(tokenizer=tok)
    x = np.zeros((1, 27), dtype=np.float32)
    x[0, 1] = 5.0  # "b" is the likeliest token
    p = SamplingParams(temperature=0.0, bad_words=["ab"])
    sampler.check_sampling_params(p)
    assert p._bad_words_token_ids == [[0, 1], [26, 0, 1]]
    assert sampler(x, [FakeSeq(p, output=[2])]).token_ids.tolist() == [1]  # "cb": no ban
    out = sampler.process_logits(x, [FakeSeq(p, output=[2, 0])])  # "ca" + "b" would spell "ab"
    assert out[0, 1] == -np.inf and np.isfinite(np.delete(out[0], 1)).all()


def test_sampler_checks_ids_against_the_vocabulary():
    sampler = Sampler(tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match=r"SamplingParams.logit_bias=\{27: 1.0\} is invalid: token id 27 is "
                                         r"outside the vocabulary \[0, 27\)"):
        sampler.check_sampling_params(SamplingParams(logit_bias={27: 1.0}))
    with pytest.raises(ValueError, match=r"allowed_token_ids=\[1, 30\] is invalid: token id 30"):
        sampler.check_sampling_params(SamplingParams(allowed_token_ids=[1, 30]))
    with pytest.raises(ValueError, match="bad_words.*needs a tokenizer"):
        Sampler(vocab_size=27).check_sampling_params(SamplingParams(bad_words=["a"]))


def test_sampler_refuses_allowed_ids_that_the_first_step_bans():
    sampler = Sampler(eos_token_id=26, tokenizer=CharTokenizer())
    with pytest.raises(ValueError) as e:  # "c" is one token: banned at every step
        sampler.check_sampling_params(SamplingParams(allowed_token_ids=[2, 3], bad_words=["c", "d"]))
    assert str(e.value) == ("SamplingParams.allowed_token_ids=[2, 3] is invalid: bad_words ban every allowed token, "
                            "so no token could be generated")
    with pytest.raises(ValueError, match=r"allowed_token_ids=\[26, 4\] is invalid: EOS \(min_tokens\) and "
                                         r"stop_token_ids \(min_tokens\) ban every allowed token"):
        sampler.check_sampling_params(SamplingParams(allowed_token_ids=[26, 4], stop_token_ids=[4], min_tokens=1))
    # one allowed id left, a multi-token word (banned only after its prefix), or ignore_eos: accepted
    sampler.check_sampling_params(SamplingParams(allowed_token_ids=[2, 3, 4], bad_words=["c", "d"]))
    sampler.check_sampling_params(SamplingParams(allowed_token_ids=[0, 1], bad_words=["ab", "aa"]))
    sampler.check_sampling_params(SamplingParams(allowed_token_ids=[26], min_tokens=1, ignore_eos=True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_the_masks_leave_empty_gives_no_token(temperature):
    # after "a", "ab" and "aa" ban both allowed tokens: nothing may follow (not token 0)
    sampler = Sampler(tokenizer=CharTokenizer())
    p = SamplingParams(temperature=temperature, allowed_token_ids=[0, 1], bad_words=["ab", "aa"], logprobs=2)
    sampler.check_sampling_params(p)
    x = np.zeros((2, 27), dtype=np.float32)
    out = sampler(x, [FakeSeq(p, output=[0]), FakeSeq(p, output=[1])])
    assert out.token_ids[0] == NO_TOKEN and out.logprobs[0] is None
    assert out.token_ids[1] in (0, 1) and out.logprobs[1] is not None


# --- the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok_llm(tiny_llama_tok_dir):
    return LLM(model=tiny_llama_tok_dir, log_stats=False)


def test_engine_applies_them(tok_llm):
    engine = tok_llm.llm_engine
    tok = tok_llm.get_tokenizer()
    x_id = tok.convert_tokens_to_ids("x")
    outs = tok_llm.generate(["hi", "hi", "hi"], [
        SamplingParams(temperature=1.0, seed=1, max_tokens=8, logit_bias={x_id: 100.0}),
        SamplingParams(temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=tok.encode("ab")),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=["q"])], use_tqdm=False)
    assert outs[0].outputs[0].text == "x" * 8
    assert set(outs[1].outputs[0].text) <= {"a", "b"} and len(outs[1].outputs[0].token_ids) == 8
    # greedy without the ban, then with it: the ban changes the output exactly where "q" was
    plain = tok_llm.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    assert "q" not in outs[2].outputs[0].text
    if "q" in plain:
        assert outs[2].outputs[0].text[:plain.index("q")] == plain[:plain.index("q")]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("r", "hi", SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("r", "hi", SamplingParams(allowed_token_ids=[engine.model_config.vocab_size]))
    assert not engine.has_unfinished_requests()


def test_engine_ends_a_request_its_masks_leave_without_a_token(tok_llm):
    tok = tok_llm.get_tokenizer()
    a, b = tok.encode("ab")
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=[a, b],
                       bad_words=["ab", "aa"], logit_bias={a: 100.0}, logprobs=1)
    out = tok_llm.generate(["hi"], p, use_tqdm=False)[0].outputs[0]
    # "a", then both allowed tokens banned: finished "error", not token 0 until max_tokens
    assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == ("error", None, [a], "a")
    assert len(out.logprobs) == 1
    assert not tok_llm.llm_engine.has_unfinished_requests()


def test_engine_refuses_bad_words_without_a_tokenizer(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, log_stats=False)
    with pytest.raises(ValueError, match="bad_words.*needs a tokenizer"):
        llm.llm_engine.add_request("r", [1, 2], SamplingParams(bad_words=["a"]))
    out = llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=3, allowed_token_ids=[7],
                                                ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [7, 7, 7]


# --- the server -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tok_llm):
    with http_server(tok_llm.llm_engine, "tiny", timeout=60) as h:
        yield h


def test_server_applies_them(server, tok_llm):
    tok = tok_llm.get_tokenizer()
    x_id = tok.convert_tokens_to_ids("x")
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "logit_bias": {str(x_id): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "xxxxx"
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "allowed_token_ids": tok.encode("z"), "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "zzzz"
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                             "bad_words": ["a", "e"]})
    assert r.status_code == 200 and not {"a", "e"} & set(r.json()["choices"][0]["text"])


@pytest.mark.parametrize("body, param, fragments", [
    ({"logit_bias": {"5": 101}}, "logit_bias", ["101", "[-100, 100]"]),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", ["-100.5", "[-100, 100]"]),
    ({"logit_bias": {"abc": 1}}, "logit_bias", ["'abc'", "token ids"]),
    ({"logit_bias": {"-3": 1}}, "logit_bias", ["-3", ">= 0"]),
    ({"logit_bias": {"5000": 1}}, "logit_bias", ["5000", "outside the vocabulary [0, 211)"]),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ["301 entries", "at most 300"]),
    ({"allowed_token_ids": []}, "allowed_token_ids", ["non-empty"]),
    ({"allowed_token_ids": [3, 211]}, "allowed_token_ids", ["211", "outside the vocabulary"]),
    ({"bad_words": [""]}, "bad_words", ["non-empty strings"]),
    # "a" is id 68 of the character tokenizer, and one token: banned everywhere
    ({"allowed_token_ids": [68], "bad_words": ["a"]}, "allowed_token_ids", ["bad_words ban every allowed token"]),
])
def test_server_400s(server, body, param, fragments):
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_server_reports_a_request_its_masks_leave_without_a_token(server, tok_llm):
    a, b = tok_llm.get_tokenizer().encode("ab")
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "allowed_token_ids": [a, b],
            "bad_words": ["ab", "aa"], "logit_bias": {str(a): 100}}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "choice 0 could not go on after 1 tokens" in r.json()["error"]["message"]
    with server.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("a", None), ("", "error")]


# --- per-request costs: linear, built once ------------------------------------------------

class CountingId(int):
    """A token id that counts how often it is compared (a list scan compares the ids of
    every pair of equally long sequences)."""

    comparisons = 0

    def __eq__(self, other):
        CountingId.comparisons += 1
        return int(self) == int(other)

    __hash__ = int.__hash__


class CountingTokenizer(CharTokenizer):
    @staticmethod
    def encode(text, add_special_tokens=False):
        return [CountingId(t) for t in CharTokenizer.encode(text)]


def test_bad_words_dedup_is_linear(monkeypatch):
    """2,000 words: a few id comparisons per word (a list scan made millions); repeats are
    still kept once, in order; the error names only the word."""
    monkeypatch.setattr(CountingId, "comparisons", 0)
    words = ["".join(chr(ord("a") + int(d)) for d in f"{i:04d}") for i in range(2000)] + ["ab", "ab", " ab"]
    seqs = bad_words_token_ids(CountingTokenizer(), words)
    assert CountingId.comparisons < 10 * len(words)
    assert len(seqs) == 2 * 2000 + 2 and seqs[-2:] == [[0, 1], [26, 0, 1]]
    assert all(type(s) is list for s in seqs)

    class Empty(CharTokenizer):
        @staticmethod
        def encode(text, add_special_tokens=False):
            return [] if text.strip() == "zz" else CharTokenizer.encode(text)

    with pytest.raises(ValueError) as e:
        bad_words_token_ids(Empty(), words[:1000] + ["zz"])
    assert str(e.value) == "SamplingParams.bad_words=['zz'] is invalid: 'zz' encodes to no tokens"


def test_allowed_token_ids_mask_is_built_once_per_request(monkeypatch):
    """The sampler's check builds the [V] mask once; steps (and n rows sharing the params)
    reuse it rather than turning the id list into an index every step."""
    import refengine.sampler as sampler_module

    built = []
    token_mask = sampler_module.disallowed_token_mask
    monkeypatch.setattr(sampler_module, "disallowed_token_mask",
                        lambda ids, V: built.append(V) or token_mask(ids, V))
    sampler = Sampler(tokenizer=CharTokenizer())
    p = SamplingParams(temperature=0.0, allowed_token_ids=[4, 2, 2, 1], logit_bias={3: 5.0, 9: -1.0})
    sampler.check_sampling_params(p)
    mask = p._disallowed_token_mask
    assert built == [27] and mask.shape == (27,) and np.flatnonzero(~mask).tolist() == [1, 2, 4]
    bias = p._logit_bias_arrays
    x = np.zeros((2, 27), dtype=np.float32)
    x[:, 2] = 1.0
    for step in range(3):
        out = sampler(x, [FakeSeq(p, output=[4] * step), FakeSeq(p, output=[1] * step)])
        assert out.token_ids.tolist() == [2, 2]
    assert built == [27] and p._disallowed_token_mask is mask and p._logit_bias_arrays is bias
    sampler.check_sampling_params(p)  # the engine checks again at add_request: nothing rebuilt
    assert built == [27]
    logits = Sampler().process_logits(np.zeros((1, 5), dtype=np.float32), [FakeSeq(p)])  # another width
    assert np.isfinite(logits[0]).tolist() == [False, True, True, False, True] and built == [27, 5]


def test_allowed_token_ids_longer_than_the_vocabulary_are_refused():
    with pytest.raises(ValueError) as e:
        Sampler(tokenizer=CharTokenizer()).check_sampling_params(SamplingParams(allowed_token_ids=[1] * 28))
    assert str(e.value) == ("SamplingParams.allowed_token_ids=<28 ids> is invalid: at most 27 ids "
                            "(the vocabulary's size)")
