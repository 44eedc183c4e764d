"""One-row decode steps replayed from bound kernel calls: the numba CPU backend's answer to
the Python that surrounds a decode step's kernels.

A decode step of one sequence runs about thirteen kernels per layer (RMSNorm, the fused
q/k/v product, RoPE twice, the cache write, paged attention, the output product, the
residual add, ...). Each call in the model's forward (:meth:`LlamaForCausalLM.forward
<refengine.models.llama.LlamaForCausalLM.forward>`) allocates its output, checks its
arguments and picks its kernel, and at batch 1 that Python adds up to a noticeable share of
a step whose kernels take a few milliseconds. It is the problem vLLM solves on GPUs with
CUDA graphs (``vllm/worker/model_runner.py``, ``CUDAGraphRunner``): record a decode step's
launches once per batch size, with every buffer fixed, and replay them; only the step's
inputs are copied into their fixed buffers.

:class:`DecodeCapture` does the same for one decode row on the CPU. At its first step (and
again when the thread count or the attention partitions change) it binds every call of a
Llama decoder layer to fixed buffers: products through :meth:`NumbaOps.bind_linear
<refengine.ops.numba_ops.NumbaOps.bind_linear>`, the elementwise layers and attention
kernels with ``functools.partial``. A step then copies the token's embedding, position,
cache slot, block table and context length into place and calls each bound call in order.
The kernels are those the forward runs, with the same arguments, so the logits are the same
bits (``tests/kernels/test_numba_decode.py``). :meth:`DecodeCapture.for_model` says which models
qualify: the Llama decoder layer as written (Llama, Mistral, Qwen2, SmolLM2), the numba
layer ops and attention, one process, no sliding window or soft cap; any other step runs the
forward.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from refengine.attention import AttentionMetadata
from refengine.attention.numba_cpu import (DECODE_PARTS_PER_LAUNCH, SERIAL_DECODE_MAX_TOKENS, NumbaAttention,
                                           _kernel_views, _paged_decode, cache_writer, decode_partition_tokens)
from refengine.kv_cache import KVCache
from refengine.ops.numba_ops import (NumbaOps, _gelu_tanh_and_mul_blocks, _rms_norm_blocks, _rope_blocks,
                                     _silu_and_mul_blocks)
from refengine.runtime.numba_support import get_num_threads

#: The forward's methods a family must inherit from Llama unchanged for its decode steps to be
#: replayed (a family that overrides one computes something the replay does not).
LLAMA_METHODS = ("forward", "decoder_layer", "self_attention", "mlp", "qkv_projection", "embed_tokens",
                 "embedding_rows", "final_logits", "reduce")

#: ``hidden_activation`` -> the NumbaOps method the forward calls, and its kernel.
_ACTIVATIONS = {"silu": ("silu_and_mul", _silu_and_mul_blocks),
                "gelu_pytorch_tanh": ("gelu_tanh_and_mul", _gelu_tanh_and_mul_blocks)}


class DecodeCapture:
    """A model's one-row decode steps as bound kernel calls (see the module docstring).

    Args:
        model: a :class:`refengine.models.llama.LlamaForCausalLM` that :meth:`for_model` accepts.
        kv_cache: its paged cache (the bound calls hold its layers' arrays).
        max_model_len: the longest context a step may have (sizes the block table and the
            partition buffers); by default the pool's tokens, at most what one launch of the
            paged decode kernel takes (:data:`DECODE_PARTS_PER_LAUNCH` partitions).

    Call it as the forward with one token: ``capture(input_ids [1], positions [1], meta)`` ->
    ``[1, vocab_size]`` float32 logits of that row, a fresh array.

    Raises (from a call, before any kernel runs; the forward's errors for the same faults):
        ValueError: metadata of other than one sequence with one new token, a ``seq_len``
            outside ``[1, max_model_len]``, a block table without a block id inside the
            cache for each block of the context.
        IndexError: a position outside the RoPE tables, a slot outside the cache.
    """

    def __init__(self, model, kv_cache: KVCache, max_model_len: int | None = None):
        self.model, self.kv_cache = model, kv_cache
        cfg = model.config
        self.eps = cfg.rms_norm_eps
        self.block_size = kv_cache.block_size
        self.part = decode_partition_tokens(self.block_size)
        most = DECODE_PARTS_PER_LAUNCH * self.part
        self.max_model_len = min(kv_cache.num_blocks * self.block_size, most, max_model_len or most)
        hidden, hd = cfg.hidden_size, cfg.head_dim
        n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        q_size, kv_size = n_q * hd, n_kv * hd
        inter = cfg.intermediate_size
        f32 = np.float32
        # the fixed buffers: the residual stream h, the normed x, each product's output
        self.h = np.zeros((1, hidden), f32)
        self.x = np.zeros((1, hidden), f32)
        self.qkv = np.zeros((1, q_size + 2 * kv_size), f32)
        self.q = self.qkv[:, :q_size].reshape(1, n_q, hd)
        self.k = self.qkv[:, q_size:q_size + kv_size].reshape(1, n_kv, hd)
        self.v = self.qkv[:, q_size + kv_size:].reshape(1, n_kv, hd)
        self.attn = np.zeros((1, n_q, hd), f32)
        self.attn_rows = self.attn.reshape(1, q_size)
        self.o = np.zeros((1, hidden), f32)
        self.gate_up = np.zeros((1, 2 * inter), f32)
        self.act = np.zeros((1, inter), f32)
        # the step's inputs
        self.positions = np.zeros(1, np.int64)
        self.slot_mapping = np.zeros(1, np.int32)
        self.block_tables = np.zeros((1, -(-self.max_model_len // self.block_size)), np.int32)
        self.seqs = np.zeros(1, np.int32)  # decode sequence 0 is batch sequence 0, its query row 0
        self.rows = np.zeros(1, np.int32)
        most = -(-self.max_model_len // self.part)
        self.part_seq = np.zeros(most, np.int32)
        self.part_start = np.arange(most, dtype=np.int32) * self.part
        self.part_end = self.part_start + self.part
        self.scale = float(model.scale)
        self._activation = _ACTIVATIONS[cfg.hidden_activation][1]
        self._layers: list[list[Callable]] | None = None  # per layer: the bound calls before attention, after
        self._threads = 0
        self._attention: list[Callable] = []
        self._attention_key: tuple | None = None
        self._final: Callable | None = None
        self._rope_positions = min(layer.rope.cos.shape[0] for layer in model.layers)  # the shortest table

    @classmethod
    def for_model(cls, model, kv_cache: KVCache, max_model_len: int | None = None) -> "DecodeCapture | None":
        """A capture for ``model``, or None where its steps must run the forward: not the
        Llama decoder layer as written (:data:`LLAMA_METHODS`), not the numba layer ops and
        attention on NumPy arrays, a tensor-parallel share, a layer with a sliding window or
        soft cap, a cache other than float32, float16 or int8, or an activation other than
        SiLU or tanh-GELU."""
        from refengine.models.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM) or getattr(model, "tp", None) is not None:
            return None
        if any(getattr(type(model), name) is not getattr(LlamaForCausalLM, name) for name in LLAMA_METHODS):
            return None
        if (model.xp is not np or type(model.ops) is not NumbaOps or type(model.attention) is not NumbaAttention
                or model.config.hidden_activation not in _ACTIVATIONS):
            return None
        if model.activation != getattr(model.ops, _ACTIVATIONS[model.config.hidden_activation][0]):
            return None  # a family that picked its own activation
        if any(layer.attention_options for layer in model.layers):
            return None
        if kv_cache.k[0].dtype not in (np.float32, np.float16, np.int8) or kv_cache.dtype != np.float32:
            return None
        return cls(model, kv_cache, max_model_len)

    # --- binding ---------------------------------------------------------------------
    def _bind(self, threads: int) -> None:
        """Bind every call but attention's for ``threads`` numba threads (the products' kernels
        and task sizes depend on it)."""
        model, ops, eps = self.model, self.model.ops, self.eps
        h, x, o = self.h, self.x, self.o
        norm = _rms_norm_blocks.serial  # one row: the serial twin, as NumbaOps.rms_norm runs it
        layers = []  # assigned with the key below only once complete: a bind that raises leaves none
        for li, layer in enumerate(model.layers):
            kv = self.kv_cache.layer(li)
            before = [partial(norm, h, layer.input_norm, eps, x, 1), ops.bind_linear(x, layer.qkv, self.qkv)]
            if layer.qkv_bias is not None:
                before.append(partial(np.add, self.qkv, layer.qkv_bias, out=self.qkv))
            cos, sin = layer.rope.cos, layer.rope.sin
            before += [partial(_rope_blocks.serial, self.q, self.positions, cos, sin, 1),
                       partial(_rope_blocks.serial, self.k, self.positions, cos, sin, 1)]
            write, caches = cache_writer(kv.k, kv.v, kv.k_scale, kv.v_scale)
            before.append(partial(write, *caches, self.k, self.v, self.slot_mapping))
            after = [ops.bind_linear(self.attn_rows, layer.o, o), partial(np.add, h, o, out=h),
                     partial(norm, h, layer.post_norm, eps, x, 1),
                     ops.bind_linear(x, layer.gate_up, self.gate_up),
                     partial(self._activation.serial, self.gate_up, self.act, 1),
                     ops.bind_linear(self.act, layer.down, o), partial(np.add, h, o, out=h)]
            layers.append([before, after])
        self._layers, self._final, self._threads = layers, partial(norm, h, model.norm, eps, x, 1), threads

    def _bind_attention(self, parts: int, serial: bool) -> None:
        """Bind each layer's paged decode over the first ``parts`` partitions."""
        decode = _paged_decode.serial if serial else _paged_decode
        seq, start, end = self.part_seq[:parts], self.part_start[:parts], self.part_end[:parts]
        calls = []
        for li in range(len(self.model.layers)):
            kv = self.kv_cache.layer(li)
            kc, vc = _kernel_views(kv.k, kv.v)
            calls.append(partial(decode, self.q, kc, vc, kv.k_scale, kv.v_scale, self.block_tables,
                                 self.seqs, self.rows, seq, start, end, self.scale, None, self.attn))
        self._attention, self._attention_key = calls, (parts, serial)

    # --- a step ----------------------------------------------------------------------
    def __call__(self, input_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> np.ndarray:
        if meta.num_seqs != 1 or meta.num_tokens != 1 or len(input_ids) != 1:
            raise ValueError(f"a captured decode step takes one sequence with one new token, got "
                             f"{meta.num_seqs} sequences and {meta.num_tokens} tokens")
        seq_len, pos = int(meta.seq_lens[0]), int(positions[0])
        if not 0 < seq_len <= self.max_model_len:
            raise ValueError(f"seq_len {seq_len} outside [1, max_model_len={self.max_model_len}]")
        if not 0 <= pos < self._rope_positions:
            raise IndexError(f"position {pos} outside the RoPE tables [0, {self._rope_positions})")
        cache = self.kv_cache.k[0]
        slot = int(meta.slot_mapping[0])
        if not 0 <= slot < cache.shape[0] * cache.shape[1]:
            raise IndexError(f"slot_mapping entry {slot} outside the KV cache's "
                             f"{cache.shape[0] * cache.shape[1]} slots")
        blocks = -(-seq_len // self.block_size)
        table = np.asarray(meta.block_tables)[0, :blocks]
        if blocks > table.shape[0] or table.min() < 0 or table.max() >= cache.shape[0]:  # as the forward: ValueError
            raise ValueError(f"block table of {table.shape[0]} entries {table.tolist()[:8]} does not give "
                             f"{blocks} block ids inside the cache's {cache.shape[0]} blocks")
        threads = get_num_threads()
        if self._layers is None or threads != self._threads:
            self._bind(threads)
        parts = -(-seq_len // self.part)
        key = (parts, seq_len < SERIAL_DECODE_MAX_TOKENS)
        if key != self._attention_key:
            self.part_end[:] = self.part_start + self.part
            self._bind_attention(*key)
        # the inputs into their buffers
        self.positions[0] = pos
        self.slot_mapping[0] = slot
        self.block_tables[0, :blocks] = table
        self.part_end[parts - 1] = seq_len
        np.copyto(self.h, self.model.embedding_rows(input_ids))
        for (before, after), attention in zip(self._layers, self._attention, strict=True):
            for call in before:
                call()
            attention()
            for call in after:
                call()
        self._final()
        return self.model.ops.linear(self.x, self.model.lm_head)

