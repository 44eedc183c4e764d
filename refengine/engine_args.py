"""Every engine option, declared once: :class:`EngineArgs` (vLLM's name and knob names).

Each field carries its default, its help text and its validation. The same declaration
generates the click options of every command that builds an engine (``generate``,
``chat``, ``bench``, ``serve``: :meth:`EngineArgs.cli_options`), and
:meth:`EngineArgs.create_engine_config` resolves it, before anything is allocated, into
the frozen :class:`refengine.config.EngineConfig` the engine runs with: the device and
array module, the dtype, the attention backend and layer operations, the KV pool size,
``max_model_len`` (from the model and the pool) and the per-step token budget.

Every invalid value or combination is a ``ValueError`` that names the values and the limit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refengine.attention.kv_cache import KV_CACHE_DTYPES, KVCache, cdiv
from refengine.config import EngineConfig, ModelConfig, SchedulerConfig
from refengine.formats.gguf_file import is_gguf, open_gguf
from refengine.models.hf_config import model_config_from_dict, read_model_config
from refengine.quant.awq_gptq import QUANTIZATIONS, resolve_quantization
from refengine.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("refengine")

DEFAULT_MODEL = "weights/SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEVICES = ("cpu", "cuda", "auto")
#: ``--dtype`` choices; bfloat16 is ``ml_dtypes.bfloat16``, imported only when asked for (not
#: every engine's start-up).
DTYPES = ("float32", "float16", "bfloat16")
# Which attention backends run on which device, and the layer operations that go with them.
BACKENDS = {"numpy": "cpu", "numba": "cpu", "cuda-emulated": "cpu", "cuda": "cuda"}
LAYER_OPS_FOR_BACKEND = {"numpy": "numpy", "numba": "numba", "cuda-emulated": "numpy", "cuda": "cuda"}
#: ``quantization`` values whose products have CUDA kernels (refengine/ops/cuda.py): all of them.
CUDA_QUANTIZATIONS = QUANTIZATIONS
DEFAULT_BATCHED_TOKENS = 2048
#: Attention backends that read an int8 KV cache (``kv_cache_dtype="int8"``).
INT8_KV_BACKENDS = ("numpy", "numba", "cuda", "cuda-emulated")
#: Attention backends that read an fp8 KV cache (``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``).
FP8_KV_BACKENDS = ("cuda", "cuda-emulated")
#: Attention backends that read a float16 KV cache under float32 activations
#: (``kv_cache_dtype="float16"``; a GPU keeps its cache in ``dtype``: float16 there is
#: ``dtype="float16"``).
FLOAT16_KV_BACKENDS = ("numpy", "numba")


def _option(help: str, *, metavar: str | None = None, choices=None, flag: str | None = None,
            minimum: float | None = None, maximum: float | None = None, positive: bool = False,
            cli: bool = True) -> dict:
    """Field metadata: CLI help and validation (``minimum``/``maximum`` inclusive,
    ``positive``: strictly above 0; ``flag``: an inverted switch's name; ``cli``: whether
    commands get a flag for it)."""
    return {"help": help, "metavar": metavar, "choices": choices, "flag": flag, "minimum": minimum,
            "maximum": maximum, "positive": positive, "cli": cli}


#: Short names of the models ``make weights`` fetches -> where the fetch scripts put them.
MODEL_ALIASES = {"smollm2-135m": DEFAULT_MODEL, "gemma3-270m": "weights/gemma-3-270m-q4_k_m.gguf"}


#: ``activation_dtype`` values: the products' float32 input, or ggml's Q8_0 blocks (Q8_K for the
#: K-quants; :mod:`refengine.cpu.q8_products`).
ACTIVATION_DTYPES = ("auto", "q8_0")


def _local_or_checkout(path: str) -> Path:
    """``path`` under the current directory if it exists there, else under this checkout."""
    return Path(path) if Path(path).exists() else REPO_ROOT / path


def resolve_model_dir(model: str | os.PathLike | None, gguf_file: str | None = None) -> Path:
    """``model``, else ``$REFENGINE_MODEL``, else the default model (``weights/SmolLM2-135M-Instruct``
    under the current directory, then under this checkout), as a local path.

    In order: a path that exists is that path; a name of :data:`MODEL_ALIASES`
    (``gemma3-270m``) names the file its fetch script writes; a Hugging Face Hub name
    (``org/name[@revision]``, ``org/name/x.gguf``, or ``org/name`` with ``gguf_file``) is
    resolved through the Hugging Face cache, downloading where the Hub is reachable
    (:func:`refengine.hub.resolve_hub_model`); anything else is returned as a path (whose
    absence the loader reports).

    Raises:
        FileNotFoundError: a Hub name that is neither cached nor downloadable (the message
            names the repository, the revision, what is missing and the cache).
        ValueError: ``gguf_file`` with a local path or an alias (it names a file of a Hub
            repository), or a bad ``gguf_file`` (:func:`refengine.hub.parse_hub_id`).
    """
    from refengine.hub import parse_hub_id, resolve_hub_model

    model = model or os.environ.get("REFENGINE_MODEL")
    if not model:
        path = _local_or_checkout(DEFAULT_MODEL)
    elif Path(model).exists():
        path = Path(model)
    elif str(model) in MODEL_ALIASES:
        path = _local_or_checkout(MODEL_ALIASES[str(model)])
    else:
        hub = parse_hub_id(os.fspath(model), gguf_file)
        if hub is not None:
            return resolve_hub_model(hub, local_path_tried=os.fspath(model))
        path = Path(model)
    if gguf_file is not None:
        raise ValueError(f"gguf_file={gguf_file!r} names a file of a Hugging Face repository, but "
                         f"model={str(model)!r} is a local path; give the .gguf file's path as model instead")
    return path


def default_served_model_name(model: str | os.PathLike | None, model_dir: Path) -> str:
    """The name a server answers to when ``--served-model-name`` is not given: a Hub name as
    typed (``Qwen/Qwen2.5-0.5B-Instruct``, as vLLM serves under its ``--model``), else the
    model directory's (or GGUF file's) name. ``model_dir``: what :func:`resolve_model_dir` gave."""
    from refengine.hub import parse_hub_id

    model = model or os.environ.get("REFENGINE_MODEL")
    if model and not Path(model).exists() and str(model) not in MODEL_ALIASES and parse_hub_id(os.fspath(model)):
        return os.fspath(model)
    return model_dir.name


@dataclass
class EngineArgs:
    """The options of :class:`refengine.core.engine.LLMEngine` and ``LLM(...)``, with vLLM's names.

    Raises (on construction):
        ValueError: a value of the wrong type or out of range; the message names the
            option, the value and the allowed range.
    """

    model: str | None = field(default=None, metadata=_option(
        "model directory, .gguf file, short name (smollm2-135m, gemma3-270m) or Hugging Face Hub name "
        "(org/name[@revision], org/name/file.gguf[@revision]; through the HF cache, HF_HUB_OFFLINE honoured) "
        "(default: $REFENGINE_MODEL or weights/SmolLM2-135M-Instruct)",
        metavar="PATH|ORG/NAME"))
    gguf_file: str | None = field(default=None, metadata=_option(
        "a .gguf file of the Hub repository --model names (transformers' gguf_file): --model org/name "
        "--gguf-file name.Q4_K_M.gguf (default: none, the repository's safetensors)", metavar="FILE"))
    device: str = field(default="cpu", metadata=_option(
        "where the model runs (auto: a GPU when CuPy finds one)", choices=DEVICES))
    dtype: str = field(default="auto", metadata=_option(
        "weights and KV cache (auto: float32 on the CPU, bfloat16 on a GPU; a GGUF file's tensors as stored, "
        "an explicit dtype dequantizes them)", choices=("auto", *DTYPES)))
    quantization: str | None = field(default=None, metadata=_option(
        "weight quantization (vLLM's name; CPU and CUDA): int8 (per-output-channel symmetric, computed at load from a "
        "float checkpoint or a GGUF file's dequantized blocks), awq or gptq (4-bit checkpoints, detected from config.json's quantization_config, "
        "which the value must match); default: as the checkpoint is", choices=QUANTIZATIONS))
    activation_dtype: str = field(default="auto", metadata=_option(
        "input of the products with a GGUF file's block-quantized weights (numba backend): auto "
        "(float32, the weights' exact product) or q8_0 (llama.cpp's scheme: each row rounded to ggml's Q8_0 blocks, "
        "Q8_K for the K-quants Q4_K/Q5_K/Q6_K, integer dot products, llama.cpp's numerics, at the cost of that "
        "rounding: docs/quantization.md#activations-activation_dtypeq8_0)",
        choices=ACTIVATION_DTYPES))
    attention_backend: str | None = field(default=None, metadata=_option(
        "how attention (and the layer ops) are computed: numpy, numba (compiled CPU kernels) or cuda-emulated "
        "on the CPU, cuda on a GPU (default: numba on the CPU, the faster there, measured; numpy when numba "
        "is not installed; cuda on a GPU)", choices=tuple(BACKENDS)))
    batch_invariant: bool | None = field(default=None, metadata=_option(
        "bitwise batch-invariant logits (vLLM's VLLM_BATCH_INVARIANT): a sequence's logits are the same bits "
        "whatever else is in its step, however its prompt is chunked, whether its prefix came from the cache, "
        "on any number of threads; costs prefill speed (docs/engine_options.md#batch-invariance-batch_invariant) "
        "(default: on with the numba backend, the only one that has it)"))
    enforce_eager: bool = field(default=False, metadata=_option(
        "run every step through the model's forward (vLLM's name): no one-row decode steps replayed from "
        "bound kernels on the numba backend (the same bits, less Python per step: docs/cpu_runtime.md#captured-decode-steps)"))
    max_model_len: int | None = field(default=None, metadata=_option(
        "most tokens per sequence, prompt + output (default: the model's context, capped by the KV pool)",
        minimum=1))
    block_size: int = field(default=16, metadata=_option("tokens per KV cache block", minimum=1))
    max_num_seqs: int = field(default=256, metadata=_option("most sequences in one step", minimum=1))
    max_num_batched_tokens: int | None = field(default=None, metadata=_option(
        f"per-step token budget (default: {DEFAULT_BATCHED_TOKENS}; without chunked prefill at least "
        "max_model_len)", minimum=1))
    enable_chunked_prefill: bool = field(default=True, metadata=_option(
        "split prompts longer than the token budget across steps"))
    enable_prefix_caching: bool = field(default=True, metadata=_option(
        "reuse the KV blocks of earlier requests that share a prefix with the prompt"))
    num_kv_blocks: int | None = field(default=None, metadata=_option(
        "KV pool size in blocks (default: from --kv-cache-memory on the CPU, --gpu-memory-utilization on a GPU)",
        minimum=1))
    kv_cache_dtype: str = field(default="auto", metadata=_option(
        "KV cache storage (vLLM's names): auto (the dtype); float16 (IEEE half values, llama.cpp's default f16 "
        "cache: half the float32 bytes, each value rounded to nearest once; numpy and numba backends); int8 "
        "(int8 values and a float32 scale per token "
        "and KV head, LMDeploy's scheme: about 3.8x the float32 blocks in the same memory; every backend); "
        "fp8_e4m3 or fp8_e5m2 (one fp8 byte per value, x / scale with a per-layer scale, vLLM's scheme: 2x the "
        "16-bit blocks; cuda and cuda-emulated backends)",
        choices=KV_CACHE_DTYPES))
    kv_cache_memory: int = field(default=2 * 1024**3, metadata=_option(
        "bytes for the KV pool on the CPU (allocated lazily)", minimum=1))
    gpu_memory_utilization: float = field(default=0.9, metadata=_option(
        "share of GPU memory the engine may use, in (0, 1]", positive=True, maximum=1.0))
    num_threads: int | None = field(default=None, metadata=_option(
        "CPU threads for BLAS and the numba kernels (default: the usable cores, fewer while other processes "
        "keep some busy)", minimum=1))
    tensor_parallel_size: int = field(default=1, metadata=_option(
        "worker processes that each hold 1/N of every layer's weights and KV heads (Megatron-style splits, one "
        "all-reduce after each attention and MLP block): MPI collectives between CPU processes, NCCL between "
        "GPUs (one each); needs refengine[distributed] (docs/distributed.md)", minimum=1))
    enable_lora: bool = field(default=False, metadata=_option(
        "serve PEFT LoRA adapters over the model (vLLM's name): requests name one (LoRARequest; serve's "
        "--lora-modules), rows of different adapters and of none share a step, the weights are never merged "
        "(docs/engine_options.md#lora-adapters)"))
    max_lora_rank: int = field(default=16, metadata=_option(
        "largest rank r a LoRA adapter may have (vLLM's name and default)", minimum=1))
    max_logprobs: int = field(default=20, metadata=_option(
        "most log-probabilities a request may ask for per generated token (the logprobs sampling option)", minimum=0))
    speculative_config: dict | None = field(default=None, metadata=_option(
        "speculative decoding, a JSON object with vLLM's keys: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} or {\"method\": \"draft_model\", \"model\": DIR, "
        "\"num_speculative_tokens\": 3}; optional \"disable_by_batch_size\": N (default: off)", metavar="JSON"))
    log_stats: bool = field(default=True, metadata=_option(
        "no per-request and periodic stats logging", flag="--disable-log-stats"))
    trace: bool = field(default=False, metadata=_option(
        "record per-step events for a Chrome trace (EngineMetrics.write_trace; bench's --trace PATH)",
        cli=False))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name))
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # keys and values, before any file is read
        budget, max_len = self.max_num_batched_tokens, self.max_model_len
        if not self.enable_chunked_prefill and budget is not None and max_len is not None:
            _check_budget(budget, max_len)

    # --- construction from keyword arguments and from the command line ----------------
    @classmethod
    def from_kwargs(cls, model=None, **kwargs) -> "EngineArgs":
        """``EngineArgs(model, **kwargs)`` with a clear error for an unknown option.

        Raises:
            ValueError: an option that is not an engine option (the message lists them),
                or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; "
                             f"engine options are: {', '.join(sorted(known))}")
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        return cls(model=model, **kwargs)

    @classmethod
    def cli_options(cls, f):
        """Decorate a click command with one option per field (``--max-model-len`` ...).

        The command receives them as keyword arguments; :meth:`from_cli` takes them back.
        """
        import click

        for fld in reversed([f for f in dataclasses.fields(cls) if f.metadata["cli"]]):
            meta = fld.metadata
            name = fld.name.replace("_", "-")
            if fld.type in ("bool", bool, "bool | None"):
                if meta["flag"]:  # an inverted switch named as vLLM names it
                    option = click.option(meta["flag"], f"cli_{fld.name}", is_flag=True, show_default="off",
                                          help=meta["help"])
                else:
                    option = click.option(f"--{name}/--no-{name}", f"cli_{fld.name}", default=fld.default,
                                          show_default=fld.default is not None, help=meta["help"])
            else:
                if meta["choices"]:
                    type_ = click.Choice(meta["choices"])
                else:
                    type_ = _python_type(fld)
                    type_ = _json_object_type() if type_ is dict else type_
                option = click.option(f"--{name}", f"cli_{fld.name}", type=type_, default=fld.default,
                                      show_default=fld.default is not None, metavar=meta["metavar"],
                                      help=meta["help"])
            f = option(f)
        return f

    @classmethod
    def from_cli(cls, kw: dict) -> "EngineArgs":
        """Take this class's options out of a click command's keyword arguments (``kw`` is
        left with the command's own options).

        Raises:
            ValueError: an invalid value (as the constructor).
        """
        values = {}
        for fld in [f for f in dataclasses.fields(cls) if f.metadata["cli"]]:
            value = kw.pop(f"cli_{fld.name}")
            if fld.metadata["flag"]:
                value = not value  # --disable-log-stats sets log_stats=False
            values[fld.name] = value
        return cls(**values)

    # --- resolution ---------------------------------------------------------------------
    def model_config(self) -> tuple[Path, ModelConfig]:
        """``(model directory or GGUF file, its ModelConfig)``.

        Raises:
            FileNotFoundError: the directory or its config.json is missing, or a Hub name is
                neither cached nor downloadable (:func:`resolve_model_dir`).
            ValueError: an unsupported or invalid config.json (or GGUF metadata).
        """
        model_dir = resolve_model_dir(self.model, self.gguf_file)
        if is_gguf(model_dir):  # config, tokenizer and tensors all come from the one file
            return model_dir, model_config_from_dict(open_gguf(model_dir).config, source=str(model_dir))
        return model_dir, read_model_config(model_dir)

    def create_engine_config(self, model_dir: Path, model_config: ModelConfig,
                             num_gpu_blocks: int | None = None) -> EngineConfig:
        """Resolve every option against the model into the frozen config the engine runs with.

        Args:
            model_dir, model_config: from :meth:`model_config`.
            num_gpu_blocks: on a GPU without ``num_kv_blocks``, the pool the engine measured
                after loading the weights; until then (None) the pool-dependent fields
                (``num_kv_blocks``, ``max_model_len``) are left unresolved and every other
                check runs.
        Raises:
            ValueError: a device/backend mismatch, a dtype the device cannot run, a
                ``kv_cache_dtype`` the backend cannot read, a ``quantization`` the checkpoint
                or the device does not allow, a pool
                smaller than one block or (on the CPU) larger than the machine's memory, ``max_model_len`` beyond the model's context, the
                pool or the sliding window, or a token budget that cannot hold a prompt
                without chunked prefill; the message names the values.
            RuntimeError: ``device="cuda"`` without a usable CuPy and GPU.
        """
        mc = model_config
        spec = SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config is not None else None
        draft = _draft_model_config(spec, mc)
        device = resolve_device(self.device)
        backend = self.attention_backend or ("cuda" if device == "cuda" else default_cpu_backend())
        if BACKENDS[backend] != device:
            raise ValueError(f"attention_backend={backend!r} runs on device={BACKENDS[backend]!r}, not on "
                             f"device={device!r}; on {device!r} use one of "
                             f"{[b for b, d in BACKENDS.items() if d == device]}")
        dtype = resolve_dtype(self.dtype, device)
        batch_invariant = resolve_batch_invariant(self.batch_invariant, backend)
        quantization = resolve_quantization(self.quantization, model_dir)
        # device="cuda" runs int8 and int4 (AWQ, GPTQ) weights as stored: cuda/quant_matmul.cu
        if quantization is not None and device != "cpu" and quantization not in CUDA_QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r} runs on the CPU only, not on device={device!r}; "
                             f"on {device!r} use one of {CUDA_QUANTIZATIONS}")
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, backend)
        activation_dtype = resolve_activation_dtype(self.activation_dtype, backend, model_dir, self.dtype, quantization)
        if self.tensor_parallel_size > 1:
            check_tensor_parallel(self.tensor_parallel_size, mc, device, spec)
            if self.enable_lora:
                raise ValueError(f"enable_lora=True runs in one process: the adapters are not split over "
                                 f"tensor_parallel_size={self.tensor_parallel_size} workers")
        per_block = KVCache.bytes_per_block(mc.num_hidden_layers, self.block_size, mc.num_key_value_heads,
                                            mc.head_dim, dtype.itemsize, kv_dtype)
        # a draft model's cache has as many blocks as the target's (it shares the block tables)
        draft_per_block = 0 if draft is None else KVCache.bytes_per_block(
            draft.num_hidden_layers, self.block_size, draft.num_key_value_heads, draft.head_dim, dtype.itemsize, kv_dtype)
        num_blocks = self.num_kv_blocks
        if num_blocks is None and device == "cpu":
            if self.kv_cache_memory < per_block + draft_per_block:
                raise ValueError(f"kv_cache_memory={self.kv_cache_memory} bytes holds no KV block: one block of "
                                 f"block_size={self.block_size} tokens takes {per_block + draft_per_block} bytes "
                                 f"for this model" + (" and its draft model" if draft_per_block else ""))
            num_blocks = self.kv_cache_memory // (per_block + draft_per_block)
        elif num_blocks is None:
            num_blocks = num_gpu_blocks
        memory = _physical_memory() if device == "cpu" else None
        if memory and num_blocks * (per_block + draft_per_block) > memory:  # np.zeros would fail, or the OS kill us
            which = (f"num_kv_blocks={self.num_kv_blocks}" if self.num_kv_blocks is not None
                     else f"kv_cache_memory={self.kv_cache_memory}")
            raise ValueError(f"{which} makes a KV pool of {num_blocks * (per_block + draft_per_block) / 2**30:.1f} GiB "
                             f"({num_blocks} blocks of {per_block + draft_per_block} bytes), more than this machine's "
                             f"{memory / 2**30:.1f} GiB of memory")
        max_model_len = self.max_model_len
        if max_model_len is not None and max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context "
                             f"(max_position_embeddings={mc.max_position_embeddings} in config.json)")
        if num_blocks is not None:
            max_model_len = self._fit_pool(max_model_len, mc, num_blocks)
        if draft is not None and max_model_len is not None and max_model_len > draft.max_position_embeddings:
            if self.max_model_len is not None:
                raise ValueError(f"max_model_len={max_model_len} exceeds the draft model's context "
                                 f"(max_position_embeddings={draft.max_position_embeddings} in "
                                 f"{Path(spec.model) / 'config.json'})")
            logger.warning("capping max_model_len at the draft model's context (%d)", draft.max_position_embeddings)
            max_model_len = draft.max_position_embeddings
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_BATCHED_TOKENS if self.enable_chunked_prefill else max(
                DEFAULT_BATCHED_TOKENS, max_model_len or mc.max_position_embeddings)
        elif not self.enable_chunked_prefill and max_model_len is not None:
            _check_budget(budget, max_model_len)
        return EngineConfig(
            model_dir=model_dir, model_config=mc, device=device, dtype=dtype, attention_backend=backend,
            layer_ops=LAYER_OPS_FOR_BACKEND[backend], num_threads=self.num_threads, block_size=self.block_size,
            num_kv_blocks=num_blocks, bytes_per_block=per_block, kv_cache_dtype=kv_dtype, quantization=quantization,
            enable_prefix_caching=self.enable_prefix_caching, batch_invariant=batch_invariant,
            enforce_eager=self.enforce_eager,
            activation_dtype=activation_dtype, gpu_memory_utilization=self.gpu_memory_utilization,
            max_logprobs=self.max_logprobs, log_stats=self.log_stats, trace=self.trace,
            scheduler_config=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                                             enable_chunked_prefill=self.enable_chunked_prefill,
                                             max_model_len=max_model_len),
            speculative_config=spec, draft_model_config=draft, draft_bytes_per_block=draft_per_block,
            tensor_parallel_size=self.tensor_parallel_size, enable_lora=self.enable_lora,
            max_lora_rank=self.max_lora_rank)

    def _fit_pool(self, max_model_len: int | None, mc: ModelConfig, num_blocks: int) -> int:
        pool_tokens = num_blocks * self.block_size
        if max_model_len is None:
            return min(mc.max_position_embeddings, pool_tokens)
        if max_model_len > pool_tokens:
            memory = ("num_kv_blocks" if self.num_kv_blocks is not None else
                      "kv_cache_memory" if self.device == "cpu" else "gpu_memory_utilization")
            raise ValueError(f"max_model_len={max_model_len} needs {cdiv(max_model_len, self.block_size)} KV blocks "
                             f"but the pool holds {num_blocks} ({pool_tokens} tokens); lower max_model_len or "
                             f"raise {memory}")
        return max_model_len


