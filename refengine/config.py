"""Model and engine configuration.

``ModelConfig`` reads a Hugging Face ``config.json`` (field names as in
``transformers.LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` / ``MistralConfig``).
``EngineConfig`` and ``SchedulerConfig`` are the resolved, frozen serving limits (built by
:class:`refengine.engine_args.EngineArgs`, vLLM's names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed ``config.json``.

        Raises:
            ValueError: the architecture (see :data:`refengine.models.MODEL_REGISTRY`) or
                rope scaling type is not supported; the message lists what is.
        """
        from refengine.models import get_model_class  # the registry imports this module

        model_class = get_model_class(cfg.get("architectures"))
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            rope_scaling["rope_type"] = rope_type
            # transformers 5 moved rope_theta into rope_parameters
            rope_theta = rope_theta if rope_theta is not None else rope_scaling.get("rope_theta")
            if rope_type == "default":
                rope_scaling = None
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        return cls(
            architecture=model_class.architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=cfg.get("eos_token_id"),
            **model_class.config_fields(cfg),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``model_dir/config.json``.

        Raises:
            FileNotFoundError: the directory or its ``config.json`` is missing.
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
        with open(path) as f:
            return cls.from_dict(json.load(f))


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
        block_size: tokens per KV block. num_kv_blocks: pool size in blocks (None only
            before a GPU engine has measured its memory). bytes_per_block: one block
            across all layers, keys and values.
        enable_prefix_caching: reuse full KV blocks by content (:mod:`refengine.kv_cache`).
        gpu_memory_utilization: share of GPU memory the engine may use.
        log_stats: log per-request lines and periodic stats. trace: record step events.
        scheduler_config: the scheduler's limits (``max_model_len`` and the token budget).
    """

    model_dir: Path
    model_config: ModelConfig
    device: str
    dtype: object
    attention_backend: str
    layer_ops: str
    block_size: int
    num_kv_blocks: int | None
    bytes_per_block: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    log_stats: bool
    trace: bool
    scheduler_config: SchedulerConfig

    @property
    def max_model_len(self) -> int | None:
        return self.scheduler_config.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler_config.max_num_batched_tokens
