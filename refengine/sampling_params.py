"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and defaults).

Each sampling parameter is declared once, as a field of :class:`SamplingParams` made by
:func:`sampling_field`: its default, its check, its command-line flag (:class:`Flag`, from
which :func:`refengine.cli_options.sampling_options` makes the ``generate`` and ``chat``
flags) and its server field (:class:`ApiField`, from which :mod:`refengine.server.protocol`
makes the request bodies' fields and reads them back).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from refengine.text import check_unicode

# Seeds are those of NumPy's generators, which take non-negative integers; 64 bits is the
# range vLLM (torch) accepts.
MAX_SEED = 2**64 - 1
# OpenAI's limits on logit_bias: at most 300 entries, each bias in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's ``RequestOutputKind``).

    CUMULATIVE: every output holds the whole text, token ids and logprobs so far (plus
    ``delta_text`` / ``delta_token_ids``); a step copies O(output length) per request.
    DELTA: each output holds only what is new since the previous one (a step costs
    O(new tokens)); the concatenation of the outputs is the completion.
    FINAL_ONLY: one output, when the request finishes, holding everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# --- the declaration of a sampling parameter ------------------------------------------------

#: ``Flag.default`` when the flag's default is the field's.
FIELD_DEFAULT = "the field's default"


@dataclass(frozen=True)
class Flag:
    """A sampling parameter's command-line flag: ``--`` and the field's name with dashes
    (``top_p`` -> ``--top-p``).

    ``help``: the ``--help`` text. ``default``: the flag's default where the command line's
    differs from the field's (:data:`FIELD_DEFAULT`: the field's). ``show_default``: what ``--help``
    shows as the default (None: the default itself, ``"none"`` for None, ``"off"`` for a
    switch).
    """

    help: str
    default: Any = FIELD_DEFAULT
    show_default: str | None = None


@dataclass(frozen=True)
class ApiField:
    """A sampling parameter's field in the server's request bodies (``/v1/completions``,
    ``/v1/chat/completions``): the field's own name, optional, ``null`` meaning its default.

    ``type``: the JSON value's pydantic annotation as written in
    :mod:`refengine.server.protocol` (``"list[StrictInt]"``: JSON integers only).
    ``convert``: the JSON value -> the field's value, where they differ (may raise
    ``ValueError``).
    """

    type: str
    convert: Callable[[Any], Any] | None = None

    def read(self, value):
        """The field's value for a request's JSON ``value`` (None stays None: the default).

        Raises:
            ValueError: from ``convert``.
        """
        return value if value is None or self.convert is None else self.convert(value)


def sampling_field(default, check: Callable[[str, Any], Any], *, flag: Flag | None = None,
                   api: ApiField | None = None):
    """One sampling parameter: a ``SamplingParams`` field with its ``default``, its ``check``
    (``check(name, value)`` -> the value to keep, normalised; raises ``ValueError``), its
    command-line ``flag`` (None: none) and its server field ``api`` (None: none)."""
    return field(default=default, metadata={"check": check, "flag": flag, "api": api})


# --- checks: each returns the value to keep or raises a ValueError naming field, value, range ---

def invalid(name: str, value, allowed: str) -> ValueError:
    """The error of a bad field: ``SamplingParams.<name>=<value!r> is invalid: must be <allowed>``."""
    return ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")


def _is_int(v) -> bool:  # bool is an int subclass, but True is not a count
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and not math.isnan(v)


def check_int(minimum: int, allowed: str, *, maximum: int | None = None, optional: bool = False):
    """The check of an integer in ``[minimum, maximum]`` (None too when ``optional``);
    ``allowed``: the range in words, for the error.

    Raises (the check):
        ValueError: not an integer (a bool is not) or out of range, naming ``allowed``.
    """
    def check(name, value):
        if value is None and optional:
            return value
        if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise invalid(name, value, allowed)
        return value
    return check


def check_number(within: Callable[[float], bool], allowed: str, *, not_a_number: str = "a number"):
    """The check of a real number (not NaN, not a bool) for which ``within(value)`` holds;
    ``allowed`` and ``not_a_number``: the errors' words for each failure.

    Raises (the check):
        ValueError: not a real number, or ``within`` false.
    """
    def check(name, value):
        if not _is_real(value):
            raise invalid(name, value, not_a_number)
        if not within(value):
            raise invalid(name, value, allowed)
        return value
    return check


def check_bool(name, value):
    """The check of a switch: True or False (NumPy's too).

    Raises:
        ValueError: anything else.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise invalid(name, value, "True or False")
    return value


def _check_output_kind(name, value):
    if not isinstance(value, RequestOutputKind):
        raise invalid(name, value, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
    return value


def _stop_list(stop) -> list:
    """``stop`` (None, a str, a list or tuple) as a list."""
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def _check_stop(name, stop):
    """A str, list or tuple of non-empty valid-Unicode strings; anything else (an int, a set,
    bytes) is a mistake that would otherwise surface far from here."""
    if stop is not None and (not isinstance(stop, (str, list, tuple)) or any(
            not isinstance(s, str) or s == "" for s in _stop_list(stop))):
        raise invalid(name, stop, "a non-empty string or a list of non-empty strings")
    for s in _stop_list(stop):
        check_unicode(s, f"SamplingParams.stop={s!r}")
    return stop


def _check_stop_token_ids(name, ids) -> list[int]:
    """A list or tuple of ids >= 0 -> a list of ints (None -> [])."""
    if ids is not None and not isinstance(ids, (list, tuple)):
        raise invalid(name, ids, "None or a list of integers >= 0")
    ids = [int(t) if _is_int(t) else t for t in ids or []]
    if any(not _is_int(t) or t < 0 for t in ids):
        raise invalid(name, ids, "a list of integers >= 0")
    return ids


def _check_logit_bias(name, bias):
    """``{token_id: bias}`` -> ids as ints, biases as floats, within OpenAI's limits."""
    if bias is None:
        return bias
    if not isinstance(bias, dict):
        raise invalid(name, bias, "None or a dict {token_id: bias}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(name, f"<{len(bias)} entries>", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    for t, b in bias.items():
        if not _is_int(t) or t < 0:
            raise invalid(name, bias, f"keyed by token ids >= 0, got key {t!r}")
        if not _is_real(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise invalid(name, bias, f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r} for token {t}")
    return {int(t): float(b) for t, b in bias.items()}


def logit_bias_from_json(bias: dict[str, float]) -> dict[int, float]:
    """A request's ``logit_bias`` (JSON object keys are strings) keyed by token ids.

    Raises:
        ValueError: a key that is not a decimal integer.
    """
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"SamplingParams.logit_bias={{{key!r}: {value}}} is invalid: keys must be "
                             "token ids (decimal integers)") from None
    return out


def _check_allowed_token_ids(name, ids):
    if ids is None:
        return ids
    if not isinstance(ids, (list, tuple)) or not ids:
        raise invalid(name, ids, "None or a non-empty list of token ids >= 0")
    if any(not _is_int(t) or t < 0 for t in ids):
        raise invalid(name, ids, "a non-empty list of token ids >= 0")
    return [int(t) for t in ids]


def _check_bad_words(name, words):
    if words is None:
        return words
    if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w.strip() for w in words):
        raise invalid(name, words, "None or a list of non-empty strings")
    for w in words:
        check_unicode(w, f"SamplingParams.bad_words={w!r}")
    return list(words)


def _check_structured_outputs(name, value):
    if value is not None:
        from refengine.structured_output import StructuredOutputsParams

        if not isinstance(value, StructuredOutputsParams):
            raise invalid(name, value, "None or a StructuredOutputsParams")
    return value


def _unique(ids: list[int]) -> list[int]:
    """``ids`` without repeats, in order."""
    return list(dict.fromkeys(ids))


LOGPROBS_ALLOWED = "None or an integer >= 0 (at most the engine's max_logprobs)"


# --- the parameters ---------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """Per-request sampling and stopping options, validated when built.

    Field names, meanings and defaults follow ``vllm.SamplingParams``. Each field is
    declared once (:func:`sampling_field`): its default, its check, its command-line flag
    and its server field.

    Attributes:
        n: number of completions to return for the prompt (>= 1).
        temperature: softmax temperature; ``0`` means greedy (argmax). >= 0.
        top_k: keep the k most likely tokens; ``0`` or ``-1`` turns it off.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1].
        min_p: drop tokens whose probability is below ``min_p`` times the top one; in [0, 1].
        seed: seed of this request's own random generator, in [0, 2**64 - 1] (None: fresh
            entropy).
        presence_penalty: subtracted once from the logit of every token already generated; [-2, 2].
        frequency_penalty: subtracted per occurrence in the generated text; [-2, 2].
        repetition_penalty: HF rule over prompt and output (positive logits divided,
            negative multiplied); > 0, 1 means off.
        max_tokens: most tokens to generate, >= 1 (None: until ``max_model_len``). ``0`` is
            rejected, as vLLM rejects it: every request samples at least one token.
        min_tokens: EOS and ``stop_token_ids`` are ignored until this many tokens exist.
        stop: a string or a list/tuple of strings that end generation when they appear
            in the output text (non-empty, valid Unicode).
        stop_token_ids: a list/tuple of token ids that end generation (kept in
            ``token_ids``, not in text); the engine checks them against the vocabulary.
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating past EOS.
        logprobs: number of top log-probabilities to return per sampled token (None: none);
            the engine refuses more than its ``max_logprobs`` (20 by default).
        prompt_logprobs: number of top log-probabilities to return per prompt token (None:
            none; 0: only the prompt token's own), from the raw model distribution (before
            temperature and penalties), as vLLM's: ``RequestOutput.prompt_logprobs``. The
            engine refuses more than its ``max_logprobs``.
        skip_special_tokens: leave special tokens out of the decoded text.
        output_kind: a :class:`RequestOutputKind`: whole outputs each step (the default),
            only what is new, or only the final output.
        logit_bias: ``{token_id: bias}`` added to the logits before any other processing
            but the masks below (OpenAI's field); ids >= 0 (the engine checks them against
            the vocabulary), biases in [-100, 100], at most 300 entries.
        allowed_token_ids: a non-empty list of ids; every other token's logit is -inf
            (vLLM's field; the engine checks the ids against the vocabulary and takes at
            most as many ids as the vocabulary has).
        bad_words: a list of non-empty strings never to generate: the last token of each
            word's tokens (as written and after a space) is -inf while the output ends with
            the tokens before it (vLLM's field; needs a tokenizer). The server takes at most
            256 words of at most 256 characters (``ServerLimits.max_bad_words``).
        structured_outputs: a :class:`refengine.structured_output.StructuredOutputsParams`
            (JSON schema, regex, choice, grammar or any JSON object) the output must
            match; the request ends (EOS) when it is complete (vLLM's field, earlier
            ``guided_decoding``). Needs llguidance and a tokenizer. The server takes at most
            1000 choices and 65536 characters of schema, regex, grammar or choices
            (``ServerLimits.max_structured_output_choices`` / ``_chars``).

    Raises:
        ValueError: a field of the wrong type (bools are not counts, NaN is not a number),
            the wrong container, or outside its allowed range; the message names the
            field, its value and the range.
    """

    n: int = sampling_field(1, check_int(1, "an integer >= 1"), api=ApiField("int"))
    temperature: float = sampling_field(
        1.0, check_number(lambda t: 0.0 <= t < math.inf, "a finite number >= 0 (0 means greedy)",
                          not_a_number="a finite number >= 0 (0 means greedy)"),
        flag=Flag("softmax temperature, >= 0; 0 is greedy (the CLI's default, so runs are reproducible)",
                  default=0.0),
        api=ApiField("float"))
    top_k: int = sampling_field(
        0, check_int(-1, "-1, 0 (off) or a positive integer"),
        flag=Flag("sample from the k most likely tokens (0 or -1: off)"), api=ApiField("int"))
    top_p: float = sampling_field(
        1.0, check_number(lambda p: 0.0 < p <= 1.0, "in (0, 1]"),
        flag=Flag("sample from the smallest set of tokens whose probabilities sum to this, in (0, 1]"),
        api=ApiField("float"))
    min_p: float = sampling_field(
        0.0, check_number(lambda p: 0.0 <= p <= 1.0, "in [0, 1]"),
        flag=Flag("drop tokens less likely than this times the most likely one, in [0, 1]"), api=ApiField("float"))
    seed: int | None = sampling_field(
        None, check_int(0, f"None or an integer in [0, {MAX_SEED}] (2**64 - 1)", maximum=MAX_SEED, optional=True),
        flag=Flag("seed of the sampler's random generator, in [0, 2**64 - 1]", show_default="fresh entropy"),
        api=ApiField("int"))
    presence_penalty: float = sampling_field(
        0.0, check_number(lambda p: -2.0 <= p <= 2.0, "in [-2, 2]"),
        flag=Flag("subtracted from the logit of every token already generated, in [-2, 2]"), api=ApiField("float"))
    frequency_penalty: float = sampling_field(
        0.0, check_number(lambda p: -2.0 <= p <= 2.0, "in [-2, 2]"),
        flag=Flag("subtracted per earlier occurrence of a token in the output, in [-2, 2]"), api=ApiField("float"))
    repetition_penalty: float = sampling_field(
        1.0, check_number(lambda p: 0.0 < p < math.inf, "finite and > 0 (1 means off)"),
        flag=Flag("divides the logits of tokens in the prompt or output, > 0 (1 is off)"), api=ApiField("float"))
    # max_tokens and logprobs: each endpoint reads its own (refengine/server/protocol.py)
    max_tokens: int | None = sampling_field(
        16, check_int(1, "None or an integer >= 1 (vLLM rejects 0 too)", optional=True),
        flag=Flag("most tokens to generate per answer (also capped by --max-model-len)", default=256),
        api=ApiField("int"))
    min_tokens: int = sampling_field(
        0, check_int(0, "an integer >= 0"),
        flag=Flag("generate at least this many tokens: EOS and --stop-token-ids are ignored until then"),
        api=ApiField("int"))
    stop: list[str] | str | None = sampling_field(
        None, _check_stop, flag=Flag("a string that ends the answer (repeatable)"), api=ApiField("str | list[str]"))
    stop_token_ids: list[int] | None = sampling_field(
        None, _check_stop_token_ids, flag=Flag("comma-separated token ids that end the answer"),
        api=ApiField("list[StrictInt]", convert=_unique))  # duplicates dropped
    include_stop_str_in_output: bool = sampling_field(
        False, check_bool, flag=Flag("keep the matched stop string at the end of the answer"), api=ApiField("bool"))
    ignore_eos: bool = sampling_field(False, check_bool, flag=Flag("keep generating past EOS"), api=ApiField("bool"))
    logprobs: int | None = sampling_field(
        None, check_int(0, LOGPROBS_ALLOWED, optional=True),
        flag=Flag("with generate --json: the log-probabilities of this many most likely tokens per generated token "
                  "(at most --max-logprobs)"),
        api=ApiField("int"))
    skip_special_tokens: bool = sampling_field(True, check_bool, api=ApiField("bool"))
    output_kind: RequestOutputKind = sampling_field(RequestOutputKind.CUMULATIVE, _check_output_kind)
    logit_bias: dict[int, float] | None = sampling_field(
        None, _check_logit_bias, api=ApiField("dict[str, float]", convert=logit_bias_from_json))
    allowed_token_ids: list[int] | None = sampling_field(
        None, _check_allowed_token_ids, api=ApiField("list[StrictInt]"))
    bad_words: list[str] | None = sampling_field(None, _check_bad_words, api=ApiField("list[str]"))
    # the server builds it from this field or OpenAI's response_format or vLLM's guided_*
    structured_outputs: "StructuredOutputsParams | None" = sampling_field(
        None, _check_structured_outputs, api=ApiField("dict"))
    prompt_logprobs: int | None = sampling_field(None, check_int(0, LOGPROBS_ALLOWED, optional=True))
    _stop: list[str] = field(init=False, repr=False, default_factory=list)
    # stop_token_ids as a set: the stop check runs per generated token
    _stop_token_id_set: frozenset = field(init=False, repr=False, compare=False, default=frozenset())
    # Built once per request by the engine's sampler (refengine/sampler.py), not every step:
    # bad_words as token sequences (with its tokenizer), allowed_token_ids as a [V] bool
    # mask of the tokens it leaves out, logit_bias as (V, ids, biases) arrays.
    _bad_words_token_ids: list[list[int]] | None = field(init=False, repr=False, compare=False, default=None)
    _disallowed_token_mask: np.ndarray | None = field(init=False, repr=False, compare=False, default=None)
    _logit_bias_arrays: tuple | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.init:
                setattr(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise invalid("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        self._stop = _stop_list(self.stop)
        self._stop_token_id_set = frozenset(self.stop_token_ids)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalised to a list."""
        return self._stop

    @property
    def stop_token_id_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set (the per-token stop check)."""
        return self._stop_token_id_set

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (``temperature == 0``) instead of sampling."""
        return self.temperature == 0.0