def check_tensor_parallel(n: int, mc: ModelConfig, device: str, spec: SpeculativeConfig | None) -> None:
    """Whether ``tensor_parallel_size=n`` can run this model here.

    Raises:
        ValueError: a family that has no tensor-parallel split, head counts that do not split
            (:func:`refengine.parallel.plan_partitions`), a draft model (its own weights are
            not split), or on a GPU fewer devices than workers; the message names the values.
    """
    from refengine.models.registry import MODEL_REGISTRY
    from refengine.parallel.tensor_parallel import plan_partitions

    if not MODEL_REGISTRY[mc.architecture].supports_tensor_parallel:
        raise ValueError(f"tensor_parallel_size={n}: {mc.architecture} has no tensor-parallel split "
                         "(its q/k norms span every head); use tensor_parallel_size=1")
    plan_partitions(mc, n)
    if spec is not None and spec.method == "draft_model":
        raise ValueError(f"tensor_parallel_size={n} does not run a draft model; use speculative_config "
                         "method 'ngram' or tensor_parallel_size=1")
    if device == "cuda":
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
        if gpus < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (one per worker; NCCL refuses two on one "
                             f"device), this machine has {gpus}")


#: Attention backends whose kernels (with their layer ops) can run batch-invariant.
BATCH_INVARIANT_BACKENDS = ("numba",)


