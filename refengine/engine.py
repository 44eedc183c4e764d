"""The engine: requests in, tokens out, one scheduler step at a time.

``LLMEngine`` has vLLM's shape: ``add_request`` queues a request, ``step`` runs one
scheduler decision through the model and returns the requests that advanced,
``abort`` drops one, ``has_unfinished_requests`` says whether to keep stepping.
``LLM`` wraps it for offline use: ``LLM(model=...).generate(prompts, params)``.

One step::

    scheduler.schedule()    -> [(seq, num_new_tokens)]       (refengine/scheduler.py)
    model_runner.execute()  -> logits of sequences that sample (refengine/model_runner.py)
    sampler(...)            -> one token per such sequence     (refengine/sampler.py)
    _append_token(...)      -> stop checks, text delta         (refengine/detokenizer.py)
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from refengine.attention import get_attention_backend
from refengine.config import EngineConfig, ModelConfig
from refengine.detokenizer import IncrementalDetokenizer
from refengine.kv_cache import BlockManager, KVCache, cdiv
from refengine.metrics import EngineMetrics, RequestMetrics
from refengine.model import LlamaModel
from refengine.model_runner import ModelRunner
from refengine.ops import get_layer_ops
from refengine.sampler import Sampler
from refengine.sampling_params import SamplingParams
from refengine.scheduler import Scheduler
from refengine.sequence import CompletionOutput, RequestOutput, Sequence, SequenceStatus
from refengine.threads import configure_threads

logger = logging.getLogger("refengine")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "weights/SmolLM2-135M-Instruct"
STATS_INTERVAL_S = 5.0


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """``model``, else ``$REFENGINE_MODEL``, else the default model in this checkout."""
    if model:
        return Path(model)
    if os.environ.get("REFENGINE_MODEL"):
        return Path(os.environ["REFENGINE_MODEL"])
    local = Path(DEFAULT_MODEL)
    return local if local.is_dir() else REPO_ROOT / DEFAULT_MODEL


def resolve_device(device: str) -> tuple[str, object]:
    """``device`` ("auto", "cpu", "cuda") -> (name, array module).

    Raises:
        ValueError: unknown device; RuntimeError: "cuda" without a usable CuPy.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda'")
    if device == "cpu":
        return "cpu", np
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return "cuda", cupy
    except Exception as e:  # ImportError, or no driver / device
        if device == "cuda":
            raise RuntimeError(f"device='cuda' needs CuPy and an NVIDIA GPU: {e}") from e
        logger.warning("device='auto': using the CPU (NumPy) because CuPy/CUDA is unavailable: %s", e)
        return "cpu", np


DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def resolve_dtype(dtype: str, device: str):
    """``dtype`` ("auto", "float32", "float16", "bfloat16") -> NumPy dtype of weights and KV cache.

    "auto" is float32 on the CPU and bfloat16 on a GPU.

    Raises:
        ValueError: an unknown dtype, or a 16-bit dtype on the CPU (NumPy has no fast
            16-bit matrix products; the CPU path is float32 end to end).
    """
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of 'auto', {', '.join(map(repr, DTYPES))}")
    if device == "cpu" and dtype != "float32":
        raise ValueError(f"dtype={dtype!r} is not supported on the CPU: the NumPy path is float32 end to end")
    return np.dtype(DTYPES[dtype])


def as_token_ids(prompt) -> list[int]:
    """A prompt given as token ids -> ``list[int]``.

    Raises:
        ValueError: ``prompt`` is not a sequence of integers (Python or NumPy ints; bools
            and floats are refused rather than truncated).
    """
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None
    for t in items:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__})")
    return [int(t) for t in items]


