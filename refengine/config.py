"""Model and engine configuration.

``ModelConfig`` reads a Hugging Face ``config.json`` (field names as in
``transformers.LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` / ``MistralConfig``).
``EngineConfig`` and ``SchedulerConfig`` are the resolved, frozen serving limits (built by
:class:`refengine.engine_args.EngineArgs`, vLLM's names).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """The architecture facts the forward pass needs.

    Attributes mirror ``config.json``; ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    The model class of ``architecture`` (:mod:`refengine.models`) reads the family-specific
    fields: ``attention_bias`` (q/k/v biases; Qwen2's default) and ``sliding_window`` (the
    attention window when the model uses one; not implemented: the engine caps
    ``max_model_len`` at it).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    sliding_window: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
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
                :data:`refengine.models.MODEL_REGISTRY`) or rope scaling type is not
                supported. The message names ``source`` and the key.
        """
        from refengine.models import get_model_class  # the registry imports this module

        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: must hold a JSON object, got {type(cfg).__name__}")
        for key, (kind, required) in CONFIG_KEYS.items():
            _check_key(cfg, key, kind, required, source)
        architectures = cfg.get("architectures")
        if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
            raise ValueError(f"{source}: 'architectures' must be a non-empty list of class names, "
                             f"got {architectures!r}")
        model_class = get_model_class(architectures)
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"{source}: unsupported rope scaling type {rope_type!r}; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}")
            rope_scaling["rope_type"] = rope_type
            # transformers 5 moved rope_theta into rope_parameters
            if rope_theta is None:
                _check_key(rope_scaling, "rope_theta", "positive", False, f"{source}: rope_parameters")
                rope_theta = rope_scaling.get("rope_theta")
            _check_rope_scaling(rope_scaling, source)
            if rope_type == "default":
                rope_scaling = None
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
        return cls(
            architecture=model_class.architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=cfg.get("eos_token_id"),
            **model_class.config_fields(cfg),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``model_dir/config.json``.

        Raises:
            FileNotFoundError: the directory or its ``config.json`` is missing.
            ValueError: ``config.json`` is not a JSON object or fails :meth:`from_dict`'s
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
        return cls.from_dict(read_json_object(path), source=str(path))


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
_ALLOWED = {"count": "an integer >= 1", "positive": "a finite number > 0", "bool": "true or false",
            "ids": "a token id (integer >= 0) or a list of them", "object": "a JSON object or null"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_key(cfg: dict, key: str, kind: str, required: bool, source: str) -> None:
    """Raise a ValueError naming ``source`` and ``key`` unless ``cfg[key]`` is of ``kind``."""
    value = cfg.get(key)
    if value is None:
        if required:
            raise ValueError(f"{source}: required key {key!r} is missing ({_ALLOWED[kind]})")
        return
    ok = {"count": lambda v: _is_int(v) and v >= 1,
          "positive": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
          "bool": lambda v: isinstance(v, bool),
          "ids": lambda v: (_is_int(v) and v >= 0) or (isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)),
          "object": lambda v: isinstance(v, dict)}[kind](value)
    if not ok:
        raise ValueError(f"{source}: {key!r} must be {_ALLOWED[kind]}, got {value!r}")


def _check_rope_scaling(rope_scaling: dict, source: str) -> None:
    """The numbers :func:`refengine.layers.rope_inv_freq` divides by must be finite and > 0."""
    where = f"{source}: rope_scaling"
    rope_type = rope_scaling["rope_type"]
    if rope_type in ("linear", "llama3"):
        _check_key(rope_scaling, "factor", "positive", True, where)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _check_key(rope_scaling, key, "positive", True, where)
        if rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
            raise ValueError(f"{where}: 'high_freq_factor' ({rope_scaling['high_freq_factor']}) must be greater "
                             f"than 'low_freq_factor' ({rope_scaling['low_freq_factor']})")


def read_json_object(path: str | Path) -> dict:
    """Parse a JSON file that must hold one object (``config.json``, ``tokenizer_config.json`` ...).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not UTF-8, not valid JSON (the message gives the line and
            column) or not a JSON object; the message names the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: must hold a JSON object ({{...}}), got a JSON {_json_kind(obj)}")
    return obj


