"""Gemma 2 (``Gemma2ForCausalLM``): Llama's projections with Gemma's layer shape.

As in transformers ``models/gemma2/modeling_gemma2.py`` (``Gemma2DecoderLayer``)::

    x = rms_norm(h) * (1 + w)                       # input_layernorm (Gemma's RMSNorm)
    h = h + rms_norm(attention(x)) * (1 + w')       # post_attention_layernorm
    x = rms_norm(h) * (1 + w'')                     # pre_feedforward_layernorm
    h = h + rms_norm(down(gelu_tanh(gate(x)) * up(x))) * (1 + w''')   # post_feedforward_layernorm

plus: embeddings scaled by ``sqrt(hidden_size)`` (``normalizer``, rounded to float32),
softmax scale ``query_pre_attn_scalar ** -0.5``, attention scores and final logits
soft-capped (``c * tanh(x / c)``, ``attn_logit_softcapping`` and ``final_logit_softcapping``),
and a sliding window on every other layer (``layer_types``; even layers slide by default).
Gemma's ``(1 + w)`` norm weights are added up once at load (:attr:`norm_offset`).
"""

from __future__ import annotations

import numpy as np

from refengine.attention import AttentionMetadata
from refengine.attention.kv_cache import LayerKVCache
from refengine.models.llama import Layer, LlamaForCausalLM


def default_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every ``pattern``-th layer (1-based) global, the others sliding: transformers'
    default ``layer_types`` for Gemma 2 (``pattern`` 2) and Gemma 3 (``sliding_window_pattern`` 6)."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def check_layer_types(layer_types, num_layers: int) -> tuple[str, ...]:
    """``config.json``'s ``layer_types`` as a tuple, checked.

    Raises:
        ValueError: not a list of ``num_layers`` entries, each ``"full_attention"`` or ``"sliding_attention"``.
    """
    kinds = ("full_attention", "sliding_attention")
    if not (isinstance(layer_types, list) and len(layer_types) == num_layers and all(t in kinds for t in layer_types)):
        raise ValueError(f"config.json: 'layer_types' must list {num_layers} entries (num_hidden_layers), each one of "
                         f"{kinds}; got {layer_types!r}")
    return tuple(layer_types)


class Gemma2ForCausalLM(LlamaForCausalLM):
    architecture = "Gemma2ForCausalLM"
    layer_tensors = dict(LlamaForCausalLM.layer_tensors, **{
        "pre_feedforward_layernorm.weight": lambda c: (c.hidden_size,),
        "post_feedforward_layernorm.weight": lambda c: (c.hidden_size,),
    })
    vectors = dict(LlamaForCausalLM.vectors, pre_ff_norm=("pre_feedforward_layernorm.weight",),
                   post_ff_norm=("post_feedforward_layernorm.weight",))
    norm_offset = 1.0
    #: transformers' defaults when ``config.json`` leaves a key out
    defaults = {"sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "pattern": 2}

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        """``sliding_window``, ``layer_types``, ``query_pre_attn_scalar``, the soft-caps and
        ``hidden_activation`` (transformers ``Gemma2Config`` defaults where absent; a soft-cap
        given as null is off)."""
        d = cls.defaults
        num_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        layer_types = (check_layer_types(layer_types, num_layers) if layer_types is not None
                       else default_layer_types(num_layers, int(cfg.get("sliding_window_pattern") or d["pattern"])))
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or d["hidden_activation"]
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"config.json: hidden_activation {activation!r} is not supported for "
                             f"{cls.architecture}; supported: gelu_pytorch_tanh")
        window = cfg.get("sliding_window", d["sliding_window"])

        def cap(key):
            value = cfg.get(key, d[key])
            return None if value is None else float(value)

        return {"attention_bias": bool(cfg.get("attention_bias", False)),
                "sliding_window": int(window) if window else None, "layer_types": layer_types,
                "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or d["query_pre_attn_scalar"]),
                "attn_logit_softcapping": cap("attn_logit_softcapping"),
                "final_logit_softcapping": cap("final_logit_softcapping"),
                "hidden_activation": "gelu_pytorch_tanh"}

    def embed_tokens(self, input_ids):
        """Embedding rows times ``sqrt(hidden_size)`` rounded to float32 (``Gemma2Model``'s normalizer)."""
        return super().embed_tokens(input_ids) * np.float32(self.config.hidden_size ** 0.5)

    def final_logits(self, h):
        logits = super().final_logits(h)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        c = np.float32(cap)
        return self.xp.tanh(logits / c) * c

    def decoder_layer(self, layer: Layer, h, positions, kv: LayerKVCache, meta: AttentionMetadata):
        """One ``Gemma2DecoderLayer``: ``h [T, hidden]`` float32 -> ``[T, hidden]`` float32."""
        ops, eps = self.ops, self.config.rms_norm_eps
        x = ops.rms_norm(h, layer.input_norm, eps)
        h = h + ops.rms_norm(self.self_attention(layer, x, positions, kv, meta), layer.post_norm, eps)
        x = ops.rms_norm(h, layer.pre_ff_norm, eps)
        return h + ops.rms_norm(self.mlp(layer, x), layer.post_ff_norm, eps)