def resolve_activation_dtype(activation_dtype: str, backend: str, model_dir: Path, dtype: str,
                             quantization: str | None) -> str:
    """``activation_dtype`` checked against the run: ``"q8_0"`` needs the numba backend and a
    GGUF file's tensors as stored (``dtype="auto"``, no ``quantization``), whose block types
    (Q8_0 ... Q5_1, and the K-quants with Q8_K blocks) it applies to.

    Raises:
        ValueError: ``"q8_0"`` with another backend, a model that is not a GGUF file, an
            explicit ``dtype`` (which dequantizes the file) or a ``quantization``.
    """
    if activation_dtype == "auto":
        return activation_dtype
    if backend != "numba":
        raise ValueError(f"activation_dtype={activation_dtype!r} needs attention_backend='numba', not {backend!r}")
    if not is_gguf(model_dir) or dtype != "auto" or quantization is not None:
        raise ValueError(f"activation_dtype={activation_dtype!r} applies to a GGUF file's block types as stored: "
                         f"model={str(model_dir)!r}, dtype={dtype!r}, quantization={quantization!r} "
                         "(needs a .gguf file, dtype='auto', no quantization)")
    return activation_dtype


def resolve_batch_invariant(batch_invariant: bool | None, backend: str) -> bool:
    """``batch_invariant`` for ``backend``: None -> on for :data:`BATCH_INVARIANT_BACKENDS`, off
    for the others (the NumPy twin and the CUDA path use BLAS / cuBLAS products, whose
    reduction order depends on the number of rows).

    Raises:
        ValueError: ``batch_invariant=True`` with a backend that cannot honour it.
    """
    if batch_invariant is None:
        return backend in BATCH_INVARIANT_BACKENDS
    if batch_invariant and backend not in BATCH_INVARIANT_BACKENDS:
        raise ValueError(f"batch_invariant=True needs attention_backend in {BATCH_INVARIANT_BACKENDS}, "
                         f"got attention_backend={backend!r}")
    return bool(batch_invariant)


