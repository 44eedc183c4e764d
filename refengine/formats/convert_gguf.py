"""Turn a GGUF file (``llama`` or ``gemma3`` architecture) into a Hugging Face style model directory.

refengine runs a GGUF file directly, its tensors as stored (``--model x.gguf``,
:mod:`refengine.formats.gguf_file`). This module writes what ``transformers`` (and
:mod:`refengine.formats.loader`) expect instead, for golden checks against HF and for reading:

- ``model.safetensors``: every weight dequantized to float32 (the ``gguf`` package's
  ``dequantize``, bit-exact with ggml), under HF names (``LlamaForCausalLM``'s or
  ``Gemma3ForCausalLM``'s: ``model.layers.N.self_attn.q_proj.weight`` ...), each of the
  numpy/PyTorch shape ``[out_features, in_features]``; llama q/k rows back in HF's rotary
  order, Gemma norms back to HF's zero-centred ``w`` (the file stores ``1 + w``);
- ``config.json`` and ``generation_config.json`` from the GGUF metadata;
- ``tokenizer.json`` (built with the ``tokenizers`` library from the GGUF vocabulary:
  a byte-level BPE from its merges, or Gemma's SentencePiece BPE with merges rebuilt from
  the vocabulary) and ``tokenizer_config.json`` (special tokens and the chat template).

How the names, shapes and the q/k permutation map: :mod:`refengine.formats.gguf_file`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from refengine.formats.gguf_file import GGUFFile, build_tokenizer, tokenizer_config, unpermute_rotary

__all__ = ["convert_gguf", "build_tokenizer", "unpermute_rotary"]


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a HF style model directory for a ``llama`` or ``gemma3`` GGUF file.

    Args:
        gguf_path: the ``.gguf`` file (any tensor type ``gguf.quants`` can dequantize:
            F32, F16, Q4_0/Q4_1/Q8_0, K-quants ...).
        out_dir: the directory to write; created if missing, files in it overwritten.

    Returns:
        ``Path(out_dir)``, holding ``model.safetensors`` (float32 tensors, HF names,
        shape ``[out_features, in_features]`` for linears and ``[hidden]`` for norms),
        ``config.json``, ``generation_config.json``, ``tokenizer.json`` and
        ``tokenizer_config.json``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: the file is not a GGUF, its architecture is not ``llama`` or
            ``gemma3``, a tensor is unknown or has an unexpected shape, or its tokenizer is
            neither a byte-level BPE with a known pre-tokenizer nor Gemma's SentencePiece.
    """
    from safetensors.numpy import save_file

    gguf = GGUFFile(gguf_path)
    state_dict = gguf.weights(dequantize=True)
    tokenizer = build_tokenizer(gguf.meta)

    # Each file is written under a temporary name and renamed into place, so a reader
    # (or an interrupted run) never sees a half-written model.safetensors.
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _atomic(out_dir / "model.safetensors") as tmp:
        save_file(state_dict, str(tmp), metadata={"format": "pt"})
    with _atomic(out_dir / "tokenizer.json") as tmp:
        tokenizer.save(str(tmp))
    _write_json(out_dir / "config.json", gguf.config)
    _write_json(out_dir / "generation_config.json", gguf.generation_config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(gguf.meta, gguf.config))
    return out_dir


@contextlib.contextmanager
def _atomic(path: Path):
    """Yield a temporary sibling of ``path``; rename it onto ``path`` if the body succeeds.

    The file gets the mode a new file gets here (0644 under the usual umask): some writers
    (safetensors) create theirs 0600, which would hide the weights from other users.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, obj: dict) -> None:
    with _atomic(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
