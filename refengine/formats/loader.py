"""Load a Hugging Face model directory's safetensors into arrays, strictly.

Every tensor the model class expects (:meth:`refengine.models.llama.LlamaForCausalLM.checkpoint_shapes`)
must be present with the shape ``config.json`` implies, and every tensor in the checkpoint must be used: a mismatch is an error naming
the tensor. bfloat16 checkpoints load through ``ml_dtypes`` (importing it teaches NumPy,
and so ``safetensors.numpy``, the ``bfloat16`` type). AWQ and GPTQ checkpoints ship packed
tensors in place of a layer's ``weight``; ``load_weights``' ``repack`` hook turns each set
into one quantized matrix of that name first, and the same strict check follows
(:mod:`refengine.quant.awq_gptq`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import safe_open

from refengine.config import read_json_object
from refengine.quant import is_quantized


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``: one file, or the shards an index names.

    Raises:
        FileNotFoundError: no ``model.safetensors`` nor ``model.safetensors.index.json``,
            or a shard the index names is missing.
        ValueError: an index that is not JSON or has no ``weight_map``.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> shard file name")
        shards = sorted(set(weight_map.values()))
        files = [model_dir / s for s in shards]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"shard {str(path)!r} named in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}")


def load_weights(model_dir: str | Path, want: dict[str, tuple[int, ...]], tied_embeddings: bool,
                 dtype=np.float32, repack=None, quantization: str | None = None) -> dict[str, np.ndarray]:
    """Read every tensor of the checkpoint, check it against ``want`` (name -> shape,
    :func:`check_weights`), cast to ``dtype``.

    Tensor by tensor: each is cast (or quantized) as it is read, so the load holds the
    result plus one tensor as stored, not the whole checkpoint twice.

    ``quantization="int8"``: each float matrix becomes a per-channel
    :class:`refengine.quant.int8.Int8Weight` as it is read, quantized from the stored
    values (:meth:`Int8Weight.quantize` computes in float64, so a bfloat16 or float16
    tensor gives the int8 values its float32 cast would); the float matrix is never held
    whole in float32 beside the others.

    ``repack``: for a quantized checkpoint (AWQ, GPTQ), a callable ``repack(weights, source)``
    that replaces each layer's packed tensors (``P.qweight``, ``P.qzeros``, ``P.scales``,
    ``P.g_idx``) in the dict by one :class:`refengine.quant.QuantizedWeight` named
    ``P.weight`` (:meth:`refengine.quant.awq_gptq.CheckpointQuantization.repack`), before
    the strict check: a packed set that is incomplete is its error, a stray packed tensor
    is an unused one, and the repacked matrix's shape is checked as ``P.weight``'s.

    Returns:
        HF name -> array of ``dtype`` (float32 on the CPU), or the repacked quantized weights.
    Raises:
        FileNotFoundError: no checkpoint files.
        ValueError: a file is unreadable (e.g. truncated), ``repack`` fails,
            :func:`check_weights` fails, ``quantization`` is not None or ``"int8"``, or
            ``"int8"`` meets a matrix holding NaN or inf.
    """
    if quantization not in (None, "int8"):
        raise ValueError(f"load_weights: quantization={quantization!r} is not None or 'int8'")
    if quantization == "int8" and repack is not None:
        raise ValueError("load_weights: quantization='int8' quantizes a float checkpoint, not a packed (repacked) one")
    model_dir = Path(model_dir)
    weights: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        for name, w in _read_tensors(path):
            # cast (or quantize) as read; packed tensors (AWQ/GPTQ) keep their dtypes for the repack
            weights[name] = w if repack is not None else _cast(w, dtype, name, quantization)
    if repack is not None:
        repack(weights, str(model_dir))
    check_weights(weights, want, str(model_dir), tied_embeddings)
    return {name: w if is_quantized(w) else np.ascontiguousarray(w.astype(dtype, copy=False))
            for name, w in weights.items()}


def _read_tensors(path: Path):
    """Yield ``(name, array)`` for each tensor of one safetensors file, one at a time.

    Raises:
        ValueError: the file is unreadable (truncated or corrupt), naming it.
    """
    import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 for safetensors; imported when first needed)

    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"cannot read {str(path)!r}: {e} (truncated or corrupt safetensors file?)") from e


def _cast(w: np.ndarray, dtype, name: str, quantization: str | None):
    """One tensor as read -> ``dtype`` (C-contiguous), or an ``Int8Weight`` for a float matrix
    under ``quantization="int8"``."""
    if quantization == "int8" and w.ndim == 2 and (np.issubdtype(w.dtype, np.floating)
                                                   or w.dtype.name == "bfloat16"):
        from refengine.quant.int8 import Int8Weight

        return Int8Weight.quantize(w, name)
    return np.ascontiguousarray(w.astype(dtype, copy=False))


def check_weights(weights: dict, want: dict[str, tuple[int, ...]], source: str, tied_embeddings: bool) -> None:
    """Check a checkpoint's tensors (name -> array or :class:`refengine.quant.QuantizedWeight`,
    anything with a ``shape``) against ``want`` (name -> shape), in place.

    A tied checkpoint that also ships ``lm_head.weight`` is accepted (transformers ties
    it to the embedding; so do we, and the extra tensor is dropped), and so are the
    ``rotary_emb.inv_freq`` buffers of older Llama checkpoints (derived, so dropped).

    Raises:
        ValueError: a tensor is missing, unused, or has the wrong shape; the message names
            it and ``source``.
    """
    if tied_embeddings:
        weights.pop("lm_head.weight", None)
    # Older Llama checkpoints ship RoPE buffers; they are derived from config.json, so drop them.
    for name in [n for n in weights if n.endswith(("rotary_emb.inv_freq", "rotary_emb.cos_cached",
                                                   "rotary_emb.sin_cached"))]:
        del weights[name]
    missing = [n for n in want if n not in weights]
    if missing:
        raise ValueError(f"checkpoint in {source!r} is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unused = [n for n in weights if n not in want]
    if unused:
        raise ValueError(f"checkpoint in {source!r} has {len(unused)} unused tensor(s), e.g. {unused[:3]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, config.json implies {shape}")
