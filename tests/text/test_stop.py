"""The stop rules of refengine/stop.py, with expected values derived from the rules themselves,
and per-request metrics with n > 1 completions."""

from __future__ import annotations

import itertools
import logging

import pytest

from refengine import LLM, SamplingParams
from refengine.core.sequence import Sequence
from refengine.detokenizer import IncrementalDetokenizer
from refengine.stop import StopChecker, find_stop_string


class PieceTokenizer:
    """Token id -> a fixed string piece; decode joins them (special ids dropped when asked)."""

    def __init__(self, pieces: list[str], special: tuple[int, ...] = ()):
        self.pieces, self.special = pieces, set(special)

    def decode(self, ids, skip_special_tokens):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))


def run(tokenizer, tokens, eos=(), **params):
    """Feed ``tokens`` through the stop checker; return (sequence, decision, streamed text)."""
    p = SamplingParams(**{"max_tokens": None, **params})
    detok = IncrementalDetokenizer(tokenizer, [], p)
    seq = Sequence("r", None, [0], p, detokenizer=detok)
    checker = StopChecker(eos, max_model_len=10**6)
    decision, streamed = None, ""
    for t in tokens:
        decision = checker.append_and_check(seq, t)
        streamed += detok.get_delta()
        if decision is not None:
            break
    return seq, decision, streamed


# --- stop token ids and EOS keep their text only with include_stop_str_in_output -------------

TOK = PieceTokenizer(["Hel", "lo", "!", "<eos>"], special=(3,))


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_is_kept_only_when_included(include):
    seq, decision, streamed = run(TOK, [0, 1, 2, 0], stop_token_ids=[2], include_stop_str_in_output=include)
    assert (decision.finish_reason, decision.stop_reason) == ("stop", 2)
    assert seq.output_token_ids == [0, 1, 2]  # the id is always in token_ids
    want = "Hello!" if include else "Hello"
    assert seq.detokenizer.text == streamed == want


@pytest.mark.parametrize("include, skip_special, want", [
    (False, True, "Hello"), (False, False, "Hello"),  # EOS text dropped
    (True, True, "Hello"),  # kept, but a skipped special token decodes to ""
    (True, False, "Hello<eos>"),  # kept and shown
])
def test_eos_text_follows_include_and_skip_special_tokens(include, skip_special, want):
    seq, decision, streamed = run(TOK, [0, 1, 3, 0], eos=[3], include_stop_str_in_output=include,
                                  skip_special_tokens=skip_special)
    assert (decision.finish_reason, decision.stop_reason) == ("stop", None)
    assert seq.output_token_ids == [0, 1, 3] and seq.detokenizer.text == streamed == want


# --- several stop strings: the result does not depend on how the text was split --------------

def splits(text: str):
    """Every way of cutting ``text`` into consecutive non-empty pieces."""
    n = len(text)
    for cuts in itertools.product([False, True], repeat=n - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                pieces.append(text[start:i])
                start = i
        pieces.append(text[start:])
        yield pieces


def expected_by_rule(text: str, stops: list[str], include: bool):
    """The match that completes earliest wins; ties go to the one that starts earlier."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return (text[:end] if include else text[:start]), stop


@pytest.mark.parametrize("text, stops", [
    ("abcde", ["bcd", "abcde"]),  # the earlier start completes later: "bcd" wins
    ("abcde", ["abcde", "bcd"]),  # list order does not matter
    ("xxabyy", ["aby", "ab", "b"]),  # three end at or before y: "ab" and "b" tie at 4, "ab" starts first
    ("hello world", ["lo w", "o", "world"]),
    ("aaaa", ["aa", "aaa"]),
    ("abc", ["zz"]),  # no match
])
@pytest.mark.parametrize("include", [False, True])
def test_several_stop_strings_do_not_depend_on_the_token_split(text, stops, include):
    want_text, want_stop = expected_by_rule(text, stops, include)
    for pieces in splits(text):
        tok = PieceTokenizer(pieces)
        seq, decision, streamed = run(tok, list(range(len(pieces))), stop=stops, include_stop_str_in_output=include)
        got_stop = decision.stop_reason if decision is not None else None
        assert (seq.detokenizer.text, got_stop) == (want_text, want_stop), pieces
        if decision is not None:
            assert streamed == want_text


def test_find_stop_string_only_counts_matches_ending_in_the_new_text():
    assert find_stop_string("abXab", 2, ["ab"]) == (3, "ab")  # the first "ab" was seen before
    assert find_stop_string("abXab", 1, ["Xa"]) is None  # "Xa" ended before the new "b"
    assert find_stop_string("abcd", 4, ["cd", "bcd"]) == (1, "bcd")  # same end: the earlier start


# --- n > 1: every completion counts in the request's metrics ----------------------------------

def test_n_completions_all_count_in_metrics(tiny_llama_dir, caplog):
    llm = LLM(tiny_llama_dir, block_size=8, log_stats=True)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="refengine"):
        out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    m = out.metrics
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert m.num_output_tokens == 15 and len(m.token_times) == 15
    assert len(m.inter_token_latencies) == 3 * 4  # 4 gaps in each completion
    assert m.tpot == pytest.approx(sum(m.inter_token_latencies) / 12)
    em = llm.llm_engine.metrics
    text = em.exposition()

    def sample(name):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert sample("refengine:request_generation_tokens_sum") == 15
    assert sample("refengine:inter_token_latency_seconds_count") == 12
    assert sample("refengine:request_time_per_output_token_seconds_count") == 1
    assert sample("refengine:request_time_per_output_token_seconds_sum") == pytest.approx(m.tpot)
    assert sample("refengine:generation_tokens_total") == 15
    finished = [r.getMessage() for r in caplog.records if "finished:" in r.getMessage()]
    assert len(finished) == 1 and "output_tokens=15 " in finished[0]
