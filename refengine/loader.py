"""Load a Hugging Face model directory's safetensors into arrays, strictly.

Every tensor the model class expects (:meth:`refengine.models.llama.LlamaForCausalLM.checkpoint_shapes`)
must be present with the shape ``config.json`` implies, and every tensor in the checkpoint must be used: a mismatch is an error naming
the tensor. bfloat16 checkpoints load through ``ml_dtypes`` (importing it teaches NumPy,
and so ``safetensors.numpy``, the ``bfloat16`` type).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 for safetensors)
import numpy as np
from safetensors import safe_open

from refengine.config import read_json_object


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
                 dtype=np.float32) -> dict[str, np.ndarray]:
    """Read every tensor of the checkpoint, check it against ``want`` (name -> shape), cast to ``dtype``.

    A tied checkpoint that also ships ``lm_head.weight`` is accepted (transformers ties
    it to the embedding; so do we, and the extra tensor is dropped), and so are the
    ``rotary_emb.inv_freq`` buffers of older Llama checkpoints (derived, so dropped).

    Returns:
        HF name -> array of ``dtype`` (float32 on the CPU).
    Raises:
        FileNotFoundError: no checkpoint files.
        ValueError: a file is unreadable (e.g. truncated), a tensor is missing, unused,
            or has the wrong shape; the message names it.
    """
    model_dir = Path(model_dir)
    weights: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read {str(path)!r}: {e} (truncated or corrupt safetensors file?)") from e
    if tied_embeddings:
        weights.pop("lm_head.weight", None)
    # Older Llama checkpoints ship RoPE buffers; they are derived from config.json, so drop them.
    for name in [n for n in weights if n.endswith(("rotary_emb.inv_freq", "rotary_emb.cos_cached",
                                                   "rotary_emb.sin_cached"))]:
        del weights[name]
    missing = [n for n in want if n not in weights]
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unused = [n for n in weights if n not in want]
    if unused:
        raise ValueError(f"checkpoint in {str(model_dir)!r} has {len(unused)} unused tensor(s), e.g. {unused[:3]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, config.json implies {shape}")
    return {name: np.ascontiguousarray(w.astype(dtype, copy=False)) for name, w in weights.items()}
