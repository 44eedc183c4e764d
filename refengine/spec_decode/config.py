"""``speculative_config``: the engine option that turns speculative decoding on, validated.

Keys and defaults are vLLM's (``vllm/config/speculative.py``)::

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 3}
    ... plus, for either, "disable_by_batch_size": 8

Every bad key or value is a ``ValueError`` naming ``speculative_config``, the key and what
is allowed, raised when ``EngineArgs`` is built (before any model is read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding settings.

    Attributes:
        method: ``"ngram"`` (prompt lookup: proposals copied from the sequence itself) or
            ``"draft_model"`` (a smaller model with the same vocabulary proposes).
        num_speculative_tokens: k, most tokens proposed (and verified) per sequence per step, >= 1.
        prompt_lookup_max, prompt_lookup_min: n-gram sizes tried, longest first
            (``ngram`` only; 1 <= min <= max).
        model: the draft model directory (``draft_model`` only).
        disable_by_batch_size: no speculation in a step that starts with more running
            sequences than this (a large batch is compute-bound, so verifying k extra
            tokens per sequence is no longer almost free); None: always speculate.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        """Validate ``d`` (the ``speculative_config`` engine option) into a config.

        ``method`` may be left out when ``model`` is given (then ``"draft_model"``). For
        ``ngram``, a missing lookup bound takes the other's value, both missing take 5.

        Raises:
            ValueError: an unknown key, a missing one, a value of the wrong type or out of
                range, or a key that does not belong to the method; the message starts
                with ``speculative_config`` and names the key.
        """
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config={d!r} is invalid: must be a dict (a JSON object) "
                             f"with keys among {', '.join(_KEYS)}")
        unknown = sorted(set(d) - set(_KEYS), key=str)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"allowed keys: {', '.join(_KEYS)}")
        method = d.get("method")
        if method is None and d.get("model") is not None:
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(f"speculative_config['method']={method!r} is invalid: must be one of "
                             f"{', '.join(map(repr, METHODS))}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (an integer >= 1)")
        k = _int(d, "num_speculative_tokens", minimum=1)
        disable = _int(d, "disable_by_batch_size", minimum=1) if d.get("disable_by_batch_size") is not None else None
        if method == "ngram":
            if d.get("model") is not None:
                raise ValueError("speculative_config['model'] is for method 'draft_model', not 'ngram'")
            hi = _int(d, "prompt_lookup_max", minimum=1) if d.get("prompt_lookup_max") is not None else None
            lo = _int(d, "prompt_lookup_min", minimum=1) if d.get("prompt_lookup_min") is not None else None
            hi = hi if hi is not None else (lo if lo is not None else DEFAULT_PROMPT_LOOKUP)
            lo = lo if lo is not None else hi
            if lo > hi:
                raise ValueError(f"speculative_config['prompt_lookup_min']={lo} is invalid: must be <= "
                                 f"prompt_lookup_max={hi}")
            return cls("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo, disable_by_batch_size=disable)
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if d.get(key) is not None:
                raise ValueError(f"speculative_config[{key!r}] is for method 'ngram', not 'draft_model'")
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config['model']={model!r} is invalid: method 'draft_model' needs "
                             "the draft model's directory as a non-empty str")
        return cls("draft_model", k, model=model, disable_by_batch_size=disable)


def _int(d: dict, key: str, minimum: int) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:  # 3.0 is refused, not truncated
        raise ValueError(f"speculative_config[{key!r}]={value!r} is invalid: must be an integer >= {minimum}")
    return value
