"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

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


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options, validated when built.

    Field names, meanings and defaults follow ``vllm.SamplingParams``.

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
            (vLLM's field; the engine checks the ids against the vocabulary).
        bad_words: a list of non-empty strings never to generate: the last token of each
            word's tokens (as written and after a space) is -inf while the output ends with
            the tokens before it (vLLM's field; needs a tokenizer).
        structured_outputs: a :class:`refengine.structured_output.StructuredOutputsParams`
            (JSON schema, regex, choice, grammar or any JSON object) the output must
            match; the request ends (EOS) when it is complete (vLLM's field, earlier
            ``guided_decoding``). Needs llguidance and a tokenizer.

    Raises:
        ValueError: a field of the wrong type (bools are not counts, NaN is not a number),
            the wrong container, or outside its allowed range; the message names the
            field, its value and the range.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: "StructuredOutputsParams | None" = None
    prompt_logprobs: int | None = None
    _stop: list[str] = field(init=False, repr=False, default_factory=list)
    # stop_token_ids as a set: the stop check runs per generated token
    _stop_token_id_set: frozenset = field(init=False, repr=False, compare=False, default=frozenset())
    # bad_words as token sequences, filled by the engine's sampler with its tokenizer
    _bad_words_token_ids: list[list[int]] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        def bad(name: str, value, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")

        def is_int(v) -> bool:  # bool is an int subclass, but True is not a count
            return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))

        def is_real(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and not math.isnan(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not is_real(getattr(self, name)):
                raise bad(name, getattr(self, name), "a number")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", self.seed, f"None or an integer in [0, {MAX_SEED}] (2**64 - 1)")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "-1, 0 (off) or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", self.repetition_penalty, "finite and > 0 (1 means off)")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "None or an integer >= 1 (vLLM rejects 0 too)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "None or an integer >= 0 (at most the engine's max_logprobs)")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", self.prompt_logprobs,
                      "None or an integer >= 0 (at most the engine's max_logprobs)")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise bad(name, getattr(self, name), "True or False")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        # Containers: a str, list or tuple; anything else (an int, a set, bytes) is a mistake
        # that would otherwise surface far from here.
        if self.stop is None:
            self._stop = []
        elif isinstance(self.stop, str):
            self._stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self._stop = list(self.stop)
        else:
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if any((not isinstance(s, str)) or s == "" for s in self._stop):
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        for s in self._stop:
            check_unicode(s, f"SamplingParams.stop={s!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", self.stop_token_ids, "None or a list of integers >= 0")
        self.stop_token_ids = [int(t) if is_int(t) else t for t in self.stop_token_ids or []]
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of integers >= 0")
        self._stop_token_id_set = frozenset(self.stop_token_ids)
        self._check_logits_processing(bad, is_int, is_real)

    def _check_logits_processing(self, bad, is_int, is_real) -> None:
        """logit_bias, allowed_token_ids, bad_words, structured_outputs (normalised: ids to
        ints, biases to floats)."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "None or a dict {token_id: bias}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise bad("logit_bias", f"<{len(self.logit_bias)} entries>",
                          f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
            for t, b in self.logit_bias.items():
                if not is_int(t) or t < 0:
                    raise bad("logit_bias", self.logit_bias, f"keyed by token ids >= 0, got key {t!r}")
                if not is_real(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", self.logit_bias,
                              f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r} for token {t}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids >= 0")
            if any(not is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise bad("bad_words", self.bad_words, "None or a list of non-empty strings")
            for w in self.bad_words:
                check_unicode(w, f"SamplingParams.bad_words={w!r}")
            self.bad_words = list(self.bad_words)
        if self.structured_outputs is not None:
            from refengine.structured_output import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")

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
