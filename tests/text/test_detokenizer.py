"""IncrementalDetokenizer and the stop-string rules of refengine/stop.py: exact deltas on a
scripted fake tokenizer, then the invariants on the real SmolLM2 byte-level BPE tokenizer
(random ids, multilingual text, stop strings)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refengine.core.sequence import Sequence
from refengine.detokenizer import IncrementalDetokenizer
from refengine.sampling_params import SamplingParams
from refengine.stop import StopChecker

FFFD = "\ufffd"


# --- a scripted tokenizer: token id -> bytes, decoded like byte-level BPE ------------------------

class FakeTokenizer:
    VOCAB = {
        0: b"Hel", 1: b"lo", 2: b" wor", 3: b"ld", 4: "世".encode()[:2], 5: "世".encode()[2:], 6: b"!",
        7: b" ", 8: b"STOP", 9: b"ST", 10: b"OP", 11: b"xSTOPy", 12: b"<eos>", 13: b"c\xe4", 14: b"\xb8\x96",
    }
    SPECIAL = {12}

    def __init__(self):
        self.calls = 0
        self.longest = 0  # longest id list ever decoded

    def decode(self, ids, skip_special_tokens):
        self.calls += 1
        self.longest = max(self.longest, len(ids))
        parts = [self.VOCAB[i] for i in ids if not (skip_special_tokens and i in self.SPECIAL)]
        return b"".join(parts).decode("utf-8", errors="replace")


class Stream:
    """One sequence's output as the engine produces it: each token through the stop checker
    (which feeds the detokenizer), then the streamed delta."""

    def __init__(self, prompt=(), tokenizer=None, **params):
        p = SamplingParams(**{"max_tokens": None, **params})  # no length limit unless asked
        self.d = IncrementalDetokenizer(tokenizer or FakeTokenizer(), list(prompt), p)
        self.seq = Sequence("r", None, list(prompt), p, detokenizer=self.d)
        self.checker = StopChecker(eos_token_ids=[], max_model_len=10**9)
        self.decision = None

    def add(self, token: int):
        """The stop string this token completed, else None (tokens after the end are ignored)."""
        if self.decision is not None:
            return None
        self.decision = self.checker.append_and_check(self.seq, token)
        return self.decision.stop_reason if self.decision is not None else None

    @property
    def stop_string(self):
        return self.decision.stop_reason if self.decision is not None else None

    def __getattr__(self, name):  # text, get_delta, finish, ...: the detokenizer's
        return getattr(self.d, name)


def stream(tokens, prompt=(), tokenizer=None, finish=True, **params):
    """Feed tokens one by one; return (stream, [delta after each token] + [finish delta], stops).

    ``finish``: the sequence then ends for a reason other than a stop string (the
    detokenizer flushes)."""
    st = Stream(prompt, tokenizer, **params)
    deltas, stops = [], []
    for t in tokens:
        stops.append(st.add(t))
        deltas.append(st.d.get_delta())
    if finish:
        deltas.append(st.d.finish())
    return st, deltas, stops


def test_scripted_stream_exact_deltas():
    d, deltas, stops = stream([0, 1, 2, 3, 4, 5, 6], prompt=[0])
    assert deltas == ["Hel", "lo", " wor", "ld", "", "世", "!", ""]
    assert d.text == "Hello world世!" and stops == [None] * 7 and d.stop_string is None


def test_split_character_is_held_until_complete_and_flushed_by_finish():
    d, deltas, _ = stream([0, 4], finish=False)
    assert deltas == ["Hel", ""] and d.text == "Hel"  # no U+FFFD ever streamed
    assert d.finish() == FFFD and d.text == "Hel" + FFFD  # as a full decode would show it
    assert d.get_delta() == "" and d.finish() == ""  # idempotent
    assert d.add_token(5) == "" and d.text == "Hel" + FFFD  # finished: ignored


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output():
    # prompt = the first two bytes of "世"; the output starts with its last byte
    d, deltas, _ = stream([5, 6], prompt=[4])
    assert deltas == ["", FFFD + "!", ""] and d.text == FakeTokenizer().decode([5, 6], True)


def test_stop_string_spanning_tokens():
    d, deltas, stops = stream([0, 9, 10, 1], stop=["STOP"], finish=False)
    assert stops == [None, None, "STOP", None]
    assert deltas == ["Hel", "", "", ""] and d.text == "Hel" and d.stop_string == "STOP"
    assert d.output_token_ids == [0, 9, 10]  # the token after the stop was ignored


def test_stop_string_spanning_tokens_included():
    d, deltas, stops = stream([0, 9, 10], stop="STOP", include_stop_str_in_output=True, finish=False)
    assert deltas == ["Hel", "", "STOP"] and d.text == "HelSTOP" and stops[-1] == "STOP"


def test_stop_string_inside_one_token_drops_the_rest_of_it():
    d, deltas, _ = stream([0, 11], stop=["STOP"], finish=False)
    assert deltas == ["Hel", "x"] and d.text == "Helx"
    d, deltas, _ = stream([0, 11], stop=["STOP"], include_stop_str_in_output=True, finish=False)
    assert deltas == ["Hel", "xSTOP"] and d.text == "HelxSTOP"


def test_stop_string_at_the_very_start():
    d, deltas, stops = stream([8, 0], stop=["STOP"], finish=False)
    assert stops == ["STOP", None] and deltas == ["", ""] and d.text == ""


def test_earliest_stop_string_wins():
    d, _, stops = stream([0, 11], stop=["STOP", "xS"], finish=False)
    assert stops[-1] == "xS" and d.text == "Hel"
    d, _, stops = stream([0, 11], stop=["STOP", "TOPy"], finish=False)
    assert stops[-1] == "STOP" and d.text == "Helx"


def test_stop_string_prefix_is_held_back_then_released():
    # "ST" could start "STOP": held; "STlo" cannot any more: released in one piece
    _, deltas, _ = stream([0, 9, 1], stop=["STOP"])
    assert deltas == ["Hel", "", "STlo", ""]
    # the held part ends a request that stops for another reason: finish releases it
    _, deltas, _ = stream([0, 9], stop=["STOP"])
    assert deltas == ["Hel", "", "ST"]
    # a longer stop: only the actual matching tail is held ("ld" of "ld!"), not len-1 chars
    d, deltas, stops = stream([2, 3, 7], stop=["ld!"], finish=False)
    assert deltas == [" wor", "", "ld "]
    d, deltas, stops = stream([2, 3, 6], stop=["ld!"], finish=False)
    assert deltas == [" wor", "", ""] and d.text == " wor" and stops[-1] == "ld!"


def test_stop_string_across_a_split_character():
    # "世" arrives in two tokens; a stop "世!" matches only once the character is whole
    d, deltas, stops = stream([0, 4, 5, 6], stop=["世!"], finish=False)
    assert stops == [None, None, None, "世!"] and deltas == ["Hel", "", "", ""] and d.text == "Hel"


def test_stop_strings_wait_for_min_tokens():
    d, deltas, stops = stream([8, 0, 9, 10], stop=["STOP"], min_tokens=3, finish=False)
    # the first "STOP" (token 1 of 4) is too early and stays in the text; the second counts
    assert stops == [None, None, None, "STOP"] and d.text == "STOPHel"
    assert "".join(deltas) == "STOPHel"


def test_final_flush_is_searched_for_stop_strings_too():
    # "c" + a dangling lead byte is held; max_tokens ends the sequence on that token and the
    # flushed "c\ufffd" completes the stop string "c", which then decides the end
    d, deltas, stops = stream([0, 13], stop=["c"], max_tokens=2, finish=False)
    assert deltas == ["Hel", ""] and d.text == "Hel" and stops == [None, "c"]
    assert (d.decision.finish_reason, d.decision.stop_reason) == ("stop", "c")
    # without a stop string the same end is "length" and the flushed text stays
    d, deltas, stops = stream([0, 13], max_tokens=2, finish=False)
    assert deltas == ["Hel", "c" + FFFD] and (d.decision.finish_reason, d.decision.stop_reason) == ("length", None)


def test_special_tokens_skipped_or_kept():
    _, deltas, _ = stream([0, 12, 1])
    assert deltas == ["Hel", "", "lo", ""]
    _, deltas, _ = stream([0, 12, 1], skip_special_tokens=False)
    assert deltas == ["Hel", "<eos>", "lo", ""]


def test_decode_windows_stay_short():
    tok = FakeTokenizer()
    tokens = [0, 1, 2, 3, 4, 5, 7, 6] * 200
    d, deltas, _ = stream(tokens, prompt=[0] * 50, tokenizer=tok)
    assert "".join(deltas) == d.text == "Hello world世 !" * 200
    assert tok.longest <= 5 + 3  # the prompt context window, never the whole output
    assert tok.calls <= 2 * len(tokens) + 2


class MetaspaceTokenizer:
    """SentencePiece style: "▁" marks a space, and decode drops the leading one."""

    VOCAB = {0: "▁Hello", 1: "▁world", 2: ",", 3: "▁again"}

    def decode(self, ids, skip_special_tokens):
        text = "".join(self.VOCAB[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_spaces_kept_with_a_decoder_that_strips_the_leading_space():
    # Decoding each token alone would give "world", losing the space; the window keeps it.
    _, deltas, _ = stream([1, 2, 3], prompt=[0], tokenizer=MetaspaceTokenizer())
    assert deltas == [" world", ",", " again", ""]


# --- the real SmolLM2 tokenizer -----------------------------------------------------------------

TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "weights" / "SmolLM2-135M-Instruct" / "tokenizer.json"


class TokenizersAdapter:
    def __init__(self, path):
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_file(str(path))

    def decode(self, ids, skip_special_tokens):
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def smol():
    if not TOKENIZER_JSON.exists():
        pytest.skip(f"real tokenizer not found at {TOKENIZER_JSON} (produced by the weights download)")
    return TokenizersAdapter(TOKENIZER_JSON)


def check_invariants(d, deltas, full_text):
    streamed = "".join(deltas)
    assert streamed == d.text == full_text
    assert not any(x.endswith(FFFD) for x in deltas[:-1])  # only finish may flush a U+FFFD


def test_real_random_ids_stream_equals_full_decode(smol):
    rng = np.random.default_rng(0)
    for _ in range(60):
        prompt = rng.integers(0, 49152, size=int(rng.integers(0, 10))).tolist()
        out = rng.integers(0, 49152, size=40).tolist()
        for skip in (True, False):
            d, deltas, _ = stream(out, prompt=prompt, tokenizer=smol, skip_special_tokens=skip)
            check_invariants(d, deltas, smol.decode(out, skip_special_tokens=skip))


MULTILINGUAL = [
    "你好，世界！今天天气很好。",
    "Family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin 👍🏽 and keycap 1️⃣",
    "Café crème, naïve façade, Ångström, e\u0301 (combining), Ελληνικά, русский, עברית, العربية",
    "runs   of    spaces,\ttabs\t\tand\n\n\nnewlines  \n  end  ",
    "मानक हिन्दी और 日本語のテキスト and 한국어 텍스트 ∑∫√ ≠ ≤",
    "    leading spaces and trailing spaces    ",
]


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_real_multilingual_round_trip(smol, text):
    ids = smol.encode(text)
    chat_prompt = smol.encode("<|im_start|>assistant\n")
    d, deltas, _ = stream(ids, prompt=chat_prompt, tokenizer=smol)
    check_invariants(d, deltas, text)
    assert deltas[-1] == ""  # nothing was left pending


def test_real_stop_strings(smol):
    text = "The quick brown fox jumps over the lazy dog. 你好世界和平 👨‍👩‍👧 end"
    ids = smol.encode(text)
    cases = ["brown fox", "uic", "The", "lazy dog.", "世界", "👩", "\u200d", "end", " ", "o"]
    for stop in cases:
        cut = text.index(stop)
        for include in (False, True):
            d, deltas, stops = stream(ids, tokenizer=smol, stop=[stop, "NEVER"],
                                      include_stop_str_in_output=include, finish=False)
            expected = text[: cut + len(stop)] if include else text[:cut]
            assert d.text == expected and d.stop_string == stop, (stop, include, d.text)
            assert "".join(deltas) == expected
            assert [s for s in stops if s] == [stop]  # reported once, by the completing token


def test_real_streamed_text_is_always_a_prefix_of_the_final_text(smol):
    """Hold-back: what was streamed is never later cut, whatever the stop string."""
    rng = np.random.default_rng(1)
    text = "aaa abab abc ab abcabd 世界世 界 👨‍👩 xx"
    ids = smol.encode(text)
    for _ in range(40):
        i = int(rng.integers(0, len(text) - 3))
        stop = text[i: i + int(rng.integers(1, 4))]
        d = Stream(tokenizer=smol, stop=stop)
        streamed = ""
        for t in ids:
            hit = d.add(t)
            streamed += d.get_delta()
            if hit:
                break
        streamed += d.finish()
        assert streamed == d.text == text[: text.index(stop)], stop


def test_real_hold_back_of_a_stop_prefix(smol):
    d = IncrementalDetokenizer(smol, [], SamplingParams(stop=["world peace"]))
    streamed = []
    for t in smol.encode("hello world"):
        d.add_token(t)
        streamed.append(d.get_delta())
    assert "".join(streamed) == "hello "  # "world" could begin "world peace"
    for t in smol.encode(" war"):
        d.add_token(t)
        streamed.append(d.get_delta())
    assert "".join(streamed) == "hello world war"