def _json_kind(obj) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(obj), "number" if isinstance(obj, (int, float)) else type(obj).__name__)


def read_generation_config(model_dir: str | Path) -> dict:
    """``model_dir/generation_config.json`` parsed, or ``{}`` when the file is absent.

    Raises:
        ValueError: not a JSON object, or ``eos_token_id`` / ``bos_token_id`` /
            ``pad_token_id`` is not a token id or a list of them; names the file and key.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = read_json_object(path)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        _check_key(cfg, key, "ids", False, str(path))
    return cfg


@dataclass(frozen=True)
class SchedulerConfig:
    """The limits the scheduler works under (vLLM's ``SchedulerConfig``).

    Attributes:
        max_num_seqs: most sequences running in one step.
        max_num_batched_tokens: per-step token budget (prefill chunks + decodes).
        enable_chunked_prefill: split prompts that do not fit the budget across steps;
            off means a prompt is prefilled whole in one step or waits.
        max_model_len: most tokens (prompt + output) one sequence may hold.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int | None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine runs with, resolved from :class:`refengine.engine_args.EngineArgs`.

    Attributes:
        model_dir, model_config: the model.
        device: "cpu" or "cuda". dtype: NumPy dtype of weights and KV cache.
        attention_backend: :data:`refengine.attention.ATTENTION_BACKENDS` entry.
        layer_ops: :data:`refengine.ops.LAYER_OPS` entry.
        num_threads: CPU threads (None: adaptive, :mod:`refengine.threads`).
        block_size: tokens per KV block. num_kv_blocks: pool size in blocks (None only
            before a GPU engine has measured its memory). bytes_per_block: one block
            across all layers, keys and values.
        enable_prefix_caching: reuse full KV blocks by content (:mod:`refengine.kv_cache`).
        gpu_memory_utilization: share of GPU memory the engine may use.
        max_logprobs: most ``SamplingParams.logprobs`` a request may ask for.
        log_stats: log per-request lines and periodic stats. trace: record step events.
        scheduler_config: the scheduler's limits (``max_model_len`` and the token budget).
        speculative_config: speculative decoding
            (:class:`refengine.spec_decode.SpeculativeConfig`), None when off.
        draft_model_config: the draft model's config (``method="draft_model"``), else None.
        draft_bytes_per_block: one block of the draft's KV cache (0 without a draft); the
            draft's pool has ``num_kv_blocks`` blocks too.
    """

    model_dir: Path
    model_config: ModelConfig
    device: str
    dtype: object
    attention_backend: str
    layer_ops: str
    num_threads: int | None
    block_size: int
    num_kv_blocks: int | None
    bytes_per_block: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    max_logprobs: int
    log_stats: bool
    trace: bool
    scheduler_config: SchedulerConfig
    speculative_config: object | None = None
    draft_model_config: ModelConfig | None = None
    draft_bytes_per_block: int = 0

    @property
    def max_model_len(self) -> int | None:
        return self.scheduler_config.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler_config.max_num_batched_tokens

    def summary(self) -> dict:
        """The resolved settings as a JSON-ready dict (what benchmarks record)."""
        return {"model_dir": str(self.model_dir), "architecture": self.model_config.architecture,
                "device": self.device, "dtype": str(self.dtype), "attention_backend": self.attention_backend,
                "layer_ops": self.layer_ops, "block_size": self.block_size, "num_kv_blocks": self.num_kv_blocks,
                **{k: getattr(self.scheduler_config, k) for k in ("max_num_seqs", "max_num_batched_tokens",
                                                                   "enable_chunked_prefill", "max_model_len")},
                "speculative_config": None if self.speculative_config is None else asdict(self.speculative_config)}
