"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine`` has vLLM's shape: ``add_request`` queues a request, ``step`` runs one
scheduler decision through the model and returns the requests that advanced,
``abort`` drops one, ``has_unfinished_requests`` says whether to keep stepping.
``LLM`` wraps it for offline use: ``LLM(model=...).generate(prompts, params)``.

Engine options are the fields of :class:`refengine.engine_args.EngineArgs`, resolved
into a frozen :class:`refengine.config.EngineConfig` before anything is allocated.

One step::

    scheduler.schedule()     -> [(seq, num_new_tokens)]        (refengine/core/scheduler.py)
    (speculative decoding: the proposals of sequences given 1 + k tokens, refengine/spec_decode/)
    model_runner.execute()   -> logits of sequences that sample  (refengine/core/model_runner.py)
    sampler(...)             -> one token per such sequence      (refengine/sampler.py;
                                with proposals: their verification, spec_decode/decoder.py)
    scheduler.postprocess()  -> computed tokens advance, tokens appended, stop rules
                                (refengine/stop.py), finished sequences freed
    _make_output(...)        -> RequestOutputs (formatting only)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refengine.attention.kv_cache import KVCache, cdiv
from refengine.attention.selector import get_attention_backend
from refengine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from refengine.config import read_generation_config
from refengine.core.block_manager import BlockManager
from refengine.core.model_runner import ModelRunner, activation_peak, gpu_kv_pool_blocks
from refengine.core.scheduler import Scheduler
from refengine.core.sequence import CompletionOutput, Logprob, RequestOutput, Sequence, SequenceStatus
from refengine.detokenizer import IncrementalDetokenizer
from refengine.engine_args import EngineArgs
from refengine.formats.gguf_file import close_gguf_files, is_gguf, open_gguf
from refengine.lora import LoRAManager, LoRARequest
from refengine.metrics import EngineMetrics, RequestMetrics
from refengine.models import load_model
from refengine.ops import get_layer_ops
from refengine.sampler import Sampler, prompt_logprobs_rows
from refengine.sampling_params import RequestOutputKind, SamplingParams
from refengine.spec_decode import DraftModelProposer, SpecDecoder
from refengine.stop import StopChecker
from refengine.text import check_unicode

logger = logging.getLogger("refengine")

STATS_INTERVAL_S = 5.0


class PromptTooLongError(ValueError):
    """A prompt of ``max_model_len`` tokens or more (the OpenAI server's ``context_length_exceeded``)."""


def as_token_ids(prompt) -> list[int]:
    """A prompt given as token ids -> ``list[int]``.

    Raises:
        ValueError: ``prompt`` is not a list, tuple or 1-D NumPy array of integers (Python
            or NumPy ints; bools and floats are refused rather than truncated, and so are
            ``bytes``, which would otherwise read as a list of byte values).
    """
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__} "
                         "(decode it first, e.g. prompt.decode('utf-8'))")
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    for t in prompt:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__})")
    return [int(t) for t in prompt]


def load_tokenizer(model_dir, vocab_size: int):
    """The model's tokenizer, or None without ``tokenizer.json`` (token-id prompts only,
    e.g. tiny test models).

    Raises:
        ValueError: a broken tokenizer file (see ``Tokenizer.from_pretrained``), or a
            tokenizer with more tokens than the model's vocabulary.
    """
    if is_gguf(model_dir):
        tokenizer, source = open_gguf(model_dir).tokenizer(), model_dir
    elif not (model_dir / "tokenizer.json").is_file():
        return None
    else:
        from refengine.tokenizer import Tokenizer

        tokenizer, source = Tokenizer.from_pretrained(model_dir), model_dir / "tokenizer.json"
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{source} has {tokenizer.vocab_size} tokens but config.json's "
                         f"'vocab_size' is {vocab_size}: the tokenizer does not belong to this model")
    return tokenizer


