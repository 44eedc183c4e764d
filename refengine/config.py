"""Model and engine configuration: plain data, and the JSON file helpers.

``ModelConfig`` holds the architecture facts of a Hugging Face ``config.json`` (field
names as in ``transformers.LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` /
``MistralConfig``); :func:`refengine.models.hf_config.read_model_config` reads and checks
the file, with the model registry. ``EngineConfig`` and ``SchedulerConfig`` are the
resolved, frozen serving limits (built by :class:`refengine.engine_args.EngineArgs`, vLLM's
names). Nothing here imports the rest of refengine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

@dataclass
class ModelConfig:
    """The architecture facts the forward pass needs.

    Attributes mirror ``config.json``; ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    The model class of ``architecture`` (:mod:`refengine.models`) reads the family-specific
    fields (defaults: a plain Llama layer):

    * ``attention_bias``: q/k/v biases (Qwen2's default).
    * ``sliding_window``: keys per query (itself included) on the layers whose
      ``layer_types`` entry is ``"sliding_attention"``; ``layer_types`` None means every
      layer is ``"full_attention"``.
    * ``rope_local_base_freq``, ``rope_local_scaling``: the RoPE base and scaling of the
      sliding layers where they differ from the global ones (Gemma 3), else None.
    * ``query_pre_attn_scalar``: softmax scale ``query_pre_attn_scalar ** -0.5`` instead of
      ``head_dim ** -0.5`` (Gemma 2/3).
    * ``attn_logit_softcapping``, ``final_logit_softcapping``: ``c * tanh(x / c)`` on the
      attention scores and the final logits (Gemma 2), None for none.
    * ``hidden_activation``: the MLP gate's activation, ``"silu"`` or ``"gelu_pytorch_tanh"``.
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
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None
    rope_local_scaling: dict | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (0-based), None where it attends to every key."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


_ALLOWED = {"count": "an integer >= 1", "positive": "a finite number > 0", "bool": "true or false",
            "ids": "a token id (integer >= 0) or a list of them", "object": "a JSON object or null"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_key(cfg: dict, key: str, kind: str, required: bool, source: str) -> None:
    """Raise a ValueError naming ``source`` and ``key`` unless ``cfg[key]`` is of ``kind``:
    ``"count"`` an integer >= 1, ``"positive"`` a finite number > 0, ``"bool"``, ``"ids"`` a
    token id or a list of them, ``"object"`` a JSON object. A key set to null counts as absent."""
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
        check_key(cfg, key, "ids", False, str(path))
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
        attention_backend: :data:`refengine.attention.selector.ATTENTION_BACKENDS` entry.
        layer_ops: :data:`refengine.ops.LAYER_OPS` entry.
        num_threads: CPU threads (None: adaptive, :mod:`refengine.cpu.threads`).
        block_size: tokens per KV block. num_kv_blocks: pool size in blocks (None only
            before a GPU engine has measured its memory). bytes_per_block: one block
            across all layers, keys and values.
        enable_prefix_caching: reuse full KV blocks by content (:mod:`refengine.core.block_manager`).
        batch_invariant: the numba kernels in their batch-invariant mode (a row's logits the
            same bits whatever its step; :class:`refengine.cpu.layer_ops.NumbaOps`).
        activation_dtype: the input of the products with GGUF block weights, "auto" (float32)
            or "q8_0" (ggml's Q8_0 blocks, Q8_K for the K-quants, integer dot products;
            :mod:`refengine.cpu.q8_products`).
        enforce_eager: every step runs the model's forward; False: one-row decode steps on the
            numba backend are replayed from a recording of the forward (:mod:`refengine.cpu.capture`).
        gpu_memory_utilization: share of GPU memory the engine may use.
        max_logprobs: most ``SamplingParams.logprobs`` a request may ask for.
        log_stats: log per-request lines and periodic stats. trace: record step events.
        scheduler_config: the scheduler's limits (``max_model_len`` and the token budget).
        speculative_config: speculative decoding
            (:class:`refengine.spec_decode.SpeculativeConfig`), None when off.
        draft_model_config: the draft model's config (``method="draft_model"``), else None.
        draft_bytes_per_block: one block of the draft's KV cache (0 without a draft); the
            draft's pool has ``num_kv_blocks`` blocks too.
        kv_cache_dtype: KV cache storage, "auto" (``dtype``), "float16" (IEEE halves under
            float32 activations, the CPU), "int8" (with float32 scales per token and KV
            head) or "fp8_e4m3" / "fp8_e5m2" (a float scale per layer;
            :class:`refengine.attention.kv_cache.KVCache`); the draft's cache too.
        tensor_parallel_size: worker processes sharing every layer (:mod:`refengine.parallel`);
            1: the model runs in the engine's process.
        quantization: the target model's weights: None (float), "int8" (quantized at load),
            "awq" or "gptq" (the checkpoint's; :func:`refengine.quant.awq_gptq.resolve_quantization`).
        enable_lora: requests may run LoRA adapters (:mod:`refengine.lora`); max_lora_rank:
            the largest adapter rank.
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
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    batch_invariant: bool = False
    activation_dtype: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    enable_lora: bool = False
    max_lora_rank: int = 16

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
                "layer_ops": self.layer_ops, "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size,
                "num_kv_blocks": self.num_kv_blocks, "quantization": self.quantization,
                "batch_invariant": self.batch_invariant, "activation_dtype": self.activation_dtype,
                "enforce_eager": self.enforce_eager, "enable_lora": self.enable_lora,
                "tensor_parallel_size": self.tensor_parallel_size,
                **{k: getattr(self.scheduler_config, k) for k in ("max_num_seqs", "max_num_batched_tokens",
                                                                   "enable_chunked_prefill", "max_model_len")},
                "speculative_config": None if self.speculative_config is None else asdict(self.speculative_config)}
