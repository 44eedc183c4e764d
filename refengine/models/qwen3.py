"""Qwen3 (``Qwen3ForCausalLM``): Qwen2's layers without default biases, plus a per-head
RMSNorm on q and k before RoPE (``q_norm``, ``k_norm``; transformers
``models/qwen3/modeling_qwen3.py``, ``Qwen3Attention.forward``)."""

from __future__ import annotations

from refengine.models.llama import Layer
from refengine.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    architecture = "Qwen3ForCausalLM"
    default_attention_bias = False
    layer_tensors = dict(Qwen2ForCausalLM.layer_tensors, **{
        "self_attn.q_norm.weight": lambda c: (c.head_dim,),
        "self_attn.k_norm.weight": lambda c: (c.head_dim,),
    })
    vectors = dict(Qwen2ForCausalLM.vectors, q_norm=("self_attn.q_norm.weight",), k_norm=("self_attn.k_norm.weight",))

    def qkv_projection(self, layer: Layer, x):
        q, k, v = super().qkv_projection(layer, x)
        eps = self.config.rms_norm_eps
        return self.ops.rms_norm(q, layer.q_norm, eps), self.ops.rms_norm(k, layer.k_norm, eps), v
