"""The model registry: ``config.json``'s ``architectures`` -> the class that runs it."""


from __future__ import annotations

from pathlib import Path

import numpy as np

from refengine.config import ModelConfig
from refengine.loader import load_weights
from refengine.models.llama import LlamaForCausalLM
from refengine.models.mistral import MistralForCausalLM
from refengine.models.qwen2 import Qwen2ForCausalLM
from refengine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    cls.architecture: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
}


def get_model_class(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """The registered class for the first entry of ``config.json``'s ``architectures``.

    Raises:
        ValueError: missing or unsupported architecture; the message lists the supported ones.
    """
    arch = architectures[0] if architectures else None
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r} (config.json 'architectures': {architectures}); "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]


def load_model(model_dir: str | Path, config: ModelConfig, attention, ops, xp=np, dtype=np.float32):
    """Build the model of ``config.architecture`` from ``model_dir``'s checkpoint.

    The model class says which tensors it expects; :func:`refengine.loader.load_weights`
    checks the checkpoint against them strictly.

    Args:
        attention: the attention backend; ops: the layer operations; xp: ``numpy`` or
            ``cupy``; dtype: weight and KV cache dtype.
    Raises:
        FileNotFoundError, ValueError: from :func:`refengine.loader.load_weights`.
    """
    cls = MODEL_REGISTRY[config.architecture]
    weights = load_weights(model_dir, cls.checkpoint_shapes(config), config.tie_word_embeddings)
    return cls(config, weights, attention, ops, xp=xp, dtype=dtype)