def _eos_token_ids(model_dir, model_config, tokenizer) -> set[int]:
    """Every id that ends generation: config.json's and generation_config.json's
    ``eos_token_id`` (an id or a list) and the tokenizer's EOS.

    Raises:
        ValueError: an id outside the vocabulary; the message names the file.
    """
    ids: set[int] = set()
    gen = open_gguf(model_dir).generation_config if is_gguf(model_dir) else read_generation_config(model_dir)
    for source, value in (("config.json", model_config.eos_token_id),
                          ("generation_config.json", gen.get("eos_token_id"))):
        for t in [value] if isinstance(value, int) else value or []:
            if t >= model_config.vocab_size:
                raise ValueError(f"{model_dir / source}: 'eos_token_id' {t} is outside the vocabulary "
                                 f"[0, {model_config.vocab_size})")
            ids.add(t)
    if tokenizer is not None:
        ids.update(tokenizer.eos_token_ids)
    return ids


def _prompt_list(prompts) -> list:
    """One prompt (a string or a list of token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes, bytearray)) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    return list(prompts)


def build_model(config, dequantize_gguf: bool, partition=None, *, setup_runtime: bool = False):
    """The model of ``config`` on its device, with its attention backend and layer ops (the
    model's ``attention``, ``ops`` and ``xp``), prepared for the engine's steps
    (:meth:`refengine.ops.LayerOps.prepare_model`: on the CPU, the thread pools).

    Args:
        config: the resolved :class:`refengine.config.EngineConfig`.
        dequantize_gguf: a GGUF file's blocks dequantized to ``config.dtype`` (an explicit
            dtype, or a GPU) rather than kept as stored.
        partition: one tensor-parallel worker's share (:class:`refengine.parallel.Partition`),
            None for the whole model.
        setup_runtime: make the layer ops' process-wide settings first
            (:meth:`refengine.ops.LayerOps.setup_runtime`), as ``LLM`` and the CLI ask.
    Raises:
        FileNotFoundError, ValueError: from :func:`refengine.models.load_model`.
    """
    xp = np
    if config.device == "cuda":
        import cupy as xp
    # CUDA ops share the attention backend's compiled module
    ops = get_layer_ops(config.layer_ops, xp, batch_invariant=config.batch_invariant,
                        activation_dtype=config.activation_dtype)
    if setup_runtime:
        ops.setup_runtime()  # before the backends start any thread
    attention = get_attention_backend(config.attention_backend, batch_invariant=config.batch_invariant)
    model = load_model(config.model_dir, config.model_config, attention, ops, xp=xp, dtype=config.dtype,
                       dequantize_gguf=dequantize_gguf, quantization=config.quantization,
                       max_model_len=config.max_model_len, partition=partition)
    close_gguf_files()  # the blocks are copied out: the file's memory map is no longer needed
    ops.prepare_model(model, config)
    return model


def make_kv_cache(config, model_config, xp=np) -> KVCache:
    """A pool of ``config.num_kv_blocks`` blocks for ``model_config``'s layers and KV heads (a
    tensor-parallel worker passes its local config: its own KV heads)."""
    mc = model_config
    return KVCache(mc.num_hidden_layers, config.num_kv_blocks, config.block_size, mc.num_key_value_heads,
                   mc.head_dim, dtype=config.dtype, xp=xp, kv_cache_dtype=config.kv_cache_dtype)


def measure_gpu_kv_blocks(config, model, draft_model=None) -> int:
    """KV blocks that fit in ``gpu_memory_utilization`` of the GPU after weights and
    activations (:func:`refengine.core.model_runner.gpu_kv_pool_blocks`; a block costs the
    target's and the draft's bytes).

    The activation peak is measured, as vLLM's ``profile_run`` does: one forward pass of
    ``max_num_batched_tokens`` tokens through a throw-away cache, reading how much the CuPy
    memory pool had to hold; with a draft model, its own pass too (its catch-up runs up to
    as many rows), and the larger peak counts. ``model.config`` gives the KV heads (a
    tensor-parallel worker measures its own share).
    """
    import cupy

    cfg = config
    pool = cupy.get_default_memory_pool()
    passes = [model] + ([draft_model] if draft_model is not None else [])
    per_block = [KVCache.bytes_per_block(m.config.num_hidden_layers, cfg.block_size, m.config.num_key_value_heads,
                                         m.config.head_dim, cfg.dtype.itemsize, cfg.kv_cache_dtype) for m in passes]
    peak = 0
    for m, block_bytes in zip(passes, per_block):
        c = m.config
        held_before = pool.total_bytes()
        n = min(cfg.max_num_batched_tokens, c.max_position_embeddings - 1)
        probe = Sequence("__profile__", None, [0] * n, SamplingParams(max_tokens=1))
        scratch = KVCache(c.num_hidden_layers, cdiv(n, cfg.block_size), cfg.block_size, c.num_key_value_heads,
                          c.head_dim, dtype=cfg.dtype, xp=cupy, kv_cache_dtype=cfg.kv_cache_dtype)
        probe.block_table = list(range(scratch.num_blocks))
        ModelRunner(m, scratch).execute([(probe, n)])
        cupy.cuda.Device().synchronize()
        peak = max(peak, activation_peak(held_before, pool.total_bytes(), scratch.num_blocks * block_bytes))
        del scratch
        pool.free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    blocks = gpu_kv_pool_blocks(total, free, peak, per_block[0], sum(per_block[1:]), cfg.gpu_memory_utilization)
    logger.info("KV cache: %d blocks (%.2f GiB); activation peak %.2f GiB", blocks,
                blocks * sum(per_block) / 2**30, peak / 2**30)
    return blocks


@dataclass
class Request:
    """A user request: one prompt, ``params.n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs_sent: bool = False  # SamplingParams.prompt_logprobs go out in one output only

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """The serving loop over one model.

    Args:
        model: model directory (default: ``$REFENGINE_MODEL`` or ``weights/SmolLM2-135M-Instruct``).
        **kwargs: engine options, the fields of :class:`refengine.engine_args.EngineArgs`
            (``device``, ``dtype``, ``attention_backend``, ``max_model_len``, ``block_size``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``,
            ``enable_prefix_caching``, ``num_kv_blocks``, ``kv_cache_memory``, ``gpu_memory_utilization``,
            ``speculative_config``, ``log_stats``, ``trace``), each documented there.

    Raises:
        FileNotFoundError: the model directory or its files are missing.
        ValueError: an unknown option, an invalid value or combination (e.g. a device and
            backend that do not go together, ``max_model_len`` larger than the KV pool
            holds), an unsupported architecture or a bad checkpoint.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        self._init(EngineArgs.from_kwargs(model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, setup_runtime: bool = False) -> "LLMEngine":
        """Build an engine from an :class:`EngineArgs` (as the CLI does). ``setup_runtime``:
        make the layer ops' process-wide settings first (:meth:`refengine.ops.LayerOps.setup_runtime`;
        ``LLM`` and the CLI do; a plain ``LLMEngine(...)`` changes nothing process-wide but its thread counts)."""
        engine = cls.__new__(cls)
        engine._init(args, setup_runtime)
        return engine

    def _init(self, args: EngineArgs, setup_runtime: bool = False) -> None:
        model_dir, model_config = args.model_config()
        config = args.create_engine_config(model_dir, model_config)  # every check before allocating
        # The small files next, so a broken one fails before the weights are read.
        self.tokenizer = load_tokenizer(model_dir, model_config.vocab_size)
        self.eos_token_ids = _eos_token_ids(model_dir, model_config, self.tokenizer)
        dequantize = args.dtype != "auto" or config.device != "cpu"
        spec_cfg = config.speculative_config
        draft_model = None
        mc = model_config
        self.lora_manager = None
        if config.tensor_parallel_size > 1:  # worker processes hold the model's shares (refengine/parallel/)
            from refengine.core.executor import TensorParallelRunner

            self.model = self.kv_cache = None
            self.runner = TensorParallelRunner(args, config, dequantize)
            config = self.runner.config  # on a GPU: the pool every worker has room for
        else:
            self.model = build_model(config, dequantize, setup_runtime=setup_runtime)
            xp, attention, ops = self.model.xp, self.model.attention, self.model.ops
            if spec_cfg is not None and spec_cfg.method == "draft_model":  # loaded before a GPU pool is measured
                draft_model = load_model(Path(spec_cfg.model), config.draft_model_config, attention, ops, xp=xp,
                                         dtype=config.dtype, max_model_len=config.max_model_len)
                ops.prepare_model(draft_model, config, draft=True)
            if config.num_kv_blocks is None:  # on a GPU the pool is what the weights and activations leave
                num_blocks = measure_gpu_kv_blocks(config, self.model, draft_model)
                config = args.create_engine_config(model_dir, model_config, num_gpu_blocks=num_blocks)
            self.kv_cache = make_kv_cache(config, mc, xp)
            if config.enable_lora:
                self.lora_manager = LoRAManager(self.model, config.max_lora_rank)
            self.runner = ModelRunner(self.model, self.kv_cache, capture_decode=not config.enforce_eager,
                                      max_model_len=config.max_model_len, lora_manager=self.lora_manager)
            # compile (or load) every kernel now, not during the first requests
            ops.warm_up(self.model, self.kv_cache, config.max_num_batched_tokens, config.max_model_len)
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.sampler = Sampler(eos_token_id=sorted(self.eos_token_ids), tokenizer=self.tokenizer,
                               vocab_size=mc.vocab_size)  # the tokenizer: bad_words, structured outputs
        self.spec_decoder = None
        if spec_cfg is not None:
            draft = None
            if draft_model is not None:
                dc = config.draft_model_config
                draft_cache = make_kv_cache(config, dc, xp)
                draft = DraftModelProposer(draft_model, draft_cache, self.sampler,
                                           max_num_batched_tokens=config.max_num_batched_tokens)
            self.spec_decoder = SpecDecoder(spec_cfg, self.sampler, config.max_model_len, draft)
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager,
                                   StopChecker(self.eos_token_ids, config.max_model_len), speculator=self.spec_decoder)
        self.metrics = EngineMetrics(trace=config.trace)
        self.requests: dict[str, Request] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text, for prompt logprobs
        self._last_stats_log = time.monotonic()

    @property
    def model_dir(self):
        return self.config.model_dir

    @property
    def model_config(self):
        return self.config.model_config

    @property
    def device(self) -> str:
        return self.config.device

    @property
    def attention_backend(self) -> str:
        return self.config.attention_backend

    # --- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized with the special tokens the tokenizer config adds, e.g. a
                BOS for Llama, none for SmolLM2, as vLLM does) or a list of token ids (used as is).
            sampling_params: defaults to ``SamplingParams()``.
            arrival_time: ``time.monotonic()`` seconds (default: now).
            cache_salt: with prefix caching, only requests with the same salt share KV
                blocks (e.g. one salt per tenant, so timing cannot reveal another's prompt).
            lora_request: the LoRA adapter to run with (:class:`refengine.lora.LoRARequest`,
                vLLM's), loaded at its first request; None for the base model. Needs
                ``enable_lora``.
        Raises:
            ValueError: a request id that is not a str or is in use; a prompt that is not a
                str or a list of token ids (``bytes`` included), holds a lone surrogate
                (the position is named), is empty, has ids outside the vocabulary, or has
                ``max_model_len`` tokens or more (:class:`PromptTooLongError`); ``sampling_params``
                that is not a ``SamplingParams``, asks for more ``logprobs`` than ``max_logprobs``, for
                more completions ``n`` than ``max_num_seqs``, or names stop token ids
                outside the vocabulary; a ``cache_salt`` that is not a str; a ``lora_request``
                without ``enable_lora``, or whose adapter cannot be loaded
                (:class:`refengine.lora.LoRAManager`). Nothing is queued and no block is taken.
        """
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or None, got {type(sampling_params).__name__}")
        params = sampling_params or SamplingParams()
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r} ({type(request_id).__name__})")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if arrival_time is not None and not (isinstance(arrival_time, (int, float)) and math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time={arrival_time!r} is invalid: must be None or finite seconds")
        self.check_sampling_params(params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt={cache_salt!r} is invalid: must be None or a str")
        text, token_ids = self.prompt_token_ids(prompt)
        self.add_lora(lora_request)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop_strings!r} need a tokenizer; {self.model_dir} has no tokenizer.json")
        now = time.monotonic() if arrival_time is None else arrival_time
        shared_prompt_logprobs = [None] if params.prompt_logprobs is not None else None  # one per request
        seqs = [Sequence(request_id, text, token_ids, params, index=i,
                         detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params)
                         if self.tokenizer else None, cache_salt=cache_salt, prompt_logprobs=shared_prompt_logprobs,
                         lora_request=lora_request)
                for i in range(params.n)]
        self.requests[request_id] = Request(request_id, text, token_ids, params, seqs,
                                            RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids)))
        for seq in seqs:
            self.scheduler.add(seq)

    def add_lora(self, lora_request: LoRARequest | None) -> bool:
        """Load ``lora_request``'s adapter now (vLLM's ``add_lora``); :meth:`add_request` calls
        it, so a bad adapter fails its request, not a step. None: nothing to load.

        Raises:
            ValueError: an adapter without ``enable_lora``; those of :meth:`LoRAManager.add`.
        """
        if lora_request is None:
            return False
        if self.lora_manager is None:
            raise ValueError(f"lora_request={lora_request!r} needs an engine with enable_lora=True "
                             "(refengine serve --enable-lora --lora-modules NAME=PATH)")
        self.lora_manager.add(lora_request)
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The LoRA adapters loaded so far (vLLM's ``list_loras``), by id; [] without ``enable_lora``."""
        return [] if self.lora_manager is None else self.lora_manager.list_loras()

    def prompt_token_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt, as :meth:`add_request` reads it.

        Raises:
            ValueError: as :meth:`add_request` for a bad prompt.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json: pass prompts as token ids")
            check_unicode(prompt, "the prompt")
            # special tokens as the tokenizer config says (a BOS for Llama, none for SmolLM2), as vLLM does
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, token_ids = None, as_token_ids(prompt)
        self._check_prompt(token_ids)
        return text, token_ids

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Whether this engine can serve ``params`` (as :meth:`add_request` checks them).

        Raises:
            ValueError: more ``logprobs`` than ``max_logprobs``, more completions ``n`` than
                ``max_num_seqs``, or stop token ids outside the vocabulary; what the sampler
                cannot apply (``Sampler.check_sampling_params``: logit_bias / allowed_token_ids
                ids outside the vocabulary, bad_words or structured outputs without a
                tokenizer, a grammar llguidance refuses).
        """
        cfg = self.config
        if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} is more than this engine's "
                             f"max_logprobs={cfg.max_logprobs} (an engine option)")
        if params.prompt_logprobs is not None and params.prompt_logprobs > cfg.max_logprobs:
            raise ValueError(f"SamplingParams.prompt_logprobs={params.prompt_logprobs} is more than this engine's "
                             f"max_logprobs={cfg.max_logprobs} (an engine option)")
        if params.n > cfg.scheduler_config.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} is more than max_num_seqs={cfg.scheduler_config.max_num_seqs}: "
                             "a request's completions must be able to run in one step")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids={params.stop_token_ids!r} is invalid: {bad[0]} is "
                             f"outside the vocabulary [0, {vocab})")
        # logit_bias / allowed_token_ids ids, bad_words and structured outputs (the grammar compiled)
        self.sampler.check_sampling_params(params)

    def _check_prompt(self, token_ids: list[int], generates: bool = True) -> None:
        """``generates``: the prompt must leave room for one generated token (False: a prompt
        that is only scored, :meth:`prompt_logits`, may fill ``max_model_len``)."""
        n, limit = len(token_ids), self.config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if generates and n >= limit:
            raise PromptTooLongError(f"the prompt has {n} tokens but max_model_len is {limit}: "
                                     f"it must be shorter than {limit} to leave room for one generated token")
        if n > limit:
            raise PromptTooLongError(f"the prompt has {n} tokens but max_model_len is {limit}")
        # No separate "more blocks than the pool" check: __init__ keeps max_model_len within
        # the pool, so a prompt that passed the limit above always fits.

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (unknown ids are ignored)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                if seq.detokenizer is not None:
                    seq.detokenizer.flush()
        req.metrics.on_finished(time.monotonic())
        self.metrics.record_finished(req.metrics, "abort", request_id)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also end with this process)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running (keep calling :meth:`step`)."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running."""
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached KV blocks (vLLM's name). Returns False, changing nothing,
        while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step.

        Returns:
            One ``RequestOutput`` per request that got a token this step (finished ones
            included, with ``finished=True``); ``[]`` when nothing was scheduled. Requests
            in the middle of a chunked prefill do not appear.
        Raises:
            Whatever the model, the sampler or the stop rules (the detokenizer) raise. The
            step is then undone: no token is appended, the chunks are not counted as
            computed (the random draws are keyed by output position, nothing to wind
            back), so the next step redoes it exactly (``text == decode(token_ids)`` holds
            and every KV block stays accounted for). Once the step is applied nothing
            after it raises: an error while recording metrics is logged and the outputs
            are still returned.
        """
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        num_decode = 0
        for seq, n in sched.scheduled:
            if seq.index == 0:
                self.requests[seq.request_id].metrics.on_scheduled(t0)
            k = sched.spec.get(seq, 0)  # a verify's 1 + k tokens all count as decode tokens
            if n - k == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == len(seq) - 1:
                num_decode += n
        spec = self.spec_decoder
        prompt_logits = []  # rows of sequences owed prompt logprobs (ModelRunner.execute)
        if spec is None:
            logits, sample_seqs = self.runner.execute(sched.scheduled, prompt_logits=prompt_logits)
            out = self.sampler(logits, sample_seqs) if sample_seqs else None
            sampled = [(seq, int(out.token_ids[i]), out.logprobs[i] if out.logprobs is not None else None)
                       for i, seq in enumerate(sample_seqs)]
            num_rejected = None
        else:
            proposals = spec.propose(sched.spec, sched.preempted)
            logits, sample_seqs = self.runner.execute(
                sched.scheduled, spec_tokens={seq: p.token_ids for seq, p in proposals.items()},
                prompt_logits=prompt_logits)
            sampled, num_rejected = spec.sample(logits, sample_seqs, proposals)
        new_prompt_logprobs = [(seq, first, self._prompt_logprob_entries(seq, first, rows))
                               for seq, first, rows in prompt_logits]
        num_outputs_before = [seq.num_output_tokens for seq in sample_seqs]
        # Only now, with every sampled token in hand, is the step applied (in one place, atomically).
        results = self.scheduler.postprocess(sched.scheduled, sampled, num_rejected)
        for seq, first, entries in new_prompt_logprobs:  # list appends only: nothing here raises
            seq.prompt_logprobs.extend(entries[len(seq.prompt_logprobs) - first:])
        num_new = [seq.num_output_tokens - n for seq, n in zip(sample_seqs, num_outputs_before)]
        # The step is applied; what follows only reports it, and finished requests leave first.
        advanced = {seq.request_id: self.requests[seq.request_id] for seq, _ in results}
        finished = [req for req in advanced.values() if req.finished]
        for req in finished:
            del self.requests[req.request_id]
        try:
            self._record_step(t0, sched, num_decode, results, num_new, advanced, finished)
        except Exception:
            logger.exception("recording the metrics of a step failed; the step's results stand")
        outputs = [self._make_output(req) for req in advanced.values()]
        return [out for out in outputs if out is not None]

    def _prompt_logprob_entries(self, seq: Sequence, first: int, logits: np.ndarray) -> list[dict[int, Logprob]]:
        """Prompt-logprob entries ``first .. first + r - 1`` of ``seq`` from the logits of
        the rows before them (``logits [r, vocab]`` float32, raw: no temperature, penalty or
        bias), as vLLM's ``prompt_logprobs``: per entry ``j``, ``{prompt token j: Logprob,
        then the top k most likely (ties to the lower id)}``, k =
        ``SamplingParams.prompt_logprobs``; ranks 1-based (the prompt token's: how many
        tokens are more likely, plus one). Float32 log-softmax (NaN logits count as -inf).
        Reads only; raises AssertionError if the entries would leave a gap (a bug).
        """
        assert first <= len(seq.prompt_logprobs), "prompt logprobs would skip positions"
        r = logits.shape[0]
        actual = np.asarray(seq.prompt_token_ids[first:first + r], dtype=np.int64)
        # row blocks: a few MB of scratch, not several [r, vocab] arrays (one of them int64)
        actual_lp, ranks, top, top_lp = prompt_logprobs_rows(logits, actual, seq.sampling_params.prompt_logprobs)
        text = self._token_text
        entries = []
        for i in range(r):
            entry = {int(actual[i]): Logprob(float(actual_lp[i]), int(ranks[i]), text(int(actual[i])))}
            for rank, (t, lp) in enumerate(zip(top[i].tolist(), top_lp[i].tolist()), 1):
                if t not in entry:
                    entry[t] = Logprob(lp, rank, text(t))
            entries.append(entry)
        return entries

    def _token_text(self, token_id: int) -> str | None:
        """One token's text (special tokens kept), cached; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        cache = self._token_texts
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _record_step(self, t0: float, sched, num_decode: int, results, num_new: list[int], advanced: dict,
                     finished: list) -> None:
        """The metrics and log lines of an applied step (``num_new``: tokens each result
        appended, more than one after a speculative step)."""
        now = time.monotonic()
        for (seq, _), count in zip(results, num_new):
            req = advanced[seq.request_id]
            for _ in range(count):  # tokens of one verify come out together: later gaps are 0
                first = req.metrics.first_token_time is None
                gap = req.metrics.on_token(now, seq.index)
                if first:
                    self.metrics.record_first_token(req.metrics.ttft)
                elif gap is not None:
                    self.metrics.record_token_latency(gap)
        now = time.monotonic()
        for req in finished:
            req.metrics.on_finished(now)
            self.metrics.record_finished(req.metrics, req.seqs[0].finish_reason, req.request_id)
            if self.config.log_stats:
                self._log_finished(req)
        self.metrics.record_step(step_start=t0, step_duration=now - t0,
                                 num_prefill_tokens=sched.num_tokens - num_decode, num_decode_tokens=num_decode,
                                 num_generated_tokens=sum(num_new), num_seqs=len(sched.scheduled),
                                 num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                                 kv_cache_usage=self.block_manager.usage, num_preemptions=len(sched.preempted),
                                 prefix_cache_queries=sched.prefix_cache_queries,
                                 prefix_cache_hits=sched.prefix_cache_hits)
        if self.spec_decoder is not None:
            self.metrics.record_spec_decode(self.spec_decoder.last_stats)
        if self.config.log_stats and now - self._last_stats_log >= STATS_INTERVAL_S:
            self._last_stats_log = now
            logger.info(EngineMetrics.format_log_line(self.metrics.stats_since_last_log()))

    def _make_output(self, req: Request) -> RequestOutput | None:
        """Format the request's state as a ``RequestOutput`` (changes nothing but the
        streaming cursors: text and token deltas since the previous output), as its
        ``SamplingParams.output_kind`` asks: CUMULATIVE copies the whole output so far,
        DELTA only what is new (O(new tokens) per step, whatever the output's length),
        FINAL_ONLY returns None until the request has finished (then everything)."""
        kind = req.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not req.finished:
            return None  # the cursors stay put: the final output's deltas are the whole output
        want_logprobs = req.params.logprobs is not None
        prompt_logprobs = None  # sent once: in the first output made after the prompt is computed
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent \
                and not req.seqs[0].needs_prompt_logprobs:
            prompt_logprobs, req.prompt_logprobs_sent = req.seqs[0].prompt_logprobs, True
        completions = []
        for seq in req.seqs:
            detok = seq.detokenizer
            delta = detok.get_delta() if detok is not None else ""
            start = seq.num_reported_tokens
            new_ids = seq.output_token_ids[start:]
            seq.num_reported_tokens = seq.num_output_tokens
            if kind is RequestOutputKind.DELTA:
                text, token_ids = delta, new_ids
                logprobs = seq.logprobs[start:] if want_logprobs else None
            else:
                text = detok.text if detok is not None else ""
                token_ids = list(seq.output_token_ids)
                logprobs = list(seq.logprobs) if want_logprobs else None
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids, delta_token_ids=new_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=logprobs,
                delta_text=delta))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished=req.finished, metrics=req.metrics,
                             num_cached_tokens=req.seqs[0].num_cached_tokens, prompt_logprobs=prompt_logprobs)

    def _log_finished(self, req: Request) -> None:
        m = req.metrics

        def ms(x):
            return "n/a" if x is None else f"{x * 1e3:.1f}ms"

        logger.info("request %s finished: prompt_tokens=%d output_tokens=%d ttft=%s tpot=%s e2e=%s finish_reason=%s",
                    req.request_id, len(req.prompt_token_ids), sum(s.num_output_tokens for s in req.seqs),
                    ms(m.ttft), ms(m.tpot), ms(m.e2e_latency), req.seqs[0].finish_reason)

    # --- scoring: golden tests, refengine eval ------------------------------------------------
    def prompt_logits(self, token_ids: list[int], first_row: int = 0,
                      lora_request: LoRARequest | None = None) -> np.ndarray:
        """Logits at every prompt position from ``first_row`` on, for golden tests and
        scoring (:mod:`refengine.eval.perplexity`), under ``lora_request``'s adapter (None:
        the base model).

        Runs the prompt through the model in chunks of ``max_num_batched_tokens`` using
        its own KV blocks, which are freed afterwards. A chunk ends at ``first_row``: the
        rows before it run without the LM head. The prompt may fill ``max_model_len``
        (nothing is generated after it).

        Returns:
            ``[len(token_ids) - first_row, vocab_size]`` float32; row ``i`` predicts the
            token after position ``first_row + i``.
        Raises:
            ValueError: as :meth:`add_request` for a bad prompt (but ``max_model_len`` tokens
                are allowed), ``first_row`` outside ``[0, len(token_ids))``, or not enough
                free blocks now.
        """
        token_ids = [int(t) for t in token_ids]
        self._check_prompt(token_ids, generates=False)
        if not 0 <= first_row < len(token_ids):
            raise ValueError(f"first_row={first_row} is outside [0, {len(token_ids)}): the prompt has "
                             f"{len(token_ids)} tokens")
        self.add_lora(lora_request)
        seq = Sequence("__prompt_logits__", None, token_ids, SamplingParams(max_tokens=1), lora_request=lora_request)
        seq.status = SequenceStatus.RUNNING
        chunks = []
        try:
            while seq.num_computed_tokens < len(seq):
                start = seq.num_computed_tokens
                end = first_row if start < first_row else len(seq)  # a chunk does not cross first_row
                n = min(self.config.max_num_batched_tokens, end - start)
                if not self.block_manager.can_allocate(seq, n):
                    raise ValueError(f"a {len(seq)}-token prompt needs {self.block_manager.blocks_needed(seq, n)} "
                                     f"more KV blocks now, {self.block_manager.num_free_blocks} are free")
                self.block_manager.allocate(seq, n)
                logits, _ = self.runner.execute([(seq, n)], all_logits=start >= first_row)
                if start >= first_row:
                    chunks.append(logits)
                self.scheduler.postprocess([(seq, n)], [])
        finally:
            self.block_manager.free(seq)
        return np.concatenate(chunks, axis=0)