def default_cpu_backend() -> str:
    """``"numba"`` (compiled CPU kernels: faster than NumPy at decode and prefill, measured by
    ``refengine bench kernels --sections step``), or ``"numpy"`` where numba is not installed
    (looked up, not imported: numba loads with the first kernel)."""
    return "numba" if importlib.util.find_spec("numba") is not None else "numpy"


def _draft_model_config(spec: SpeculativeConfig | None, target: ModelConfig) -> ModelConfig | None:
    """The draft model's config.json for ``method="draft_model"`` (None otherwise).

    Raises:
        FileNotFoundError: the draft directory or its config.json is missing.
        ValueError: a bad config.json, or a vocabulary size other than the target's.
    """
    if spec is None or spec.method != "draft_model":
        return None
    draft = read_model_config(spec.model)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config['model']={spec.model!r} has vocab_size={draft.vocab_size} but the "
                         f"target model has {target.vocab_size}: a draft model must share the target's vocabulary")
    return draft


def _json_object_type():
    """The click parameter type of a dict option: a JSON object on the command line."""
    import json

    import click

    class JsonObject(click.ParamType):
        name = "json"

        def convert(self, value, param, ctx):
            if isinstance(value, dict):
                return value
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as e:
                self.fail(f"{value!r} is not valid JSON ({e.msg} at column {e.colno})", param, ctx)
            if not isinstance(obj, dict):
                self.fail(f"{value!r} is not a JSON object ({{...}})", param, ctx)
            return obj

    return JsonObject()


