"""Qwen2 (``Qwen2ForCausalLM``): Llama's layers with q/k/v biases (``attention_bias``
defaults to true); the sliding window applies only with ``use_sliding_window``
(transformers ``models/qwen2/modeling_qwen2.py``)."""

from __future__ import annotations

from refengine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"
    default_attention_bias = True

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        return {"attention_bias": bool(cfg.get("attention_bias", cls.default_attention_bias)),
                "sliding_window": int(window) if window else None}
