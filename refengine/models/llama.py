"""Llama (``LlamaForCausalLM``): the forward pass over a flat batch of tokens from many sequences.

The other families in this package subclass it and change only what differs (declared as
class attributes where possible). One code path for NumPy (CPU) and CuPy (GPU): array
creation goes through ``xp``; the layer operations (RMSNorm, RoPE, SiLU-and-mul, matrix
products) through a :class:`refengine.ops.LayerOps`; attention through an
:class:`refengine.attention.AttentionBackend`.

Per layer, as in transformers ``models/llama/modeling_llama.py`` (``LlamaDecoderLayer``)::

    x = rms_norm(h)                         # input_layernorm
    q, k, v = x @ W_qkv  (+ bias)           # one fused projection
    q, k = rms_norm(q), rms_norm(k)         # Qwen3 only, per head (models/qwen3.py)
    q, k = rope(q, k, positions)
    cache[slot_mapping] = k, v              # write first ...
    o = attention(q, cache, meta)           # ... then read through the block tables
    h = h + o @ W_o
    h = h + down(silu(gate(x')) * up(x'))   # x' = rms_norm(h), post_attention_layernorm

Each matrix is either a float array, ``[in, out]``-shaped (``x @ w``; in memory, the
layout the layer ops read fastest: :meth:`refengine.ops.LayerOps.weight`), or a quantized
weight ``[out, in]`` as stored or loaded (:class:`refengine.quant.QuantizedWeight`: GGUF
blocks, int8 with per-channel scales, AWQ/GPTQ 4-bit groups) that the layer ops'
``linear`` dequantizes on the fly. The code here never asks which. q/k/v and gate/up are
fused (:attr:`LlamaForCausalLM.fused`), so each layer does four matrix products.

Numerics: float weights and the KV cache are in ``dtype`` (float32 on the CPU; float16 or
bfloat16 on a GPU); activations, norms, RoPE and softmax stay float32 and each matrix
product casts its input to the weight dtype (cuBLAS accumulates in float32).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from refengine.attention import AttentionBackend, AttentionMetadata
from refengine.attention.kv_cache import KVCache, LayerKVCache
from refengine.config import ModelConfig
from refengine.ops import LayerOps
from refengine.ops.layers import RotaryEmbedding
from refengine.quant import concat_rows, is_quantized

Shape = Callable[[ModelConfig], tuple[int, ...]]


def q_size(c: ModelConfig) -> int:
    return c.num_attention_heads * c.head_dim


def kv_size(c: ModelConfig) -> int:
    return c.num_key_value_heads * c.head_dim


#: Rows per slice of a CPU chunk's MLP (:meth:`LlamaForCausalLM.mlp`).
MLP_CHUNK_ROWS = 256


class Layer:
    """One decoder layer on the device, as attributes: fused matrices (``[in, out]``-shaped
    float arrays in the weight dtype, or quantized weights), float32 vectors (norms, biases; ``None`` where absent), its
    :class:`RotaryEmbedding` (``rope``) and its attention keywords (``attention_options``:
    ``sliding_window``, ``logits_soft_cap`` where the layer has them)."""

    qkv_bias = None
    rope: RotaryEmbedding
    attention_options: dict

    def __init__(self, tensors: dict):
        self.__dict__.update(tensors)


class LlamaForCausalLM:
    """Weights plus the forward pass of a Llama-family decoder.

    Class attributes (the data a subclass overrides):
        architecture: ``config.json``'s ``architectures`` entry.
        layer_tensors: checkpoint tensor name (after ``model.layers.{i}.``) -> shape from the config.
        fused: device tensor -> the checkpoint matrices concatenated (on the output axis) into it.
        vectors: device tensor -> checkpoint vector (norms, biases), kept float32.
        norm_offset: added to every RMSNorm weight at load (Gemma's ``x * (1 + w)``: 1.0).

    Args:
        config: the parsed ``config.json``.
        weights: checkpoint name -> array in the load dtype, or a
            :class:`refengine.quant.QuantizedWeight` (GGUF blocks, int8, AWQ/GPTQ), as
            :func:`refengine.models.load_model` reads them (consumed: the dict is emptied).
        attention: the attention backend.
        ops: the layer operations.
        xp: ``numpy`` or ``cupy``.
        dtype: float weights' and the KV cache's dtype (float32 on the CPU; float16/bfloat16
            on a GPU); quantized weights stay as they are.
        max_model_len: the longest context the engine allows, None for
            ``max_position_embeddings``: it sizes the RoPE tables (positions ``0 ..
            max_model_len - 1``, so a file claiming a huge context costs nothing unless
            the engine allows it) and fixes RoPE's static choices.
    """

    architecture = "LlamaForCausalLM"
    layer_tensors: dict[str, Shape] = {
        "input_layernorm.weight": lambda c: (c.hidden_size,),
        "post_attention_layernorm.weight": lambda c: (c.hidden_size,),
        "self_attn.q_proj.weight": lambda c: (q_size(c), c.hidden_size),
        "self_attn.k_proj.weight": lambda c: (kv_size(c), c.hidden_size),
        "self_attn.v_proj.weight": lambda c: (kv_size(c), c.hidden_size),
        "self_attn.o_proj.weight": lambda c: (c.hidden_size, q_size(c)),
        "mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    }
    fused: dict[str, tuple[str, ...]] = {
        "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "o": ("self_attn.o_proj.weight",),
        "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "down": ("mlp.down_proj.weight",),
    }
    vectors: dict[str, tuple[str, ...]] = {
        "input_norm": ("input_layernorm.weight",),
        "post_norm": ("post_attention_layernorm.weight",),
    }
    # q/k/v biases, present when config.json sets attention_bias (Qwen2 by default)
    bias_tensors: dict[str, Shape] = {
        "self_attn.q_proj.bias": lambda c: (q_size(c),),
        "self_attn.k_proj.bias": lambda c: (kv_size(c),),
        "self_attn.v_proj.bias": lambda c: (kv_size(c),),
    }

    norm_offset = 0.0
    #: Whether the family runs under tensor parallelism (OLMo 2's q/k norms span all heads).
    supports_tensor_parallel = True
    #: This worker's :class:`refengine.parallel.TensorParallelShard` when the model runs as one
    #: share of ``tensor_parallel_size > 1``; None in one process (no collectives at all).
    tp = None
    #: This step's rows grouped by LoRA adapter (:class:`refengine.lora.LoRABatch`), set by the
    #: model runner around a forward; None: no row has an adapter (the base model's products only).
    lora_batch = None

    # --- config.json -----------------------------------------------------------------
    @classmethod
    def normalize_config(cls, cfg: dict) -> dict:
        """``config.json`` as the generic reader (:mod:`refengine.models.hf_config`) expects
        it; a family whose files say things another way rewrites them here (Llama: as is)."""
        return cfg

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        """Family-specific :class:`ModelConfig` fields read from a parsed ``config.json``:
        ``attention_bias`` and ``sliding_window`` (Llama: bias as the config says, no window)."""
        return {"attention_bias": bool(cfg.get("attention_bias", False)), "sliding_window": None}

    # --- checkpoint ----------------------------------------------------------------------
    @classmethod
    def checkpoint_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold: HF name -> shape implied by ``config.json``."""
        h = cfg.hidden_size
        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        layer = cls.layer_shapes(cfg)
        for i in range(cfg.num_hidden_layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    @classmethod
    def layer_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """One layer's tensors (names after ``model.layers.{i}.``) -> shapes."""
        tensors = dict(cls.layer_tensors, **(cls.bias_tensors if cfg.attention_bias else {}))
        return {name: shape(cfg) for name, shape in tensors.items()}

    @classmethod
    def layer_vectors(cls, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
        """Device vector -> the checkpoint vectors concatenated into it, for ``cfg``."""
        if cfg.attention_bias:
            return dict(cls.vectors, qkv_bias=tuple(cls.bias_tensors))
        return cls.vectors

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], attention: AttentionBackend,
                 ops: LayerOps, xp=np, dtype=np.float32, max_model_len: int | None = None):
        self.config = cfg = config
        self.xp, self.dtype, self.attention, self.ops = xp, dtype, attention, ops
        w = weights
        self.embed = self._device_weight(w.pop("model.embed_tokens.weight"))  # [V, H], or quantized
        self.layers = [self._load_layer(w, f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]
        self.norm = xp.asarray(w.pop("model.norm.weight").astype(np.float32) + np.float32(self.norm_offset))
        if cfg.tie_word_embeddings:  # tied weights are one array: a view, or the quantized rows themselves
            self.lm_head = self.embed if is_quantized(self.embed) else self.embed.T
        else:
            lm_head = w.pop("lm_head.weight")
            self.lm_head = lm_head if is_quantized(lm_head) else xp.asarray(ops.weight(lm_head), dtype=dtype)
        if w:
            raise ValueError(f"unconsumed weights: {list(w)[:3]}")
        # No sequence goes past max_model_len, so the tables stop there, not at the model's context.
        positions = cfg.max_position_embeddings if max_model_len is None else max_model_len
        self.rope = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, xp=xp,
                                    max_model_len=max_model_len)
        local_rope = self.rope
        if cfg.rope_local_base_freq is not None:  # Gemma 3: the sliding layers rotate with their own base
            local_rope = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_local_base_freq,
                                         cfg.rope_local_scaling, xp=xp, max_model_len=max_model_len)
        for i, layer in enumerate(self.layers):
            layer.index = i  # the LoRA adapters' layer (project)
            window = cfg.layer_window(i)
            layer.rope = local_rope if window is not None else self.rope
            layer.attention_options = {}
            if window is not None:
                layer.attention_options["sliding_window"] = window
            if cfg.attn_logit_softcapping is not None:
                layer.attention_options["logits_soft_cap"] = float(cfg.attn_logit_softcapping)
        self.scale = 1.0 / math.sqrt(cfg.query_pre_attn_scalar or cfg.head_dim)
        self._activation = self.ACTIVATIONS[cfg.hidden_activation]

    #: ``hidden_activation`` -> the :class:`LayerOps` method of the MLP's activation-and-multiply.
    ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}

    def activation(self, x):
        """The MLP's activation of ``x [T, 2I]`` float32 (gate | up) -> ``act(gate) * up`` ``[T, I]`` float32."""
        return getattr(self.ops, self._activation)(x)

    def _device_weight(self, matrix):
        """A checkpoint matrix on the device: a float array in ``dtype``, or a quantized
        weight as it is (:mod:`refengine.quant`; the layer ops dequantize it on the fly)."""
        return matrix if is_quantized(matrix) else self.xp.asarray(matrix, dtype=self.dtype)

    def _load_layer(self, w: dict, prefix: str) -> Layer:
        xp, tensors = self.xp, {}
        for name, parts in self.fused.items():  # HF stores [out, in]; the layer ops pick the layout
            matrix = concat_rows([w.pop(prefix + p) for p in parts])
            tensors[name] = matrix if is_quantized(matrix) else xp.asarray(self.ops.weight(matrix), dtype=self.dtype)
        for name, parts in self.layer_vectors(self.config).items():
            vector = np.concatenate([w.pop(prefix + p) for p in parts]).astype(np.float32)
            if self.norm_offset and name.endswith("norm"):
                vector += np.float32(self.norm_offset)  # float32(1 + w), as the HF norm computes it
            tensors[name] = xp.asarray(vector)
        return Layer(tensors)

    def embed_tokens(self, input_ids):
        """``input_ids [T]`` -> ``[T, hidden]`` float32 rows of the embedding (dequantized
        row by row when it is stored quantized); a tensor-parallel shard holds some rows only
        and the workers sum their lookups (:meth:`refengine.parallel.TensorParallelShard.embedding`)."""
        if self.tp is not None:
            return self.tp.embedding(self.embedding_rows, input_ids, self.xp)
        return self.embedding_rows(input_ids)

    def embedding_rows(self, input_ids):
        """Rows ``input_ids [T]`` of the embedding this process holds, float32 ``[T, hidden]``."""
        return self.ops.embedding(self.embed, input_ids)

    def final_logits(self, h):
        """``h [S, hidden]`` float32 after the final norm -> ``[S, vocab_size]`` float32 logits
        (a tensor-parallel shard computes its vocabulary columns and the workers gather them)."""
        logits = self.ops.linear(h, self.lm_head)
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def reduce(self, x):
        """A row-parallel product's output ``x [T, hidden]`` float32 made whole: the sum of
        every tensor-parallel worker's partial (Megatron-LM's ``g``, one all-reduce), ``x``
        itself in one process."""
        return x if self.tp is None else self.tp.all_reduce(x)

    # --- forward -----------------------------------------------------------------------
    def forward(self, input_ids, positions, kv_cache: KVCache, meta: AttentionMetadata, logits_indices):
        """Run the model over a flat batch; write its K/V into the cache; return logits.

        Args:
            input_ids: ``[T]`` int token ids of every sequence's new tokens, concatenated.
            positions: ``[T]`` int64 NumPy (host) array, the position of each token in its sequence.
            kv_cache: the paged cache (written at ``meta.slot_mapping``).
            meta: the attention metadata of this batch.
            logits_indices: ``[S]`` int rows of the flat batch whose logits are wanted
                (the last token of each sequence that samples, or every row).
        Returns:
            ``[S, vocab_size]`` float32 logits.
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        positions = ops.device_positions(positions)
        self.attention.prepare(meta)
        h = self.embed_tokens(input_ids)
        for li, layer in enumerate(self.layers):
            h = self.decoder_layer(layer, h, positions, kv_cache.layer(li), meta)
        return self.final_logits(ops.rms_norm(h[logits_indices], self.norm, eps))

    def decoder_layer(self, layer: Layer, h, positions, kv: LayerKVCache, meta: AttentionMetadata):
        """One ``LlamaDecoderLayer``: ``h [T, hidden]`` float32 -> ``[T, hidden]`` float32."""
        ops, cfg = self.ops, self.config
        eps = cfg.rms_norm_eps
        x = ops.rms_norm(h, layer.input_norm, eps)
        h = h + self.self_attention(layer, x, positions, kv, meta)
        x = ops.rms_norm(h, layer.post_norm, eps)
        return h + self.mlp(layer, x)

    def self_attention(self, layer: Layer, x, positions, kv: LayerKVCache, meta: AttentionMetadata):
        """``x [T, hidden]`` float32 (normed) -> the attention block's output ``[T, hidden]``
        float32, after ``o_proj``: q/k/v, RoPE, the cache write, attention over the cache."""
        q, k, v = self.qkv_projection(layer, x)
        q, k = self.ops.rope(q, k, positions, layer.rope)
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}  # None unless the cache is int8 or fp8
        self.attention.write_kv(kv.k, kv.v, k.astype(kv.dtype, copy=False), v.astype(kv.dtype, copy=False), meta,
                                **scales)
        o = self.attention.forward(q.astype(kv.dtype, copy=False), kv.k, kv.v, meta, self.scale,
                                   **layer.attention_options, **scales)
        return self.reduce(self.project(o.reshape(o.shape[0], -1), layer, "o"))

    def mlp(self, layer: Layer, x):
        """``x [T, hidden]`` float32 (normed) -> ``down(act(gate(x)) * up(x))`` ``[T, hidden]`` float32.

        On the CPU, a chunk of more than :data:`MLP_CHUNK_ROWS` rows runs in slices of that
        many: the ``[T, 2 * intermediate]`` and ``[T, intermediate]`` activations are the
        largest arrays of a prefill step (9 MB at SmolLM2's 512 rows), and the products are
        as fast on 256 rows as on 512. Rows do not meet in an MLP, so the slices give each
        row what the whole chunk gives it (bit for bit where the products are batch-invariant)."""
        rows = x.shape[0]
        if self.xp is not np or rows <= MLP_CHUNK_ROWS:
            return self.reduce(self.project(self.activation(self.project(x, layer, "gate_up")), layer, "down"))
        out = np.empty_like(x)
        for r0 in range(0, rows, MLP_CHUNK_ROWS):
            r1 = min(rows, r0 + MLP_CHUNK_ROWS)
            gate_up = self.project(x[r0:r1], layer, "gate_up", first_row=r0)
            out[r0:r1] = self.project(self.activation(gate_up), layer, "down", first_row=r0)
        return self.reduce(out)

    def project(self, x, layer: Layer, name: str, first_row: int = 0):
        """``x [T, in]`` float32 times ``layer``'s fused projection ``name`` (``qkv``, ``o``,
        ``gate_up``, ``down``) -> ``[T, out]`` float32: the layer ops' product with the weight
        as stored, then, on the rows whose sequence runs a LoRA adapter, its
        ``(x A) B · scale`` added (:mod:`refengine.lora`; rows of no adapter keep the product's
        bits). ``first_row``: the batch row ``x[0]`` is (the chunked MLP's slices)."""
        y = self.ops.linear(x, getattr(layer, name))
        if self.lora_batch is not None:
            self.lora_batch.apply(self.ops, y, x, layer.index, name, first_row)
        return y

    def qkv_projection(self, layer: Layer, x):
        """``x [T, hidden]`` -> ``q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]`` float32, before RoPE."""
        cfg = self.config
        n_q, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = n_q * hd, n_kv * hd
        qkv = self.project(x, layer, "qkv")
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        T = qkv.shape[0]
        q = qkv[:, :q_size].reshape(T, n_q, hd)
        k = qkv[:, q_size:q_size + kv_size].reshape(T, n_kv, hd)
        v = qkv[:, q_size + kv_size:].reshape(T, n_kv, hd)
        return q, k, v
