"""Qwen2 (``Qwen2ForCausalLM``): Llama's layers with q/k/v biases (``attention_bias``
defaults to true); the sliding window applies only with ``use_sliding_window``, on the
layers from ``max_window_layers`` on unless ``layer_types`` says otherwise (transformers
``models/qwen2/configuration_qwen2.py``, ``modeling_qwen2.py``)."""

from __future__ import annotations

from refengine.models.gemma2 import check_layer_types
from refengine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"
    default_attention_bias = True

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        num_layers = cfg["num_hidden_layers"]
        if cfg.get("layer_types") is not None:
            layer_types = check_layer_types(cfg["layer_types"], num_layers)
        else:
            first = cfg.get("max_window_layers", 28)
            layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
        return {"attention_bias": bool(cfg.get("attention_bias", cls.default_attention_bias)),
                "sliding_window": int(window) if window else None, "layer_types": layer_types}
