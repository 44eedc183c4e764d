"""The model registry: ``config.json``'s ``architectures`` -> the class that runs it."""


from __future__ import annotations

from pathlib import Path

import numpy as np

from refengine.config import ModelConfig
from refengine.formats.gguf_file import is_gguf, open_gguf
from refengine.formats.loader import check_weights, load_weights
from refengine.models.gemma2 import Gemma2ForCausalLM
from refengine.models.gemma3 import Gemma3ForCausalLM
from refengine.models.llama import LlamaForCausalLM
from refengine.models.mistral import MistralForCausalLM
from refengine.models.olmo2 import Olmo2ForCausalLM
from refengine.models.phi3 import Phi3ForCausalLM
from refengine.models.qwen2 import Qwen2ForCausalLM
from refengine.models.qwen3 import Qwen3ForCausalLM
from refengine.quant.awq_gptq import CHECKPOINT_METHODS, checkpoint_quantization, resolve_quantization
from refengine.quant.int8 import quantize_weights

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    cls.architecture: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                      Gemma2ForCausalLM, Gemma3ForCausalLM, Olmo2ForCausalLM, Phi3ForCausalLM)
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


def load_model(model_dir: str | Path, config: ModelConfig, attention, ops, xp=np, dtype=np.float32,
               dequantize_gguf: bool = False, quantization: str | None = None, max_model_len: int | None = None,
               partition=None):
    """Build the model of ``config.architecture`` from ``model_dir``'s checkpoint.

    The model class says which tensors it expects; :func:`refengine.formats.loader.load_weights`
    checks the checkpoint against them strictly. ``model_dir`` may also be a GGUF file
    (:mod:`refengine.formats.gguf_file`): its matrices stay in their stored block types unless
    ``dequantize_gguf`` (then float32, as ``convert-gguf`` writes them).

    Args:
        attention: the attention backend; ops: the layer operations; xp: ``numpy`` or
            ``cupy``; dtype: weight and KV cache dtype; quantization: the engine option
            (None: as the checkpoint is; ``"int8"``: every float matrix quantized at load;
            ``"awq"``/``"gptq"``: must match ``config.json``'s ``quantization_config``),
            :func:`refengine.quant.awq_gptq.resolve_quantization`; max_model_len: the longest
            context the engine allows (the static choice of ``longrope`` and ``dynamic`` RoPE,
            :class:`refengine.ops.layers.RotaryEmbedding`), None for ``max_position_embeddings``;
            partition: a :class:`refengine.parallel.Partition` to build one tensor-parallel
            worker's share (the checkpoint is read whole, then cut,
            :func:`refengine.parallel.shard_checkpoint`), None for the whole model.
    Raises:
        FileNotFoundError, ValueError: from :func:`refengine.formats.loader.load_weights` or
            :meth:`refengine.formats.gguf_file.GGUFFile.weights`.
    """
    cls = MODEL_REGISTRY[config.architecture]
    method = resolve_quantization(quantization, model_dir)
    int8 = "int8" if method == "int8" else None  # quantized tensor by tensor as the load reads them
    if is_gguf(model_dir):
        weights = open_gguf(model_dir).weights(dequantize=dequantize_gguf, quantization=int8)
        check_weights(weights, cls.checkpoint_shapes(config), str(model_dir), config.tie_word_embeddings)
    else:
        repack = checkpoint_quantization(model_dir).repack if method in CHECKPOINT_METHODS else None
        weights = load_weights(model_dir, cls.checkpoint_shapes(config), config.tie_word_embeddings, repack=repack,
                               quantization=int8)
    if method == "int8":
        quantize_weights(weights)  # (already done as loaded; a no-op on quantized matrices)
    if partition is not None:
        from refengine.parallel.tensor_parallel import shard_checkpoint

        weights = shard_checkpoint(weights, config, partition)
        config = partition.local_config(config)
    return cls(config, weights, attention, ops, xp=xp, dtype=dtype, max_model_len=max_model_len)
