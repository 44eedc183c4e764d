"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from refengine.text import check_unicode

# Seeds are those of NumPy's generators, which take non-negative integers; 64 bits is the
# range vLLM (torch) accepts.
MAX_SEED = 2**64 - 1


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
        skip_special_tokens: leave special tokens out of the decoded text.

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
    _stop: list[str] = field(init=False, repr=False, default_factory=list)

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
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise bad(name, getattr(self, name), "True or False")
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

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalised to a list."""
        return self._stop

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (``temperature == 0``) instead of sampling."""
        return self.temperature == 0.0