class LLM:
    """Offline generation (vLLM's ``LLM``): ``LLM(model=DIR).generate(prompts, params)``.

    Keyword arguments go to :class:`LLMEngine`.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, **kwargs), setup_runtime=True)
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def prompt_logits(self, token_ids: list[int], first_row: int = 0,
                      lora_request: LoRARequest | None = None) -> np.ndarray:
        """See :meth:`LLMEngine.prompt_logits`."""
        return self.llm_engine.prompt_logits(token_ids, first_row, lora_request)

    def reset_prefix_cache(self) -> bool:
        """See :meth:`LLMEngine.reset_prefix_cache`."""
        return self.llm_engine.reset_prefix_cache()

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (vLLM's ``LLM.beam_search``; the rule is transformers', see
        :mod:`refengine.beam_search`).

        Args:
            prompts: a string, a list of token ids, or a list of either.
            params: beam width, ``max_tokens``, ``length_penalty`` ...
        Returns:
            Per prompt, in order, a ``BeamSearchOutput`` whose ``sequences`` are the
            ``beam_width`` beams, best first.
        Raises:
            ValueError: a bad prompt (as :meth:`generate`); nothing is run.
        """
        ids = [self.llm_engine.prompt_token_ids(p)[1] for p in _prompt_list(prompts)]
        return beam_search(self, ids, params)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; return one finished ``RequestOutput`` per prompt, in order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or a list with one per prompt.
            use_tqdm: show a progress bar (on a terminal: none when stderr is redirected).
            lora_request: the LoRA adapter of every prompt, or a list with one (or None)
                per prompt, as vLLM's; needs ``enable_lora``.
        Raises:
            ValueError: a bad prompt, a params or adapter list of the wrong length, an
                adapter that cannot be loaded; no request is left queued.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request entries for {len(prompts)} prompts")
        # Only finished outputs are returned: the engine need not copy a growing output every
        # step (vLLM's LLM does the same). A copy, so the caller's params are left as given.
        sampling_params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                           if isinstance(p, SamplingParams) and p.output_kind is RequestOutputKind.CUMULATIVE
                           else p for p in sampling_params]
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params, lora in zip(prompts, sampling_params, loras):
                rid = f"gen-{self._counter}"
                self._counter += 1
                engine.add_request(rid, prompt, params, lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=None)  # None: TTY only
        try:
            while len(results) < len(ids) and any(rid in engine.requests for rid in ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