def _check_budget(budget: int, max_model_len: int) -> None:
    """Without chunked prefill a whole prompt must fit one step's token budget.

    Raises:
        ValueError: ``budget < max_model_len``, naming both.
    """
    if budget < max_model_len:
        raise ValueError(f"with enable_chunked_prefill=False, max_num_batched_tokens={budget} must be >= "
                         f"max_model_len={max_model_len} so every prompt fits one step")


def _python_type(fld: dataclasses.Field) -> type:
    """int, float, bool or str from a field's annotation (``"int | None"`` -> int)."""
    name = str(fld.type).split("|")[0].strip()
    return {"int": int, "float": float, "bool": bool, "str": str, "dict": dict}[name]


def _allowed(fld: dataclasses.Field) -> str:
    """What a field accepts, in words (``"an integer >= 1 or None"``), for error messages."""
    meta, want = fld.metadata, _python_type(fld)
    if meta["choices"]:
        text = "one of " + ", ".join(map(repr, meta["choices"]))
    elif want is bool:
        text = "True or False"
    elif want is dict:
        text = "a dict (a JSON object)"
    elif want is str:
        text = "a non-empty str"
    else:
        kind = "an integer" if want is int else "a finite number"
        low, high = meta["minimum"], meta["maximum"]
        if meta["positive"]:
            text = f"{kind} in (0, {high}]" if high is not None else f"{kind} > 0"
        elif low is not None and high is not None:
            text = f"{kind} in [{low}, {high}]"
        elif low is not None:
            text = f"{kind} >= {low}"
        else:
            text = kind
    return text + (" or None" if "None" in str(fld.type) else "")


