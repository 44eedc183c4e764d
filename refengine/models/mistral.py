"""Mistral (``MistralForCausalLM``): Llama's layers; ``config.json``'s ``sliding_window`` is
in force on every layer (transformers ``models/mistral/modeling_mistral.py``)."""

from __future__ import annotations

from refengine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    architecture = "MistralForCausalLM"

    @classmethod
    def config_fields(cls, cfg: dict) -> dict:
        window = cfg.get("sliding_window")
        return dict(super().config_fields(cfg), sliding_window=int(window) if window else None)
