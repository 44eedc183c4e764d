"""``config.json`` -> :class:`refengine.config.ModelConfig`, checked key by key.

Which architectures exist, and which extra fields each reads, is the model registry's
(:mod:`refengine.models.registry`); the generic keys are read here.
"""

from __future__ import annotations

import math
from pathlib import Path

from refengine.config import ModelConfig, check_key, read_json_object
from refengine.models.registry import get_model_class

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def model_config_from_dict(cfg: dict, source: str = "config.json") -> ModelConfig:
    """Build from a parsed ``config.json``, checking every key the engine reads.

    Args:
        cfg: the parsed file.
        source: the file's name or path, for error messages.
    Raises:
        ValueError: a required key is missing; a value has the wrong type or is out of
            range (sizes must be integers >= 1, ``rms_norm_eps`` and ``rope_theta``
            finite and > 0); the head counts do not divide (``num_attention_heads`` by
            ``num_key_value_heads``, ``hidden_size`` by ``num_attention_heads`` when
            ``head_dim`` is absent), ``head_dim`` is odd; the architecture (see
            :data:`refengine.models.registry.MODEL_REGISTRY`) or rope scaling type is not
            supported, a rope scaling field is missing or invalid (see
            :func:`_rope_scaling_from_config`). The message names ``source`` and the key.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: must hold a JSON object, got {type(cfg).__name__}")
    for key, (kind, required) in CONFIG_KEYS.items():
        check_key(cfg, key, kind, required, source)
    architectures = cfg.get("architectures")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise ValueError(f"{source}: 'architectures' must be a non-empty list of class names, "
                         f"got {architectures!r}")
    model_class = get_model_class(architectures)
    cfg = model_class.normalize_config(cfg)
    n_heads = cfg["num_attention_heads"]
    n_kv_heads = cfg.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise ValueError(f"{source}: 'num_attention_heads' ({n_heads}) must be a multiple of "
                         f"'num_key_value_heads' ({n_kv_heads}): each KV head serves a whole group of query heads")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if cfg["hidden_size"] % n_heads:
            raise ValueError(f"{source}: 'hidden_size' ({cfg['hidden_size']}) must be a multiple of "
                             f"'num_attention_heads' ({n_heads}) when 'head_dim' is not given")
        head_dim = cfg["hidden_size"] // n_heads
    if head_dim % 2:
        raise ValueError(f"{source}: the head size ({head_dim}) must be even: RoPE rotates pairs of dimensions")
    rope_scaling, rope_theta = _rope_scaling_from_config(cfg, head_dim, source)
    # the family's fields may also replace generic ones (Gemma 3's per-layer-type rope_parameters)
    return ModelConfig(**{
        "architecture": model_class.architecture,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(cfg.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(rope_theta if rope_theta is not None else 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings") or 2048,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "eos_token_id": cfg.get("eos_token_id"),
        **model_class.config_fields(cfg),
    })

def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``.

    Raises:
        FileNotFoundError: the directory or its ``config.json`` is missing.
        ValueError: ``config.json`` is not a JSON object or fails :func:`model_config_from_dict`'s
            checks; the message names the file and the key.
    """
    model_dir = Path(model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise FileNotFoundError(f"model path {str(model_dir)!r} is a file, not a model directory")
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} does not exist "
            "(`make weights` fetches the default model, or pass --model DIR)"
        )
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: a model directory needs a config.json")
    return model_config_from_dict(read_json_object(path), source=str(path))


# The config.json keys the engine reads: key -> (kind, required). Kinds: "count" an integer
# >= 1, "positive" a finite number > 0, "bool", "ids" a token id or a list of them, "object"
# a JSON object. An optional key set to null counts as absent (transformers writes nulls).
CONFIG_KEYS = {
    "vocab_size": ("count", True),
    "hidden_size": ("count", True),
    "intermediate_size": ("count", True),
    "num_hidden_layers": ("count", True),
    "num_attention_heads": ("count", True),
    "num_key_value_heads": ("count", False),
    "head_dim": ("count", False),
    "max_position_embeddings": ("count", False),
    "sliding_window": ("count", False),
    "rms_norm_eps": ("positive", False),
    "rope_theta": ("positive", False),
    "tie_word_embeddings": ("bool", False),
    "attention_bias": ("bool", False),
    "use_sliding_window": ("bool", False),
    "eos_token_id": ("ids", False),
    "rope_scaling": ("object", False),
    "rope_parameters": ("object", False),
}


