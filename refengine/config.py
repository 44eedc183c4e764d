"""Model and engine configuration.

``ModelConfig`` reads a Hugging Face ``config.json`` (field names as in
``transformers.LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` / ``MistralConfig``).
``EngineConfig`` holds the serving knobs, named as vLLM names them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """The architecture facts the forward pass needs.

    Attributes mirror ``config.json``; ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    ``attention_bias`` is true for Qwen2 (q/k/v biases); ``qk_norm`` is true for Qwen3
    (per-head RMSNorm on q and k before RoPE). ``sliding_window`` is the attention window
    when the model uses one (not implemented: the engine caps ``max_model_len`` at it).
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
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed ``config.json``.

        Raises:
            ValueError: the architecture or rope scaling type is not supported; the
                message lists what is.
        """
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (config.json 'architectures': {archs}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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
        # Mistral sets sliding_window; Qwen2/3 only use theirs when use_sliding_window is true.
        window = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
            window = None
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        return cls(
            architecture=arch,
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
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
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


@dataclass
class EngineConfig:
    """Serving limits, with vLLM's names and meanings.

    Attributes:
        max_model_len: most tokens (prompt + output) one sequence may hold; None means
            the model's context, capped by what the KV pool can hold.
        block_size: tokens per KV cache block.
        max_num_seqs: most sequences running in one step.
        max_num_batched_tokens: per-step token budget (prefill chunks + decodes).
        enable_chunked_prefill: split prompts that do not fit the budget across steps;
            off means a prompt is prefilled whole in one step or waits.
        num_kv_blocks: explicit KV pool size in blocks (None: from ``kv_cache_memory``).
        kv_cache_memory: bytes for the KV pool on the CPU when ``num_kv_blocks`` is None.
        log_stats: log engine stats every few seconds while busy.
    """

    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 2 * 1024**3
    log_stats: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r} is invalid: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len!r} is invalid: must be >= 1")
