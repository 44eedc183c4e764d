"""Phi-3 (``Phi3ForCausalLM``): Llama's layer with the projections stored fused in the
checkpoint (``self_attn.qkv_proj`` rows ``[q | k | v]``, ``mlp.gate_up_proj`` rows
``[gate | up]``: the fusions refengine makes for Llama, already made), head_dim 96 in the
released models, ``longrope`` scaling (:func:`refengine.ops.layers.rope_inv_freq`), and the
config's ``sliding_window`` on every layer where it is set. transformers
``models/phi3/modeling_phi3.py`` (``Phi3Attention``, ``Phi3MLP``).
"""

from __future__ import annotations

from refengine.models.llama import LlamaForCausalLM, kv_size, q_size


class Phi3ForCausalLM(LlamaForCausalLM):
    architecture = "Phi3ForCausalLM"
    layer_tensors = {
        "input_layernorm.weight": lambda c: (c.hidden_size,),
        "post_attention_layernorm.weight": lambda c: (c.hidden_size,),
        "self_attn.qkv_proj.weight": lambda c: (q_size(c) + 2 * kv_size(c), c.hidden_size),
        "self_attn.o_proj.weight": lambda c: (c.hidden_size, q_size(c)),
        "mlp.gate_up_proj.weight": lambda c: (2 * c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    }
    fused = {"qkv": ("self_attn.qkv_proj.weight",), "o": ("self_attn.o_proj.weight",),
             "gate_up": ("mlp.gate_up_proj.weight",), "down": ("mlp.down_proj.weight",)}

    @classmethod
    def normalize_config(cls, cfg: dict) -> dict:
        """Early Phi-3 files call longrope ``"su"`` or ``"yarn"``; transformers' ``Phi3Config``
        reads both as ``"longrope"``, and so does this."""
        for key in ("rope_scaling", "rope_parameters"):
            rope = cfg.get(key)
            if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
                cfg = dict(cfg, **{key: dict(rope, rope_type="longrope")})
                cfg[key].pop("type", None)
        return cfg

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        """``sliding_window`` on every layer where set; ``partial_rotary_factor`` below 1 is refused."""
        factor = cfg.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise ValueError(f"config.json: partial_rotary_factor={factor!r} is not supported (RoPE over the "
                             "whole head only)")
        window = cfg.get("sliding_window")
        return {"attention_bias": False, "sliding_window": int(window) if window else None}
