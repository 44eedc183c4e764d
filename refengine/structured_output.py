"""Structured outputs: decoding constrained to a JSON schema, a regex, a list of choices
or a grammar, through llguidance (https://github.com/guidance-ai/llguidance).

What a request asks for is a :class:`StructuredOutputsParams` in
``SamplingParams.structured_outputs`` (vLLM's ``vllm.sampling_params.StructuredOutputsParams``:
the fields ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``disable_any_whitespace``). It is compiled to an llguidance grammar, and checked, when the
params are built, so a bad schema or regex is a ``ValueError`` (HTTP 400) that carries the
library's message.

How the engine applies it (the sampler, ``refengine/sampler.py``)::

    per sequence, an llguidance LLMatcher (made on the sequence's first sampling step)
    each step:  sync the matcher to the sequence's output ids (consume the new ones,
                roll back what is no longer there: a step that was undone, rejected
                proposals of speculative decoding)
                -> a bitmask of the tokens the grammar allows next (EOS only where the
                   grammar may end, and nothing else once it must end)
                -> those logits -inf, before any other processing

So a request ends (EOS) when its grammar is complete, and only then. The matcher advances
lazily: it follows ``output_token_ids`` at each use, never the sampler's own choices, so
whatever undoes a token (a failed step, verification of proposals) needs no call here.
With speculative decoding each verified row ``j`` of a sequence (its outputs then
proposals ``d_1 .. d_j``) is masked with the grammar state after those proposals;
a proposal the grammar refuses has target probability 0, so it is rejected and no row
after it is used (``refengine/spec_decode/rejection.py``).

Sources: vLLM's llguidance backend (``vllm/v1/structured_output/backend_guidance.py``)
for the request options and the grammar each maps to; llguidance's ``LLMatcher`` API
(``llguidance/_lib.pyi``) for masks, consumption and rollback.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger("refengine")

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON's whitespace between tokens: any of the four JSON whitespace characters, as vLLM's
# default, but at most 20 in a row, so a sampled run of newlines cannot outlast max_tokens
# (pretty-printed JSON nests a dozen levels within it).
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{1,20}"


def _llguidance():
    """The llguidance module (optional: the ``serve`` / ``test`` extras install it).

    Raises:
        ValueError: llguidance is not installed.
    """
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need the llguidance package: pip install llguidance "
                         "(or pip install 'refengine[serve]')") from None
    return llguidance


@dataclass(repr=False)
class StructuredOutputsParams:
    """What the output must match (exactly one of the first five fields), as vLLM's
    ``StructuredOutputsParams`` (earlier ``GuidedDecodingParams``).

    Attributes:
        json: a JSON schema, as a dict or its JSON text (OpenAI's
            ``response_format={"type": "json_schema", ...}``, vLLM's ``guided_json``).
        regex: a regular expression the whole output matches (Rust ``regex`` syntax).
        choice: a non-empty list of strings; the output is exactly one of them.
        grammar: a Lark or GBNF grammar (llguidance's syntax).
        json_object: True for any JSON object (``response_format={"type": "json_object"}``).
        disable_any_whitespace: JSON without whitespace between tokens (vLLM's
            ``disable_any_whitespace``).
        whitespace_pattern: the regex of JSON's whitespace between tokens (vLLM's field;
            default :data:`DEFAULT_WHITESPACE_PATTERN`, up to 20 whitespace characters).

    Raises:
        ValueError: none or several of the kinds set, a field of the wrong type, or a
            schema / regex / grammar llguidance refuses (its message is kept), or
            llguidance missing. The message starts ``SamplingParams.structured_outputs=``.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    _grammar: str = field(init=False, repr=False, compare=False, default="")
    # set by StructuredOutputManager.check: the manager that checked this grammar, and the
    # matcher the check made, kept for the request's first sequence
    _checked_by: Any = field(init=False, repr=False, compare=False, default=None)
    _spare_matcher: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise self._bad(f"exactly one of {', '.join(_KINDS)} must be set, got "
                            f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise self._bad(f"json must be a JSON schema (a dict or its JSON text), got {type(value).__name__}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise self._bad(f"{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                 or any(not isinstance(c, str) for c in value)):
            raise self._bad(f"choice must be a non-empty list of strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise self._bad(f"json_object must be True or None, got {value!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise self._bad(f"whitespace_pattern must be a regex string, got {self.whitespace_pattern!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise self._bad(f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}")
        self._grammar = self._compile(kind, value)

    def __repr__(self) -> str:  # only the fields that are set
        shown = [f"{k}={getattr(self, k)!r}" for k in _KINDS if getattr(self, k) not in (None, False)]
        if self.disable_any_whitespace:
            shown.append("disable_any_whitespace=True")
        if self.whitespace_pattern is not None:
            shown.append(f"whitespace_pattern={self.whitespace_pattern!r}")
        return f"StructuredOutputsParams({', '.join(shown)})"

    @property
    def kind(self) -> str:
        """Which of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` is set."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def llguidance_grammar(self) -> str:
        """The llguidance grammar (its JSON text) that :class:`LLMatcher` takes."""
        return self._grammar

    def _bad(self, why: str) -> ValueError:
        shown = repr(self)
        if len(shown) > 200:
            shown = shown[:197] + "..."
        return ValueError(f"SamplingParams.structured_outputs={shown} is invalid: {why}")

    def _compile(self, kind: str, value) -> str:
        llg = _llguidance()
        M = llg.LLMatcher
        try:
            if kind in ("json", "json_object"):
                if kind == "json_object":
                    schema: Any = {"type": "object"}
                elif isinstance(value, str):
                    try:
                        schema = json.loads(value)
                    except json.JSONDecodeError as e:
                        raise self._bad(f"json is not valid JSON: {e}") from None
                else:
                    schema = value
                if not isinstance(schema, (dict, bool)):
                    raise self._bad(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
                if self.disable_any_whitespace:
                    options = {"whitespace_flexible": False}
                else:
                    options = {"whitespace_pattern": self.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN}
                grammar = M.grammar_from_json_schema(json.dumps(schema), overrides=options)
            elif kind == "regex":
                grammar = M.grammar_from_regex(value)
            elif kind == "choice":
                # a Lark alternation of string literals (JSON strings are Lark strings)
                grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
            else:
                grammar = llg.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            if str(e).startswith("SamplingParams."):
                raise
            raise self._bad(f"llguidance: {e}") from None
        error = M.validate_grammar(grammar, None)
        if error:
            raise self._bad(f"llguidance: {error.strip()}")
        return grammar


class _DecodedTokens:
    """What ``llguidance.TokenizerWrapper`` reads, from a :class:`refengine.tokenizer.Tokenizer`."""

    def __init__(self, tokenizer, eos_token_ids: list[int]):
        special = set(tokenizer.all_special_ids)
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff" + tokenizer.convert_ids_to_tokens(i).encode() if i in special
                       else tokenizer.decode([i], skip_special_tokens=False).encode()
                       for i in range(tokenizer.vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


# --- the per-sequence state ----------------------------------------------------------

class _GrammarState:
    """One sequence's matcher and the output ids it has consumed (a prefix of them)."""

    __slots__ = ("matcher", "consumed", "__weakref__")

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed: list[int] = []


class StructuredOutputManager:
    """The llguidance side of one engine: its tokenizer, and a matcher per sequence.

    Args:
        tokenizer: the engine's :class:`refengine.tokenizer.Tokenizer` (wrapping a
            ``tokenizers.Tokenizer``, whose JSON llguidance reads).
        vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
        eos_token_ids: the ids that end a sequence; the grammar allows them where it may end.

    The llguidance tokenizer is built on first use, or by :meth:`prepare`, and kept;
    building is locked, as the server checks requests in worker threads. Building it holds
    the GIL (llguidance's compiles and matchers release it), so the server builds it before
    it serves.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def ll_tokenizer(self):
        """The ``llguidance.LLTokenizer`` of this model (built once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_ll_tokenizer()
            return self._ll_tokenizer

    def _build_ll_tokenizer(self):
        """From the ``tokenizer.json`` text when llguidance reads its decoder (byte-level
        BPE, byte fallback, ...); otherwise from each token's decoded text (right for
        tokenizers whose decode of a concatenation is the concatenation of decodes, e.g.
        a character-level one; special tokens are llguidance's ``0xFF`` + name)."""
        llg = _llguidance()
        eos = self.eos_token_ids or None
        backend = getattr(self.tokenizer, "_tok", None)  # refengine.tokenizer.Tokenizer's tokenizers.Tokenizer
        if backend is not None and hasattr(backend, "to_str"):
            try:
                return llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            except ValueError as e:  # e.g. "can't determine decoder type"
                logger.info("structured outputs: llguidance cannot read tokenizer.json (%s); "
                            "using each token's decoded text", e)
        return llg.LLTokenizer(llg.TokenizerWrapper(_DecodedTokens(self.tokenizer, self.eos_token_ids)),
                               n_vocab=self.vocab_size, eos_token=eos)

    def new_matcher(self, params: StructuredOutputsParams):
        """A fresh ``LLMatcher`` for ``params``.

        Raises:
            ValueError: the grammar fails against this tokenizer (llguidance's message).
        """
        llg = _llguidance()
        matcher = llg.LLMatcher(self.ll_tokenizer, params.llguidance_grammar, log_level=0)
        if matcher.is_error():
            raise params._bad(f"llguidance: {matcher.get_error().strip()}")
        return matcher

    def prepare(self):
        """:attr:`ll_tokenizer`, built now rather than at the first structured request.

        Raises:
            ValueError: llguidance is not installed.
        """
        _llguidance()
        return self.ll_tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise the ``ValueError`` of :meth:`new_matcher` now (before a request queues).

        The matcher made is kept on ``params`` for the request's first sequence, and
        ``params`` checked once by this manager are not checked again: the engine checks a
        request when it is added too, and the server adds requests on its event loop."""
        if params._checked_by is self:
            return
        params._spare_matcher = self.new_matcher(params)
        params._checked_by = self

    def forget(self, seq) -> None:
        """Drop ``seq``'s matcher (it is also dropped when the sequence is garbage)."""
        self._states.pop(seq, None)

    def _state(self, owner, params: StructuredOutputsParams) -> _GrammarState:
        state = self._states.get(owner)
        if state is None:
            matcher = params._spare_matcher if params._checked_by is self else None
            if matcher is not None:  # the check's matcher, fresh: the first sequence takes it
                params._spare_matcher = None
                self._states[owner] = state = _GrammarState(matcher)
                return state
            try:
                state = _GrammarState(self.new_matcher(params))
            except ValueError:  # checked at add_request; if it fails now, EOS only (see fill_bitmask)
                logger.exception("structured outputs: the grammar of request %s failed",
                                 getattr(owner, "request_id", "?"))
                state = _GrammarState(None)
            self._states[owner] = state
        return state

    def _sync(self, state: _GrammarState, history: list[int]) -> bool:
        """Bring the matcher to ``history`` (the output ids so far): roll back past the
        common prefix, consume the rest up to the first EOS. Returns False when part of
        ``history`` is not allowed by the grammar (the matcher stays at the longest
        allowed prefix: only a proposal being verified can be such a token)."""
        m, done = state.matcher, state.consumed
        n = len(done)
        if n > len(history) or history[:n] != done:
            keep = 0
            limit = min(n, len(history))
            while keep < limit and done[keep] == history[keep]:
                keep += 1
            if not m.rollback(n - keep):  # cannot happen within llguidance's history; start over
                m.reset()
                keep = 0
            del done[keep:]
            n = keep
        rest = history[n:]
        for i, t in enumerate(rest):  # the grammar ends at EOS: tokens after it are not its
            if t in self._eos:
                rest = rest[:i]
                break
        if not rest:
            return True
        ok = m.validate_tokens(rest)
        if ok:
            m.consume_tokens(rest[:ok])
            done.extend(rest[:ok])
        return ok == len(rest)

    def fill_bitmask(self, owner, params: StructuredOutputsParams, history: list[int],
                     out: np.ndarray) -> None:
        """Write into ``out`` (``[1, ceil(vocab_size / 32)]`` int32, C-contiguous; bit
        ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed) the grammar's
        mask after ``history`` (the output ids so far, proposals being verified included)
        for ``owner`` (the sequence whose matcher this is). A matcher in llguidance's
        error state allows EOS only, so the sequence ends."""
        from llguidance.numpy import fill_next_token_bitmask

        state = self._state(owner, params)
        if state.matcher is not None:
            self._sync(state, history)
        if state.matcher is None or state.matcher.is_error():
            words = out.view(np.uint32)
            words[:] = 0
            for t in self.eos_token_ids:
                words[0, t // 32] |= np.uint32(1 << (t % 32))
            return
        fill_next_token_bitmask(state.matcher, out, 0)

    def allowed(self, owners: list, params: list[StructuredOutputsParams],
                histories: list[list[int]]) -> np.ndarray:
        """``[len(owners), n]`` bool (``n`` llguidance's vocabulary size, at most the
        model's): True where row ``i``'s grammar allows the
        token after ``histories[i]`` (see :meth:`fill_bitmask`)."""
        n = self.ll_tokenizer.vocab_size  # the model's, or the tokenizer's when llguidance keeps that
        packed = np.zeros((len(owners), (n + 31) // 32), dtype=np.int32)
        for i, (owner, p, h) in enumerate(zip(owners, params, histories)):
            self.fill_bitmask(owner, p, h, packed[i:i + 1])
        # token t is bit t % 32 of the little-endian word t // 32: byte t // 8, bit t % 8
        bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
        return bits[:, :n].astype(bool)  # the sampler refuses the tokens past n


# --- bad words -----------------------------------------------------------------------

def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences ``bad_words`` bans: each word as written and with one leading
    space (``" " + word.lstrip()``), the way it appears at the start of a text and inside
    one (vLLM's ``SamplingParams.update_from_tokenizer``). Duplicates are kept once, in
    order (a dict of tuples: linear in the number of words).

    Raises:
        ValueError: a word that encodes to no tokens (the message names that word).
    """
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                raise ValueError(f"SamplingParams.bad_words={[word]!r} is invalid: {word!r} encodes to no tokens")
            out.setdefault(ids)
    return [list(ids) for ids in out]


def banned_by_bad_words(sequences: list[list[int]], history: list[int]) -> list[int]:
    """The next tokens ``sequences`` ban after ``history``: the last token of each whose
    preceding tokens are the tail of ``history`` (a one-token word is always banned)."""
    banned = []
    for ids in sequences:
        prefix = ids[:-1]
        if not prefix or (len(history) >= len(prefix) and history[len(history) - len(prefix):] == prefix):
            banned.append(ids[-1])
    return banned

