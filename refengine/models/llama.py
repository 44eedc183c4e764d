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

Linear weights are ``[in, out]``-shaped (``x @ w``; in memory, the layout the layer ops
read fastest: :meth:`refengine.ops.LayerOps.weight`) and q/k/v and gate/up are fused
(:attr:`LlamaForCausalLM.fused`), so each layer does four matrix products.

Numerics: weights and the KV cache are in ``dtype`` (float32 on the CPU; float16 or
bfloat16 on a GPU); activations, norms, RoPE and softmax stay float32 and each matrix
product casts its input to the weight dtype (cuBLAS accumulates in float32).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from refengine.attention import AttentionBackend, AttentionMetadata
from refengine.config import ModelConfig
from refengine.kv_cache import KVCache, LayerKVCache
from refengine.layers import RotaryEmbedding
from refengine.ops import LayerOps
from refengine.quant import concat_rows, is_quantized

Shape = Callable[[ModelConfig], tuple[int, ...]]


def _q_out(c: ModelConfig) -> int:
    return c.num_attention_heads * c.head_dim


def _kv_out(c: ModelConfig) -> int:
    return c.num_key_value_heads * c.head_dim


class Layer:
    """One decoder layer's weights on the device, as attributes: fused ``[in, out]``-shaped
    matrices in the weight dtype, float32 vectors (norms, biases); ``None`` where absent."""

    qkv_bias = None

    def __init__(self, tensors: dict):
        self.__dict__.update(tensors)


class LlamaForCausalLM:
    """Weights plus the forward pass of a Llama-family decoder.

    Class attributes (the data a subclass overrides):
        architecture: ``config.json``'s ``architectures`` entry.
        layer_tensors: checkpoint tensor name (after ``model.layers.{i}.``) -> shape from the config.
        fused: device tensor -> the checkpoint matrices concatenated (on the output axis) into it.
        vectors: device tensor -> checkpoint vector (norms, biases), kept float32.

    Args:
        config: the parsed ``config.json``.
        weights: checkpoint name -> float32 array, as :func:`refengine.loader.load_weights`
            returns it (consumed: the dict is emptied).
        attention: the attention backend.
        ops: the layer operations.
        xp: ``numpy`` or ``cupy``.
        dtype: weight and KV cache dtype (float32 on the CPU; float16/bfloat16 on a GPU).
    """

    architecture = "LlamaForCausalLM"
    layer_tensors: dict[str, Shape] = {
        "input_layernorm.weight": lambda c: (c.hidden_size,),
        "post_attention_layernorm.weight": lambda c: (c.hidden_size,),
        "self_attn.q_proj.weight": lambda c: (_q_out(c), c.hidden_size),
        "self_attn.k_proj.weight": lambda c: (_kv_out(c), c.hidden_size),
        "self_attn.v_proj.weight": lambda c: (_kv_out(c), c.hidden_size),
        "self_attn.o_proj.weight": lambda c: (c.hidden_size, _q_out(c)),
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
        "self_attn.q_proj.bias": lambda c: (_q_out(c),),
        "self_attn.k_proj.bias": lambda c: (_kv_out(c),),
        "self_attn.v_proj.bias": lambda c: (_kv_out(c),),
    }

    # --- config.json -----------------------------------------------------------------
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
                 ops: LayerOps, xp=np, dtype=np.float32):
        self.config = cfg = config
        self.xp, self.dtype, self.attention, self.ops = xp, dtype, attention, ops
        w = weights
        self.embed = self._device_weight(w.pop("model.embed_tokens.weight"))  # [V, H], or quantized
        self.layers = [self._load_layer(w, f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]
        self.norm = xp.asarray(w.pop("model.norm.weight"), dtype=np.float32)
        if cfg.tie_word_embeddings:  # tied weights are one array: a view, or the quantized rows themselves
            self.lm_head = self.embed if is_quantized(self.embed) else self.embed.T
        else:
            lm_head = w.pop("lm_head.weight")
            self.lm_head = lm_head if is_quantized(lm_head) else xp.asarray(ops.weight(lm_head), dtype=dtype)
        if w:
            raise ValueError(f"unconsumed weights: {list(w)[:3]}")
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, xp=xp)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

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
            tensors[name] = xp.asarray(np.concatenate([w.pop(prefix + p) for p in parts]), dtype=np.float32)
        return Layer(tensors)

    def embed_tokens(self, input_ids):
        """``input_ids [T]`` -> ``[T, hidden]`` float32 rows of the embedding (dequantized
        row by row when it is stored quantized)."""
        if is_quantized(self.embed):
            return self.embed.select_rows(np.asarray(input_ids))
        return self.embed[input_ids].astype(self.xp.float32)

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
        h = ops.rms_norm(h[logits_indices], self.norm, eps)
        return ops.linear(h, self.lm_head)

    def decoder_layer(self, layer: Layer, h, positions, kv: LayerKVCache, meta: AttentionMetadata):
        """One ``LlamaDecoderLayer``: ``h [T, hidden]`` float32 -> ``[T, hidden]`` float32."""
        ops, cfg = self.ops, self.config
        eps = cfg.rms_norm_eps
        x = ops.rms_norm(h, layer.input_norm, eps)
        q, k, v = self.qkv_projection(layer, x)
        q, k = ops.rope(q, k, positions, self.rope)
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}  # None unless the cache is int8
        self.attention.write_kv(kv.k, kv.v, k.astype(kv.dtype, copy=False), v.astype(kv.dtype, copy=False), meta,
                                **scales)
        o = self.attention.forward(q.astype(kv.dtype, copy=False), kv.k, kv.v, meta, self.scale, **scales)
        h = h + ops.linear(o.reshape(o.shape[0], -1), layer.o)
        x = ops.rms_norm(h, layer.post_norm, eps)
        return h + ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up)), layer.down)

    def qkv_projection(self, layer: Layer, x):
        """``x [T, hidden]`` -> ``q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]`` float32, before RoPE."""
        cfg = self.config
        n_q, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = n_q * hd, n_kv * hd
        qkv = self.ops.linear(x, layer.qkv)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        T = qkv.shape[0]
        q = qkv[:, :q_size].reshape(T, n_q, hd)
        k = qkv[:, q_size:q_size + kv_size].reshape(T, n_kv, hd)
        v = qkv[:, q_size + kv_size:].reshape(T, n_kv, hd)
        return q, k, v
