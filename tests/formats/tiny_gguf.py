"""Tiny whole-model GGUF files written by ``gguf.GGUFWriter`` (the oracle writer): a Gemma 3
(SentencePiece vocabulary without merges) and a Llama (byte-level BPE with merges), each of
two layers with float32 tensors, a few KB. Tests break one key or tensor at a time.

``meta`` values are written with the type their Python value implies (int: UINT32, float:
FLOAT32, bool, str, lists of those as arrays); ``(value, GGUFValueType)`` forces a type and
``DELETE`` drops the key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DELETE = object()

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 8, 2, 1, 4, 16, 2

# A SentencePiece vocabulary: specials, byte fallback for two bytes, pieces whose merges are
# rebuilt from the vocabulary ("▁a" = "▁" + "a", "ab" = "a" + "b", "▁ab" = "▁a" + "b" or "▁" + "ab").
GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<0x0A>", "<0x21>",
                "▁", "a", "b", "ab", "▁a", "▁ab", "  "]
GEMMA_TYPES = [3, 3, 3, 2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 1]
# A byte-level BPE vocabulary ("Ġ" is the space byte) and its merges.
LLAMA_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "ab", "Ġa", "Ġab"]
LLAMA_MERGES = ["a b", "Ġ a", "Ġa b"]


def gemma3_meta(n_layers: int = LAYERS) -> dict:
    return {
        "general.architecture": "gemma3",
        "gemma3.context_length": 64,
        "gemma3.embedding_length": HIDDEN,
        "gemma3.block_count": n_layers,
        "gemma3.feed_forward_length": FFN,
        "gemma3.attention.head_count": HEADS,
        "gemma3.attention.head_count_kv": KV_HEADS,
        "gemma3.attention.key_length": HEAD_DIM,
        "gemma3.attention.value_length": HEAD_DIM,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.sliding_window": 16,
        "gemma3.rope.freq_base": 1_000_000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": list(GEMMA_TOKENS),
        "tokenizer.ggml.scores": [0.0] * len(GEMMA_TOKENS),
        "tokenizer.ggml.token_type": list(GEMMA_TYPES),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }


def llama_meta(n_layers: int = LAYERS) -> dict:
    return {
        "general.architecture": "llama",
        "llama.context_length": 64,
        "llama.embedding_length": HIDDEN,
        "llama.block_count": n_layers,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": list(LLAMA_TOKENS),
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": list(LLAMA_MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


def tensors(arch: str, n_layers: int = LAYERS, vocab: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in numpy order (``[out, in]``)."""
    rng = np.random.default_rng(seed)
    vocab = vocab or len(GEMMA_TOKENS if arch == "gemma3" else LLAMA_TOKENS)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def norm(n):  # Gemma stores its norms as 1 + w
        return w(n) + np.float32(arch == "gemma3")

    out = {"token_embd.weight": w(vocab, HIDDEN), "output_norm.weight": norm(HIDDEN)}
    for i in range(n_layers):
        p = f"blk.{i}."
        out.update({
            p + "attn_norm.weight": norm(HIDDEN), p + "ffn_norm.weight": norm(HIDDEN),
            p + "attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN), p + "attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), p + "attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "ffn_gate.weight": w(FFN, HIDDEN), p + "ffn_up.weight": w(FFN, HIDDEN),
            p + "ffn_down.weight": w(HIDDEN, FFN),
        })
        if arch == "gemma3":
            out.update({p + "post_attention_norm.weight": norm(HIDDEN), p + "post_ffw_norm.weight": norm(HIDDEN),
                        p + "attn_q_norm.weight": norm(HEAD_DIM), p + "attn_k_norm.weight": norm(HEAD_DIM)})
    return out


def write_gguf(path: Path, meta: dict, arrays: dict[str, np.ndarray], alignment: int | None = None) -> Path:
    """Write ``meta`` and ``arrays`` with ``gguf.GGUFWriter`` (see the module docstring for the types)."""
    import gguf
    from gguf import GGUFValueType as T

    def vtype(value):
        if isinstance(value, bool):
            return T.BOOL
        if isinstance(value, int):
            return T.UINT32
        if isinstance(value, float):
            return T.FLOAT32
        if isinstance(value, str):
            return T.STRING
        raise TypeError(value)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.kv_data[0].pop("general.architecture")  # written from meta, in its order, or not at all
    if alignment:
        writer.add_custom_alignment(alignment)
    for key, value in meta.items():
        if value is DELETE:
            continue
        if isinstance(value, tuple):
            value, forced = value
            if isinstance(value, list):
                writer.add_key_value(key, value, T.ARRAY, sub_type=forced)
            else:
                writer.add_key_value(key, value, forced)
        elif isinstance(value, list):
            writer.add_key_value(key, value, T.ARRAY, sub_type=vtype(value[0]) if value else T.INT32)
        else:
            writer.add_key_value(key, value, vtype(value))
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf(path: Path, arch: str = "gemma3", n_layers: int = LAYERS, drop: tuple[str, ...] = (),
              **changes) -> Path:
    """The tiny model of ``arch`` with ``changes`` (GGUF key with ``.`` spelled ``__`` -> value,
    or DELETE) and the tensors named in ``drop`` left out."""
    meta = gemma3_meta(n_layers) if arch == "gemma3" else llama_meta(n_layers)
    for key, value in changes.items():
        meta[key.replace("__", ".")] = value
    arrays = {k: v for k, v in tensors(arch, n_layers).items() if k not in drop}
    return write_gguf(path, meta, arrays)
