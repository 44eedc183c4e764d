"""OLMo 2 (``Olmo2ForCausalLM``): no norm before attention or MLP; instead a norm after each
(``post_attention_layernorm``, ``post_feedforward_layernorm``) inside the residual, and an
RMSNorm over the whole q and k projections (``q_norm [heads * head_dim]``, ``k_norm
[kv_heads * head_dim]``) before the heads are split. transformers
``models/olmo2/modeling_olmo2.py`` (``Olmo2Attention``, ``Olmo2DecoderLayer``)::

    h = h + rms_norm(attention(h))      # q = rms_norm(h @ Wq), k = rms_norm(h @ Wk)
    h = h + rms_norm(mlp(h))
"""

from __future__ import annotations

from refengine.attention import AttentionMetadata
from refengine.attention.kv_cache import LayerKVCache
from refengine.models.llama import Layer, LlamaForCausalLM, kv_size, q_size


class Olmo2ForCausalLM(LlamaForCausalLM):
    architecture = "Olmo2ForCausalLM"
    layer_tensors = {name: shape for name, shape in LlamaForCausalLM.layer_tensors.items()
                     if name != "input_layernorm.weight"}
    layer_tensors.update({
        "post_feedforward_layernorm.weight": lambda c: (c.hidden_size,),
        "self_attn.q_norm.weight": lambda c: (q_size(c),),
        "self_attn.k_norm.weight": lambda c: (kv_size(c),),
    })
    supports_tensor_parallel = False  # q_norm/k_norm normalize over every head at once
    vectors = {"post_norm": ("post_attention_layernorm.weight",), "post_ff_norm": ("post_feedforward_layernorm.weight",),
               "q_norm": ("self_attn.q_norm.weight",), "k_norm": ("self_attn.k_norm.weight",)}

    def qkv_projection(self, layer: Layer, x):
        cfg, ops = self.config, self.ops
        q, k, v = super().qkv_projection(layer, x)
        T = q.shape[0]
        q = ops.rms_norm(q.reshape(T, -1), layer.q_norm, cfg.rms_norm_eps).reshape(q.shape)
        k = ops.rms_norm(k.reshape(T, -1), layer.k_norm, cfg.rms_norm_eps).reshape(k.shape)
        return q, k, v

    def decoder_layer(self, layer: Layer, h, positions, kv: LayerKVCache, meta: AttentionMetadata):
        """One ``Olmo2DecoderLayer``: ``h [T, hidden]`` float32 -> ``[T, hidden]`` float32."""
        ops, eps = self.ops, self.config.rms_norm_eps
        h = h + ops.rms_norm(self.self_attention(layer, h, positions, kv, meta), layer.post_norm, eps)
        return h + ops.rms_norm(self.mlp(layer, h), layer.post_ff_norm, eps)