def _check_field(fld: dataclasses.Field, value) -> None:
    """Type and range of one field's value.

    Raises:
        ValueError: naming the option, the value and what is allowed.
    """
    name, meta = fld.name, fld.metadata
    if value is None and "None" in str(fld.type):
        return
    want = _python_type(fld)
    ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
    if want is float and isinstance(value, (int, np.integer, np.floating)) and not isinstance(value, bool):
        ok = True
    if want is int and isinstance(value, np.integer):
        ok = True
    if want is bool and isinstance(value, np.bool_):
        ok = True
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {_allowed(fld)}, got {type(value).__name__}")
    if meta["choices"] and value not in meta["choices"]:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, meta['choices']))}")
    if want is str and not value:
        raise ValueError(f"{name}={value!r} is invalid: must be {_allowed(fld)}")
    if want in (int, float):
        low, high = meta["minimum"], meta["maximum"]
        if ((want is float and not math.isfinite(value)) or (meta["positive"] and not value > 0)
                or (low is not None and value < low) or (high is not None and value > high)):
            raise ValueError(f"{name}={value!r} is invalid: must be {_allowed(fld)}")


def _physical_memory() -> int | None:
    """Bytes of RAM on this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_device(device: str) -> str:
    """``device`` ("auto", "cpu", "cuda") -> "cpu" or "cuda".

    Raises:
        RuntimeError: "cuda" without a usable CuPy and GPU.
    """
    if device == "cpu":
        return "cpu"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return "cuda"
    except Exception as e:  # ImportError, or no driver / device
        if device == "cuda":
            raise RuntimeError(f"device='cuda' needs CuPy and an NVIDIA GPU "
                               f"(pip install 'refengine[cuda]'): {e}") from e
        logger.warning("device='auto': using the CPU (NumPy) because CuPy/CUDA is unavailable: %s", e)
        return "cpu"


def resolve_kv_cache_dtype(kv_cache_dtype: str, backend: str) -> str:
    """``kv_cache_dtype`` (one of :data:`refengine.attention.kv_cache.KV_CACHE_DTYPES`) checked against
    the attention backend: "float16" runs on :data:`FLOAT16_KV_BACKENDS` (the CPU), "int8"
    on :data:`INT8_KV_BACKENDS`, "fp8_e4m3" / "fp8_e5m2" on :data:`FP8_KV_BACKENDS` (the
    CUDA kernels).

    Raises:
        ValueError: a cache type with a backend that cannot read it, naming the backends that can.
    """
    supported = {"float16": FLOAT16_KV_BACKENDS, "int8": INT8_KV_BACKENDS, "fp8_e4m3": FP8_KV_BACKENDS,
                 "fp8_e5m2": FP8_KV_BACKENDS}
    backends = supported.get(kv_cache_dtype)
    if backends is not None and backend not in backends:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported with attention_backend={backend!r}: "
                         f"it runs on the {', '.join(backends)} backends; with {backend!r} use "
                         f"kv_cache_dtype='auto'" + (" or 'int8'" if backend in INT8_KV_BACKENDS else ""))
    return kv_cache_dtype


def resolve_dtype(dtype: str, device: str) -> np.dtype:
    """``dtype`` ("auto", "float32", "float16", "bfloat16") -> NumPy dtype of weights and KV cache.

    "auto" is float32 on the CPU and bfloat16 on a GPU.

    Raises:
        ValueError: a 16-bit dtype on the CPU (NumPy has no fast 16-bit matrix products;
            the CPU path is float32 end to end).
    """
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cpu" and dtype != "float32":
        raise ValueError(f"dtype={dtype!r} is not supported on the CPU: the NumPy path is float32 end to end")
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