@dataclass
class Request:
    """A user request: one prompt, ``params.n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """The serving loop over one model.

    Args:
        model: model directory (default: ``$REFENGINE_MODEL`` or ``weights/SmolLM2-135M-Instruct``).
        device: "cpu" (default), "cuda", or "auto".
        dtype: weights and KV cache: "auto" (float32 on the CPU, bfloat16 on a GPU),
            "float32", "float16", "bfloat16" (16-bit on a GPU only).
        attention_backend: "numpy", "numba" (compiled CPU kernels, attention and layer ops),
            "cuda" or "cuda-emulated" (default: follows the device).
        max_model_len, block_size, max_num_seqs, max_num_batched_tokens,
        enable_chunked_prefill, num_kv_blocks, kv_cache_memory: see :class:`EngineConfig`.
        gpu_memory_utilization: on a GPU, the share (0-1] of its memory the engine may
            use; the KV pool gets what is left after the weights and a measured
            activation peak, as vLLM sizes it.
        log_stats: log one line per finished request and engine stats every few seconds.
        trace: record per-step events for :meth:`EngineMetrics.write_trace`.

    Raises:
        FileNotFoundError: the model directory or its files are missing.
        ValueError: an unsupported architecture, a bad checkpoint, or limits that cannot
            work together (e.g. ``max_model_len`` larger than the KV pool holds).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, device: str = "cpu", dtype: str = "auto",
                 attention_backend: str | None = None, max_model_len: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_chunked_prefill: bool = True, num_kv_blocks: int | None = None,
                 kv_cache_memory: int = 2 * 1024**3, gpu_memory_utilization: float = 0.9,
                 log_stats: bool = True, trace: bool = False):
        self.model_dir = resolve_model_dir(model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.device, xp = resolve_device(device)
        backend = attention_backend or ("cuda" if self.device == "cuda" else "numpy")
        if backend == "numba" and self.device != "cpu":
            raise ValueError("attention_backend='numba' runs on the CPU: use device='cpu'")
        self.attention_backend = backend

        mc = self.model_config
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len or mc.max_position_embeddings)
        self.config = EngineConfig(max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=enable_chunked_prefill, num_kv_blocks=num_kv_blocks,
                                   kv_cache_memory=kv_cache_memory, log_stats=log_stats)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} is invalid: must be in (0, 1]")
        self.dtype = dtype = resolve_dtype(dtype, self.device)
        attention = get_attention_backend(backend)
        if self.device == "cuda":
            ops = get_layer_ops("cuda", xp, kernels=attention)
        else:
            configure_threads(None)  # BLAS (and numba) threads sized to this process's cores
            ops = get_layer_ops("numba" if backend == "numba" else "numpy", xp)
        self.model = LlamaModel(self.model_dir, attention, ops, xp=xp, dtype=dtype)
        per_block = KVCache.bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads,
                                            mc.head_dim, dtype.itemsize)
        if num_kv_blocks is None and self.device == "cuda":
            num_kv_blocks = self._gpu_kv_blocks(per_block, gpu_memory_utilization)
        elif num_kv_blocks is None:
            num_kv_blocks = max(1, kv_cache_memory // per_block)
        pool_tokens = num_kv_blocks * block_size
        explicit_len = max_model_len is not None
        if max_model_len is None:
            max_model_len = min(mc.max_position_embeddings, pool_tokens)
        elif max_model_len > pool_tokens:
            raise ValueError(f"max_model_len={max_model_len} needs {cdiv(max_model_len, block_size)} KV blocks "
                             f"but the pool holds {num_kv_blocks} ({pool_tokens} tokens); "
                             "lower max_model_len or give the pool more memory")
        elif max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context "
                             f"(max_position_embeddings={mc.max_position_embeddings})")
        window = mc.sliding_window
        if window is not None and max_model_len > window:
            if explicit_len:
                raise ValueError(f"max_model_len={max_model_len} exceeds the model's sliding window ({window}); "
                                 "sliding-window attention is not implemented, so sequences must fit the window")
            logger.warning("capping max_model_len at the model's sliding window (%d): sliding-window attention "
                           "is not implemented", window)
            max_model_len = window
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"with enable_chunked_prefill=False, max_num_batched_tokens={max_num_batched_tokens} "
                             f"must be >= max_model_len={max_model_len} so every prompt fits one step")
        self.config.max_model_len = max_model_len
        self.config.num_kv_blocks = num_kv_blocks

        self.kv_cache = KVCache(mc.num_hidden_layers, num_kv_blocks, block_size, mc.num_key_value_heads,
                                mc.head_dim, dtype=dtype, xp=xp)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(eos_token_id=sorted(self.eos_token_ids))
        self.metrics = EngineMetrics(trace=trace)
        self.requests: dict[str, Request] = {}
        self._last_stats_log = time.monotonic()

    # --- set-up helpers ---------------------------------------------------------------
    def _gpu_kv_blocks(self, per_block: int, utilization: float) -> int:
        """KV blocks that fit in ``utilization`` of the GPU after weights and activations.

        The activation peak is measured, as vLLM's ``profile_run`` does: one forward pass
        of ``max_num_batched_tokens`` tokens through a throw-away cache, reading how much
        the CuPy memory pool had to hold.
        """
        import cupy

        cfg, mc = self.config, self.model_config
        pool = cupy.get_default_memory_pool()
        free, total = cupy.cuda.runtime.memGetInfo()
        held_before = pool.total_bytes()
        n = min(cfg.max_num_batched_tokens, mc.max_position_embeddings - 1)
        probe = Sequence("__profile__", None, [0] * n, SamplingParams(max_tokens=1), 0.0)
        scratch = KVCache(mc.num_hidden_layers, cdiv(n, cfg.block_size), cfg.block_size, mc.num_key_value_heads,
                          mc.head_dim, dtype=self.dtype, xp=cupy)
        probe.block_table = list(range(scratch.num_blocks))
        ModelRunner(self.model, scratch).execute([(probe, n)])
        cupy.cuda.Device().synchronize()
        activation_peak = pool.total_bytes() - held_before - scratch.num_blocks * per_block
        del scratch
        pool.free_all_blocks()
        free, total = cupy.cuda.runtime.memGetInfo()
        budget = total * utilization - (total - free) - max(activation_peak, 0)
        if budget < per_block:
            raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization} "
                             f"(weights and activations take {(total - free) / 2**30:.2f} GiB of "
                             f"{total / 2**30:.2f} GiB)")
        logger.info("KV cache: %d blocks (%.2f GiB); activation peak %.2f GiB", budget // per_block,
                    budget / 2**30, activation_peak / 2**30)
        return int(budget // per_block)

    def _load_tokenizer(self):
        if not (self.model_dir / "tokenizer.json").is_file():
            return None  # token-id prompts only (e.g. tiny test models)
        from refengine.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(self.model_dir)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()

        def add(value):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))

        add(self.model_config.eos_token_id)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            with open(gen) as f:
                add(json.load(f).get("eos_token_id"))
        if self.tokenizer is not None:
            add(sorted(self.tokenizer.eos_token_ids))
        return ids

    # --- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized with the special tokens the tokenizer config adds, e.g. a
                BOS for Llama, none for SmolLM2, as vLLM does) or a list of token ids (used as is).
            sampling_params: defaults to ``SamplingParams()``.
        Raises:
            ValueError: a duplicate id, an empty prompt, token ids outside the vocabulary,
                a prompt of ``max_model_len`` tokens or more, or one that needs more KV
                blocks than the whole pool; nothing is queued and no block is taken.
        """
        params = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json: pass prompts as token ids")
            # special tokens as the tokenizer config says (a BOS for Llama, none for SmolLM2), as vLLM does
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, token_ids = None, as_token_ids(prompt)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop_strings!r} need a tokenizer; {self.model_dir} has no tokenizer.json")
        self._check_prompt(token_ids)
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, text, token_ids, params, now, index=i) for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, token_ids, params) if self.tokenizer else None for _ in seqs]
        self.requests[request_id] = Request(request_id, text, token_ids, params, seqs, detoks,
                                            RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids)))
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_prompt(self, token_ids: list[int]) -> None:
        n, limit = len(token_ids), self.config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens but max_model_len is {limit}: "
                             f"it must be shorter than {limit} to leave room for one generated token")
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
        req.metrics.on_finished(time.monotonic())
        self.metrics.record_finished(req.metrics, "abort", request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running (keep calling :meth:`step`)."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running."""
        return len(self.requests)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step.

        Returns:
            One ``RequestOutput`` per request that got a token this step (finished ones
            included, with ``finished=True``); ``[]`` when nothing was scheduled. Requests
            in the middle of a chunked prefill do not appear.
        Raises:
            Whatever the model or sampler raises; the step's chunks are then not counted as
            computed, so the next step redoes them (the engine stays consistent).
        """
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        num_decode = 0
        for seq, n in sched.scheduled:
            if seq.index == 0:
                self.requests[seq.request_id].metrics.on_scheduled(t0)
            if n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == len(seq) - 1:
                num_decode += 1
        logits, sample_seqs = self.runner.execute(sched.scheduled)
        out = self.sampler(logits, sample_seqs) if sample_seqs else None
        # Only now, with every sampled token in hand, do the chunks count as computed.
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
        advanced: dict[str, Request] = {}
        if sample_seqs:
            now = time.monotonic()
            for i, seq in enumerate(sample_seqs):
                req = self.requests[seq.request_id]
                lp = out.logprobs[i] if out.logprobs is not None else None
                self._append_token(req, seq, int(out.token_ids[i]), lp, now)
                advanced[req.request_id] = req
        outputs = [self._make_output(req) for req in advanced.values()]
        now = time.monotonic()
        for req in advanced.values():
            if req.finished:
                del self.requests[req.request_id]
                req.metrics.on_finished(now)
                reason = req.seqs[0].finish_reason
                self.metrics.record_finished(req.metrics, reason, req.request_id)
                if self.config.log_stats:
                    self._log_finished(req)
        self.metrics.record_step(step_start=t0, step_duration=now - t0,
                                 num_prefill_tokens=sched.num_tokens - num_decode, num_decode_tokens=num_decode,
                                 num_generated_tokens=len(sample_seqs), num_seqs=len(sched.scheduled),
                                 num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                                 kv_cache_usage=self.block_manager.usage, num_preemptions=len(sched.preempted))
        if self.config.log_stats and now - self._last_stats_log >= STATS_INTERVAL_S:
            self._last_stats_log = now
            logger.info(EngineMetrics.format_log_line(self.metrics.stats_since_last_log()))
        return outputs

    def _append_token(self, req: Request, seq: Sequence, token: int, logprobs, now: float) -> None:
        """Add a sampled token, then apply the stop rules in vLLM's order."""
        params = seq.sampling_params
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if seq.index == 0:
            if req.metrics.first_token_time is None:
                req.metrics.on_token(now)
                self.metrics.record_first_token(req.metrics.ttft)
            else:
                last = req.metrics.token_times[-1]
                req.metrics.on_token(now)
                self.metrics.record_token_latency(now - last)
        n_out = seq.num_output_tokens
        detok = req.detokenizers[seq.index]
        finish = None
        may_stop = n_out >= params.min_tokens  # min_tokens holds off EOS, stop ids and stop strings
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            finish = ("stop", None)  # the EOS id stays in token_ids, never in the text
        elif may_stop and token in params.stop_token_ids:
            finish = ("stop", token)
        elif detok is not None:
            matched = detok.add_token(token)
            if matched is not None and may_stop:
                finish = ("stop", matched)
        if finish is None and params.max_tokens is not None and n_out >= params.max_tokens:
            finish = ("length", None)
        if finish is None and len(seq) >= self.config.max_model_len:
            finish = ("length", None)
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish
            self.scheduler.finish(seq)

    def _make_output(self, req: Request) -> RequestOutput:
        completions = []
        for seq, detok in zip(req.seqs, req.detokenizers):
            if detok is not None:
                delta = detok.get_delta()
                if seq.is_finished:
                    delta += detok.finish()
                    if detok.stop_string is not None and seq.stop_reason != detok.stop_string:
                        # the flushed tail (an incomplete character) completed a stop string
                        seq.finish_reason, seq.stop_reason = "stop", detok.stop_string
                text = detok.text
            else:
                delta, text = "", ""
            new_ids = seq.output_token_ids[seq.num_reported_tokens:]
            seq.num_reported_tokens = seq.num_output_tokens
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids), delta_token_ids=new_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.sampling_params.logprobs is not None else None,
                delta_text=delta))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished=req.finished, metrics=req.metrics)

    def _log_finished(self, req: Request) -> None:
        m = req.metrics

        def ms(x):
            return "n/a" if x is None else f"{x * 1e3:.1f}ms"

        logger.info("request %s finished: prompt_tokens=%d output_tokens=%d ttft=%s tpot=%s e2e=%s finish_reason=%s",
                    req.request_id, len(req.prompt_token_ids), sum(s.num_output_tokens for s in req.seqs),
                    ms(m.ttft), ms(m.tpot), ms(m.e2e_latency), req.seqs[0].finish_reason)

    # --- golden-test helper -----------------------------------------------------------------
    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every prompt position, for golden tests.

        Runs the prompt through the model in chunks of ``max_num_batched_tokens`` using
        its own KV blocks, which are freed afterwards.

        Returns:
            ``[len(token_ids), vocab_size]`` float32.
        Raises:
            ValueError: as :meth:`add_request` for a bad prompt, or not enough free blocks now.
        """
        token_ids = [int(t) for t in token_ids]
        self._check_prompt(token_ids)
        seq = Sequence("__prompt_logits__", None, token_ids, SamplingParams(max_tokens=1), time.monotonic())
        seq.status = SequenceStatus.RUNNING
        chunks = []
        try:
            while seq.num_computed_tokens < len(seq):
                n = min(self.config.max_num_batched_tokens, len(seq) - seq.num_computed_tokens)
                if not self.block_manager.can_allocate(seq, n):
                    raise ValueError(f"a {len(seq)}-token prompt needs {self.block_manager.blocks_needed(seq, n)} "
                                     f"more KV blocks now, {self.block_manager.num_free_blocks} are free")
                self.block_manager.allocate(seq, n)
                logits, _ = self.runner.execute([(seq, n)], all_logits=True)
                chunks.append(logits)
                seq.num_computed_tokens += n
        finally:
            self.block_manager.free(seq)
        return np.concatenate(chunks, axis=0)


class LLM:
    """Offline generation (vLLM's ``LLM``): ``LLM(model=DIR).generate(prompts, params)``.

    Keyword arguments go to :class:`LLMEngine`.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        self.llm_engine = LLMEngine(model, **kwargs)
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """See :meth:`LLMEngine.prompt_logits`."""
        return self.llm_engine.prompt_logits(token_ids)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; return one finished ``RequestOutput`` per prompt, in order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or a list with one per prompt.
            use_tqdm: show a progress bar.
        Raises:
            ValueError: a bad prompt or a params list of the wrong length; no request is
                left queued.
        """
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                rid = f"gen-{self._counter}"
                self._counter += 1
                engine.add_request(rid, prompt, params)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
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
