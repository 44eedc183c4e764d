"""Gemma 3 text (``Gemma3ForCausalLM``): Gemma 2's layers plus a per-head RMSNorm on q and k
(``q_norm``, ``k_norm``, Gemma's ``(1 + w)``), no soft-capping by default, five sliding
layers in six (``sliding_window_pattern``/``layer_types``), and two RoPE bases: the sliding
layers rotate with ``rope_local_base_freq`` (10,000), the global ones with ``rope_theta``
(1,000,000) and its scaling. transformers ``models/gemma3/modeling_gemma3.py``
(``Gemma3Attention``, ``Gemma3DecoderLayer``, ``Gemma3RotaryEmbedding``).

transformers 5 writes the two RoPE settings as ``rope_parameters = {"full_attention": {...},
"sliding_attention": {...}}``; older files as ``rope_theta``, ``rope_scaling`` and
``rope_local_base_freq``. :meth:`Gemma3ForCausalLM.normalize_config` reads both.
"""

from __future__ import annotations

from refengine.models.gemma2 import Gemma2ForCausalLM
from refengine.models.llama import Layer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architecture = "Gemma3ForCausalLM"
    layer_tensors = dict(Gemma2ForCausalLM.layer_tensors, **{
        "self_attn.q_norm.weight": lambda c: (c.head_dim,),
        "self_attn.k_norm.weight": lambda c: (c.head_dim,),
    })
    vectors = dict(Gemma2ForCausalLM.vectors, q_norm=("self_attn.q_norm.weight",), k_norm=("self_attn.k_norm.weight",))
    defaults = dict(Gemma2ForCausalLM.defaults, attn_logit_softcapping=None, final_logit_softcapping=None, pattern=6,
                    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)

    @classmethod
    def normalize_config(cls, cfg: dict) -> dict:
        """Global RoPE settings as ``rope_parameters``/``rope_theta``, the local ones as
        ``rope_local_base_freq`` and ``_rope_local_scaling`` (Gemma 3's defaults where absent)."""
        cfg = dict(cfg)
        params = cfg.get("rope_parameters")
        local = {}
        if isinstance(params, dict) and ({"full_attention", "sliding_attention"} & set(params)):
            full = dict(params.get("full_attention") or {"rope_type": "default"})
            local = dict(params.get("sliding_attention") or {})
            full.setdefault("rope_theta", cfg.get("rope_theta") or cls.defaults["rope_theta"])
            cfg["rope_parameters"] = full
            cfg.pop("rope_scaling", None)
            cfg.pop("rope_theta", None)  # inside rope_parameters now
        elif cfg.get("rope_theta") is None and not (params or {}).get("rope_theta"):
            cfg["rope_theta"] = cls.defaults["rope_theta"]
        base = local.get("rope_theta") or cfg.get("rope_local_base_freq") or cls.defaults["rope_local_base_freq"]
        cfg["rope_local_base_freq"] = float(base)
        rope_type = local.get("rope_type", local.get("type", "default"))
        cfg["_rope_local_scaling"] = None if rope_type == "default" else dict(local, rope_type=rope_type)
        return cfg

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        return dict(super().config_fields(cfg), rope_local_base_freq=cfg["rope_local_base_freq"],
                    rope_local_scaling=cfg["_rope_local_scaling"])

    def qkv_projection(self, layer: Layer, x):
        q, k, v = super().qkv_projection(layer, x)
        eps = self.config.rms_norm_eps
        return self.ops.rms_norm(q, layer.q_norm, eps), self.ops.rms_norm(k, layer.k_norm, eps), v