def _rope_scaling_from_config(cfg: dict, head_dim: int, source: str) -> tuple[dict | None, float | None]:
    """``config.json``'s RoPE settings -> ``(rope_scaling, rope_theta)`` for :class:`ModelConfig`.

    ``rope_scaling`` (or transformers 5's ``rope_parameters``) is copied, its type normalised
    into ``rope_type`` (``type`` is the old key), and completed as transformers'
    ``standardize_rope_params`` and ``ROPE_INIT_FUNCTIONS`` complete it:

    * ``llama3``, ``yarn``, ``longrope``: a top-level ``original_max_position_embeddings``
      (Phi-3 keeps it there) replaces the dict's, as in transformers; ``yarn`` and
      ``longrope`` default it to ``max_position_embeddings``.
    * ``yarn``, ``longrope``: a missing ``factor`` becomes
      ``max_position_embeddings / original_max_position_embeddings``.
    * ``dynamic``: ``original_max_position_embeddings`` is set to ``max_position_embeddings``,
      the length transformers grows the base beyond (a value in the dict is replaced: transformers
      ignores it for this type).

    ``default`` returns None; ``rope_theta`` falls back to the dict's (transformers 5).
    A ``partial_rotary_factor`` (top level or in the dict) other than 1 is refused.

    Raises:
        ValueError: an unsupported rope scaling type, ``partial_rotary_factor`` != 1, or a
            field that :func:`_check_rope_scaling` refuses; the message names ``source`` and the key.
    """
    _check_partial_rotary(cfg.get("partial_rotary_factor"), source)
    rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope_theta = cfg.get("rope_theta")
    if rope_scaling is None:
        return None, rope_theta
    rope_scaling = dict(rope_scaling)
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    rope_scaling["rope_type"] = rope_type
    # transformers 5 moved rope_theta into rope_parameters
    if rope_theta is None:
        check_key(rope_scaling, "rope_theta", "positive", False, f"{source}: rope_parameters")
        rope_theta = rope_scaling.get("rope_theta")
    max_positions = cfg.get("max_position_embeddings") or 2048
    where = f"{source}: rope_scaling"
    if rope_type in ("llama3", "yarn", "longrope"):
        check_key(cfg, "original_max_position_embeddings", "count", False, source)
        if cfg.get("original_max_position_embeddings") is not None:
            rope_scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif rope_type != "llama3" and rope_scaling.get("original_max_position_embeddings") is None:
            rope_scaling["original_max_position_embeddings"] = max_positions
    if rope_type in ("yarn", "longrope") and rope_scaling.get("factor") is None:
        check_key(rope_scaling, "original_max_position_embeddings", "count", True, where)
        rope_scaling["factor"] = max_positions / rope_scaling["original_max_position_embeddings"]
    if rope_type == "dynamic":
        rope_scaling["original_max_position_embeddings"] = max_positions
    _check_rope_scaling(rope_scaling, source, head_dim)
    return (None if rope_type == "default" else rope_scaling), rope_theta


def _check_partial_rotary(value, where: str) -> None:
    """Refuse a ``partial_rotary_factor`` other than absent/null/1 (RoPE over part of the head)."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1):
        return
    raise ValueError(f"{where}: 'partial_rotary_factor' {value!r} is not supported: refengine rotates the "
                     "whole head (partial rotary embeddings are not implemented)")


def _check_number(rope_scaling: dict, key: str, where: str) -> None:
    """An optional finite number >= 0 (YaRN's ``mscale``/``mscale_all_dim``)."""
    value = rope_scaling.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a finite number >= 0, got {value!r}")


def _check_rope_scaling(rope_scaling: dict, source: str, head_dim: int) -> None:
    """The fields :func:`refengine.ops.layers.rope_frequencies` reads, per type: present where
    required, numbers it divides by or takes logs of finite and > 0, lengths integers >= 1,
    ``longrope``'s factor lists ``head_dim // 2`` finite numbers > 0; ``beta_fast >= beta_slow``
    (YaRN), ``high_freq_factor > low_freq_factor`` (llama3).

    Raises:
        ValueError: naming ``source``, the key and the value.
    """
    where = f"{source}: rope_scaling"
    rope_type = rope_scaling["rope_type"]
    _check_partial_rotary(rope_scaling.get("partial_rotary_factor"), where)
    if rope_type in ("linear", "llama3", "dynamic", "yarn", "longrope"):
        check_key(rope_scaling, "factor", "positive", True, where)
    if rope_type in ("dynamic", "yarn", "longrope"):
        check_key(rope_scaling, "original_max_position_embeddings", "count", True, where)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            check_key(rope_scaling, key, "positive", True, where)
        if rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
            raise ValueError(f"{where}: 'high_freq_factor' ({rope_scaling['high_freq_factor']}) must be greater "
                             f"than 'low_freq_factor' ({rope_scaling['low_freq_factor']})")
    if rope_type == "dynamic" and head_dim <= 2:
        raise ValueError(f"{where}: 'dynamic' scaling needs a head size > 2 (its exponent is d / (d - 2)), "
                         f"got {head_dim}")
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow", "attention_factor"):
            check_key(rope_scaling, key, "positive", False, where)
        for key in ("mscale", "mscale_all_dim"):
            _check_number(rope_scaling, key, where)
        truncate = rope_scaling.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise ValueError(f"{where}: 'truncate' must be true or false, got {truncate!r}")
        beta_fast, beta_slow = rope_scaling.get("beta_fast") or 32, rope_scaling.get("beta_slow") or 1
        if beta_fast < beta_slow:
            raise ValueError(f"{where}: 'beta_fast' ({beta_fast}) must be >= 'beta_slow' ({beta_slow}) "
                             "(defaults 32 and 1)")
    if rope_type == "longrope":
        check_key(rope_scaling, "attention_factor", "positive", False, where)
        for key in ("short_factor", "long_factor"):
            value = rope_scaling.get(key)
            if value is None:
                raise ValueError(f"{where}: required key {key!r} is missing (a list of head_dim // 2 = "
                                 f"{head_dim // 2} numbers > 0)")
            if not (isinstance(value, list) and len(value) == head_dim // 2
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                            for v in value)):
                shown = f"a list of {len(value)}" if isinstance(value, list) and len(value) != head_dim // 2 \
                    else repr(value)
                raise ValueError(f"{where}: {key!r} must be a list of head_dim // 2 = {head_dim // 2} finite "
                                 f"numbers > 0, got {shown}")
