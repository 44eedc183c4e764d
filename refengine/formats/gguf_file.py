"""Read a GGUF file as a model: its config, tokenizer and tensors, the tensors kept as stored.

A GGUF file (llama.cpp's format) holds everything a model directory holds: metadata
(the architecture's hyperparameters, the tokenizer's vocabulary and merges, the chat
template) and every tensor, most of them quantized in blocks. :class:`GGUFFile` turns it
into what the rest of refengine reads from a Hugging Face directory: the ``config.json``
fields (:attr:`GGUFFile.config`), a :class:`refengine.tokenizer.Tokenizer`, and the
tensors under HF names (:meth:`GGUFFile.weights`): matrices as
:class:`refengine.quant.gguf_blocks.GGUFWeight` (the stored blocks, dequantized on the fly
by the products) or, with ``dequantize=True``, as float32 arrays (what
:mod:`refengine.formats.convert_gguf` writes to safetensors).

Shapes. GGUF lists a tensor's dimensions fastest-varying first (ggml's ``ne[0]`` is the
row length), the reverse of numpy. :func:`read_gguf_header` hands back the data in numpy
order (as ``gguf.GGUFReader`` does), so a GGUF ``[576, 1536]`` ffn_gate is the numpy
``[1536, 576]`` matrix that HF calls ``gate_proj.weight`` ``[intermediate, hidden]``: one
row per output, the row's blocks along the input axis. We rely on the numpy order and check every tensor against
the shape the config implies.

The q/k permutation. llama.cpp applies rotary embeddings to *adjacent* pairs of a head's
dimensions ``(x0, x1), (x2, x3), ...`` (the original Meta layout), while HF Llama rotates
the two *halves* of a head ``(x_i, x_{i + d/2})`` (``rotate_half``). So when llama.cpp's
``convert_hf_to_gguf.py`` writes a HF checkpoint it reorders the output rows of
``q_proj`` and ``k_proj`` in its ``permute`` function::

    w.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2).reshape(n_out, n_in)

i.e. within each head, row ``half * (d/2) + i`` moves to row ``2 * i + half``. We undo it
with the inverse reshape (``[n_head, head_dim // 2, 2, n_in]``, swap the middle axes);
``q`` uses the attention head count, ``k`` the KV head count (grouped-query attention).
``v``, ``o`` and the MLP are not permuted. The result equals the HF checkpoint row for
row, which is what makes HF's ``rotate_half`` rotary code correct on these weights.
Quantized blocks run along a row, so a row permutation moves whole rows of blocks:
the stored bytes are reordered, not requantized.

Gemma 3 (``general.architecture == "gemma3"``, read into HF's ``Gemma3ForCausalLM``
layout). Three differences from llama, each checked tensor for tensor against
``transformers``' own GGUF load (``tests/formats/test_gguf_gemma3.py``):

- No q/k permutation. llama.cpp runs Gemma with NeoX-style rotary (the two halves of a
  head, as HF's ``rotate_half``), and its converter (``Gemma3Model`` in
  ``convert_hf_to_gguf.py``) writes q/k rows as HF has them.
- Norms are stored as ``1 + w``. HF's ``Gemma3RMSNorm`` multiplies by ``(1 + weight)``;
  llama.cpp's RMS norm multiplies by the stored vector, so its converter adds 1 to every
  tensor whose name ends in ``norm.weight`` (the four per-layer norms, ``q_norm``,
  ``k_norm`` and the final norm). We subtract 1 again, in float32, which is what
  ``transformers`` does (``Gemma2TensorProcessor`` in ``modeling_gguf_pytorch_utils.py``,
  used for ``gemma3`` too), so :meth:`GGUFFile.weights` returns HF's zero-centred weights
  and the model adds the 1 back.
- Names: llama.cpp's ``ffn_norm`` is Gemma's *pre*-feedforward norm and
  ``post_attention_norm`` its post-attention one (llama's ``ffn_norm`` is HF's
  ``post_attention_layernorm``). The embedding is tied (no ``output.weight``).

The hyperparameters GGUF does not store come from llama.cpp's loader
(``llama-model.cpp``, ``LLM_ARCH_GEMMA3``): every 6th layer global, the rest sliding
(unless ``attention.sliding_window_pattern`` says otherwise), RoPE base 10000 on the
sliding layers (unless ``rope.freq_base_swa``), the attention scale
``query_pre_attn_scalar ** -0.5`` with ``query_pre_attn_scalar = head_dim``, except
``hidden_size // num_attention_heads`` for the 62-layer 27B, and GELU (tanh) MLPs.

The Gemma tokenizer is SentencePiece BPE (``tokenizer.ggml.model == "llama"``) stored
without merges; :func:`build_tokenizer` rebuilds the pipeline ``transformers`` builds for
it (see there).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# GGUF per-layer tensor suffix -> HF Llama per-layer name.
_LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# GGUF per-layer tensor suffix -> HF Gemma3ForCausalLM per-layer name (gguf's
# constants.py MODEL_TENSORS[GEMMA3] and tensor_mapping.py give the same pairs).
_GEMMA3_LAYER_NAMES = dict(_LLAMA_LAYER_NAMES, **{
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # Llama's post-attention norm is Gemma's pre-MLP one
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
})
_LAYER_NAMES = {"llama": _LLAMA_LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_ARCHITECTURES = tuple(_LAYER_NAMES)
# Architectures whose q/k rows llama.cpp permuted (see the module docstring) and whose
# norms it stored as 1 + w.
_PERMUTES_QK = {"llama": True, "gemma3": False}
_NORM_OFFSET = {"llama": 0.0, "gemma3": 1.0}

# llama.cpp token types (llama_token_type in llama.h / gguf.TokenType).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# HF special token name -> GGUF key stem ("tokenizer.ggml.<stem>_token_id").
_GGUF_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}

# tokenizer.ggml.pre values whose pre-tokenizer we know how to rebuild. "smollm" is the
# GPT-2 byte-level regex after splitting every numeric character on its own (llama.cpp
# llama-vocab.cpp: the "\p{N}" expression before the GPT-2 one).
_PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False}  # -> split digits?



def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k projection rows (see the module docstring).

    Args:
        weight: ``[n_head * head_dim, n_in]`` q or k projection weight (any dtype), rows
            in llama.cpp's interleaved rotary order.
        n_head: heads in this projection (attention heads for q, KV heads for k).

    Returns:
        A new array of the same shape and dtype, rows in HF's half-split rotary order.

    Raises:
        ValueError: the row count is not a multiple of ``2 * n_head``.
    """
    n_out = weight.shape[0]
    if n_out % (2 * n_head):
        raise ValueError(f"{n_out} rows cannot be split into {n_head} heads of even size")
    head_dim = n_out // n_head
    return np.ascontiguousarray(
        weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def rotary_row_order(n_out: int, n_head: int) -> np.ndarray:
    """The row order :func:`unpermute_rotary` produces: row ``i`` of the result is row
    ``order[i]`` of llama.cpp's layout (int64 ``[n_out]``), for moving quantized rows."""
    return unpermute_rotary(np.arange(n_out).reshape(n_out, 1), n_head)[:, 0]


def build_tokenizer(meta: dict):
    """Build a ``tokenizers.Tokenizer`` from GGUF tokenizer metadata.

    Two kinds, by ``tokenizer.ggml.model``: ``"gpt2"`` (byte-level BPE, SmolLM2 and other
    llama files: :func:`_byte_level_bpe`) and ``"llama"`` (SentencePiece) in a ``gemma3``
    file (:func:`_gemma_bpe`). Both register the control tokens
    (``tokenizer.ggml.token_type`` 3) as special added tokens, so ``<|im_start|>`` or
    ``<start_of_turn>`` in text maps to its id, and the user-defined ones (type 4) as
    plain added tokens, matched whole as llama.cpp does.

    Args:
        meta: GGUF key -> value (:func:`read_metadata`), with ``tokenizer.ggml.tokens``
            (list[str], index = id) and the keys the kind needs.

    Returns:
        The tokenizer; its ids are the GGUF's (every added token is already in the
        vocabulary, so none gets a new id).

    Raises:
        ValueError: an unsupported tokenizer model (or SentencePiece outside a
            ``gemma3`` file), an unknown pre-tokenizer, duplicate tokens.
    """
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    if kind == "gpt2":
        return _byte_level_bpe(meta)
    if kind == "llama" and arch == "gemma3":
        return _gemma_bpe(meta)
    raise ValueError(f"unsupported GGUF tokenizer model {_short(kind)} for architecture {_short(arch)}; "
                     f"supported: byte-level BPE 'gpt2', and SentencePiece 'llama' in a 'gemma3' file")


def _byte_level_bpe(meta: dict):
    """The byte-level BPE of a ``tokenizer.ggml.model == "gpt2"`` file.

    Uses ``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` (list of ``"left right"``),
    optional ``tokenizer.ggml.token_type`` and ``tokenizer.ggml.pre``. No normalizer;
    pre-tokenizer ``ByteLevel(add_prefix_space=False)``, preceded by
    ``Digits(individual_digits=True)`` for ``pre == "smollm"``; ByteLevel decoder and
    post-processor. This is the pipeline of SmolLM2's own ``tokenizer.json``.

    Raises:
        ValueError: the pre-tokenizer is unknown, or the vocabulary has duplicates.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {_short(pre)}; known: {sorted(_PRE_TOKENIZERS)}"
        )

    tokens = list(_tokens(meta))
    vocab = _vocab(tokens)
    if meta.get("tokenizer.ggml.merges") is None:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.merges' (a 'gpt2' tokenizer needs its merges)")
    merges = _merges(meta, vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_typed_tokens(tok, tokens, _token_types(meta), vocab)
    return tok


def _merges(meta: dict, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as ``(left, right)`` pairs: each ``"left right"`` (split at
    its first space, as ``transformers`` splits them), both parts and their concatenation
    tokens of ``vocab`` (what ``tokenizers``' BPE requires).

    Raises:
        ValueError: not an array of strings, or a merge without a space or with a part
            outside the vocabulary; naming the merge and its index.
    """
    merges = meta["tokenizer.ggml.merges"]
    if not isinstance(merges, list):
        raise ValueError("GGUF metadata 'tokenizer.ggml.merges' must be an array of strings")
    out = []
    for i, merge in enumerate(merges):
        pair = merge.split(" ", 1) if isinstance(merge, str) else ()
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise ValueError(f"GGUF metadata 'tokenizer.ggml.merges'[{i}] = {_short(merge)} is not two tokens of "
                             "the vocabulary separated by a space, which make a token of the vocabulary")
        out.append((pair[0], pair[1]))
    return out


def _token_types(meta: dict) -> list[int] | None:
    """``tokenizer.ggml.token_type``: one llama.cpp token type per token, or None when absent.

    Raises:
        ValueError: not an array of integers as long as ``tokenizer.ggml.tokens``.
    """
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return None
    n = len(_tokens(meta))
    if not isinstance(types, list) or len(types) != n or not set(map(type, types)) <= {int}:  # bool is not int here
        shown = f"{len(types)} entries" if isinstance(types, list) else _short(types)
        raise ValueError(f"GGUF metadata 'tokenizer.ggml.token_type' must be an array of {n} integers (one per "
                         f"token of 'tokenizer.ggml.tokens'), got {shown}")
    return types


_SP_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def _gemma_bpe(meta: dict):
    """Gemma's tokenizer: SentencePiece BPE with byte fallback, as ``transformers`` builds
    it from a GGUF (``gemma_tokenizer`` in ``transformers/integrations/gguf/
    gguf_tokenizer_mapping.py``, on ``GemmaTokenizer``) and as Gemma's own
    ``tokenizer.json`` spells it:

    - normalizer ``Replace(" ", "▁")``, pre-tokenizer ``Split(" ", merged_with_previous)``
      (a no-op after the normalizer, kept for identity with the reference), BPE with
      ``byte_fallback`` (unknown characters become ``<0xNN>`` byte tokens) and
      ``fuse_unk``, decoder ``Replace("▁", " ")`` + ``ByteFallback`` + ``Fuse``;
    - a ``TemplateProcessing`` post-processor that prepends BOS / appends EOS as
      ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say (Gemma: BOS only);
    - the tokens of two or more spaces (ids 138-167 in Gemma 3), which llama.cpp stores as
      real spaces, respelled ``"▁" * n`` as the vocabulary spells every other space;
    - merges: ``tokenizer.ggml.merges`` when the file has them; Gemma 3's has none
      (SentencePiece scores every piece instead), so they are rebuilt from the
      vocabulary: every way to cut a token into two tokens of the vocabulary is a merge,
      ranked by the token's position in the file (Gemma's scores do not follow its merge
      order; its token order does), longer left part first (514,906 for Gemma 3).

    Raises:
        ValueError: duplicate tokens (after the respelling).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    stored = list(_tokens(meta))
    tokens = _vocab_spelling(meta)
    vocab = _vocab(tokens)
    merges = _merges(meta, vocab) if meta.get("tokenizer.ggml.merges") is not None else _rebuild_merges(tokens)

    def special(key):
        idx = _token_id(meta, key)
        return None if idx is None else (tokens[idx], idx)

    unk = special("unknown")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk[0] if unk else None,
                               fuse_unk=True, byte_fallback=True))
    del merges
    tok.normalizer = normalizers.Replace(" ", _SP_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Only the tokens whose stored spelling is in the vocabulary (so not the space runs,
    # which transformers leaves to the BPE model too).
    _add_typed_tokens(tok, stored, _token_types(meta), vocab)

    bos, eos = special("bos"), special("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos[0]}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if add_eos else [])
    pair = single + ([f"{bos[0]}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if add_eos else [])
    try:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[t for t, on in ((bos, add_bos), (eos, add_eos)) if on],
        )
    except ValueError as e:  # a token spelled like a template piece ("a:b"); the message is the library's
        raise ValueError(f"GGUF BOS/EOS tokens {bos and bos[0]!r}, {eos and eos[0]!r} (tokenizer.ggml.bos_token_id, "
                         f"eos_token_id) cannot be written in a post-processor template: {e}") from None
    return tok


# Bounds on rebuilding a SentencePiece vocabulary's merges, whose time grows with the square
# of a token's length and whose count with the vocabulary's total length: SentencePiece
# trains pieces of at most 16 characters by default; Gemma 3's longest token has 31, and
# its 262,144 tokens give 514,906 merges (1.96 per token).
GGUF_MAX_MERGED_TOKEN_CHARS = 256
GGUF_MAX_MERGES_PER_TOKEN = 4


def _rebuild_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The merges of a vocabulary stored without them: every cut of a token into two
    tokens, ranked by the token's id, longer left part first (``transformers``'
    ``SentencePieceExtractor``, see :func:`_gemma_bpe`).

    Memory: each merge is a tuple of the vocabulary's own strings (no copies), and the
    rebuild stops at the bounds, so it stays in proportion to the vocabulary.

    Raises:
        ValueError: a token longer than :data:`GGUF_MAX_MERGED_TOKEN_CHARS` characters, or
            more than :data:`GGUF_MAX_MERGES_PER_TOKEN` merges per token in all.
    """
    pieces = {t: t for t in tokens}  # a piece's text -> the vocabulary's string of it
    limit = GGUF_MAX_MERGES_PER_TOKEN * len(tokens)
    merges = []
    for i, token in enumerate(tokens):  # best first
        if len(token) > GGUF_MAX_MERGED_TOKEN_CHARS:
            raise ValueError(f"GGUF 'tokenizer.ggml.tokens'[{i}] has {len(token)} characters; rebuilding the merges "
                             f"of a vocabulary stored without 'tokenizer.ggml.merges' takes tokens of at most "
                             f"{GGUF_MAX_MERGED_TOKEN_CHARS}")
        for cut in range(len(token) - 1, 0, -1):  # longest left part first
            left = pieces.get(token[:cut])
            if left is not None:
                right = pieces.get(token[cut:])
                if right is not None:
                    merges.append((left, right))
        if len(merges) > limit:
            raise ValueError(f"GGUF 'tokenizer.ggml.tokens': rebuilding the merges of a vocabulary stored without "
                             f"'tokenizer.ggml.merges' gives more than {GGUF_MAX_MERGES_PER_TOKEN} per token "
                             f"({len(merges)} by token {i} of {len(tokens)}; Gemma 3 has 1.96)")
    return merges


def _vocab_spelling(meta: dict) -> list[str]:
    """The tokens as the tokenizer's vocabulary spells them: as stored, except in a
    SentencePiece (Gemma) file the all-space tokens, stored with real spaces, become
    ``"▁" * n`` like every other space in that vocabulary."""
    tokens = list(_tokens(meta))
    if meta.get("tokenizer.ggml.model") != "llama":
        return tokens
    return [_SP_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id. Raises ValueError on a duplicate token."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        first = next(i for i, t in enumerate(tokens) if vocab[t] != i)  # the dict kept the last id of each
        raise ValueError(f"GGUF vocabulary has duplicate tokens: 'tokenizer.ggml.tokens'[{vocab[tokens[first]]}] = "
                         f"{_short(tokens[first])} repeats token {first}")
    return vocab


def _add_typed_tokens(tok, tokens: list[str], types: list[int] | None, vocab: dict[str, int]) -> None:
    """Register control tokens as special added tokens and user-defined ones as plain
    added tokens (``tokenizer.ggml.token_type`` 3 and 4), each under its vocabulary id:
    a token whose stored spelling is not in ``vocab`` is skipped."""
    from tokenizers import AddedToken

    types = types or [1] * len(tokens)
    added = [
        AddedToken(t, special=(ty == _TOKEN_TYPE_CONTROL), normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) and t in vocab
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])


# --- the container: header, key/values, tensor infos ---------------------------------------
#
# The layout (ggml's docs/gguf.md; all integers little-endian unless the file is big-endian,
# which v3 allows and the version field shows):
#
#   magic "GGUF" | version u32 (2 or 3) | tensor count u64 | key/value count u64
#   key/values:   key (string) | value type u32 | value
#   tensor infos: name (string) | n_dims u32 | dims u64 * n_dims (fastest first) |
#                 ggml type u32 | offset u64 (from the start of the data section)
#   padding to `general.alignment` (default 32) | the data section
#
# A string is a u64 byte count and that many UTF-8 bytes (no terminator); an array is an
# item type u32, an item count u64 and the items (arrays may hold arrays).

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 had 32-bit counts and lengths; llama.cpp dropped it
GGUF_DEFAULT_ALIGNMENT = 32

# Value type codes (gguf-py constants.py GGUFValueType): scalars -> struct format code,
# which numpy reads as the same type.
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                 10: "Q", 11: "q", 12: "d"}
_BOOL, _STRING, _ARRAY = 7, 8, 9

# ggml tensor types GGUFReader hands back as numbers (every other type as bytes).
_NUMERIC_TENSOR_CODES = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2",
                         "I32": "i4", "I64": "i8"}

# Bounds on what a header may make us allocate. Every count is first checked against the
# bytes left in the file (an item takes at least the bytes below), so memory stays in
# proportion to the file; arrays of arrays are bounded further because each inner array,
# 12 bytes in the file, becomes Python objects of some 400 bytes.
GGML_MAX_DIMS = 4  # ggml.h: dimensions of a tensor
GGUF_MAX_ARRAY_DEPTH = 4  # levels of arrays of arrays (ggml's own reader refuses any nesting)
GGUF_MAX_NESTED_ARRAYS = 1 << 16  # inner arrays in the whole file
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_MIN_ARRAY_BYTES = 4 + 8  # item type, item count


@dataclass(frozen=True, eq=False)  # eq=False: numpy values have no single ==
class GGUFField:
    """One metadata key/value.

    Attributes:
        key: the key (``"general.architecture"``).
        types: ``gguf.GGUFValueType`` s: ``(type,)`` for a scalar or string,
            ``(ARRAY, item type)`` for an array, ``(ARRAY, ARRAY, ..., leaf type)`` for arrays
            of arrays (the inner types of the first element), the spelling of
            ``gguf.ReaderField.types`` (which leaves out the item type of an empty array).
        value: ``int``/``float``/``bool``/``str`` for a scalar; a 1-D numpy array (native
            byte order, a copy, not a view of the file) for an array of numbers or bools; a
            ``list[str]`` for an array of strings; a list of those for an array of arrays.
    """

    key: str
    types: tuple
    value: object = field(repr=False)  # a vocabulary is 262,144 strings


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor info and its bytes.

    Attributes:
        name: the GGUF name (``"blk.0.attn_q.weight"``).
        tensor_type: its ``gguf.GGMLQuantizationType`` (``.name`` ``"Q4_K"``, ``"F32"`` ...).
        shape: its dimensions as the file lists them, fastest-varying first (ggml's ``ne``;
            numpy order is the reverse).
        n_elements: the product of ``shape``.
        n_bytes: bytes of data, ``n_elements / block size * type size``.
        data_offset: where the data starts, from the start of the file.
        data: a read-only zero-copy view of the file, as ``gguf.GGUFReader`` shapes it: for
            F16/F32/F64/I8/I16/I32/I64 that numpy dtype, shape ``reversed(shape)``; for every
            block type (and BF16) uint8 ``[*reversed(shape[1:]), shape[0] / block size *
            type size]``, one row of blocks per row.
    """

    name: str
    tensor_type: object
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray = field(repr=False)


@dataclass(frozen=True, eq=False)
class GGUFHeader:
    """A GGUF file's header, read by :func:`read_gguf_header`.

    Attributes:
        path: the file.
        version: 2 or 3.
        byte_order: ``"<"`` (little-endian, every file llama.cpp writes) or ``">"``.
        fields: key -> :class:`GGUFField`, in file order.
        tensors: the :class:`GGUFTensor` s, in file order; their ``data`` keep the file's
            memory map open.
        alignment: ``general.alignment`` or 32.
        data_offset: where the data section starts, from the start of the file.
    """

    path: Path
    version: int
    byte_order: str
    fields: dict[str, GGUFField] = field(repr=False)
    tensors: list[GGUFTensor] = field(repr=False)
    alignment: int = GGUF_DEFAULT_ALIGNMENT
    data_offset: int = 0


class _Cursor:
    """Reads the header's items one after another from ``buf`` (the mapped file)."""

    def __init__(self, buf, path: Path, byte_order: str = "<"):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.order = byte_order
        self.nested_arrays = 0  # inner arrays read so far (GGUF_MAX_NESTED_ARRAYS)

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """``n`` items of at least ``item_bytes`` bytes each must fit in the rest of the
        file: checked before anything is allocated for them."""
        if n * item_bytes > self.size - self.pos:
            raise self.truncated(f"{what} {n} (items of at least {item_bytes} bytes each)")
        return n

    def error(self, what: str) -> ValueError:
        return ValueError(f"{str(self.path)!r} is not a readable GGUF file: {what}")

    def truncated(self, what: str) -> ValueError:
        return self.error(f"truncated header: {what} at byte {self.pos} runs past the end of "
                          f"the file ({self.size} bytes)")

    def scalar(self, code: str, what: str):
        fmt = struct.Struct(self.order + code)
        if self.pos + fmt.size > self.size:
            raise self.truncated(what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        if self.pos + n > self.size:
            raise self.truncated(what)
        raw = self.buf[self.pos:self.pos + n]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} at byte {self.pos} is not UTF-8 ({e})") from None
        self.pos += n
        return text

    def numbers(self, code: str, count: int, what: str) -> np.ndarray:
        """``count`` items of struct/numpy type ``code`` as one native-order array (a copy)."""
        dtype = np.dtype(self.order + ("B" if code == "?" else code))
        if self.pos + count * dtype.itemsize > self.size:
            raise self.truncated(what)
        array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        if code == "?":
            return array != 0  # any nonzero byte is true, as in C
        return array.astype(dtype.newbyteorder("="))

    def strings(self, count: int, what: str) -> list[str]:
        # The inner loop of a 262,144-token vocabulary: locals, one check per string.
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = struct.Struct(self.order + "Q").unpack_from
        append = out.append
        try:
            for _ in range(count):
                if pos + 8 > size:
                    break
                (n,) = length(buf, pos)
                pos += 8
                if pos + n > size:
                    break
                append(buf[pos:pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            self.pos = pos
            raise self.error(f"string {len(out)} of {what} at byte {pos} is not UTF-8 ({e})") from None
        self.pos = pos
        if len(out) < count:
            raise self.truncated(f"string {len(out)} of {what}")
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> tuple[object, tuple[int, ...]]:
        """One value of type code ``vtype``: (value, its type codes as :class:`GGUFField`).
        ``depth``: the arrays this value is inside."""
        if vtype in _SCALAR_CODES:
            value = self.scalar(_SCALAR_CODES[vtype], what)
            return (bool(value) if vtype == _BOOL else value), (vtype,)
        if vtype == _STRING:
            return self.string(what), (vtype,)
        if vtype == _ARRAY:
            item_type = self.scalar("I", f"{what} item type")
            count = self.scalar("Q", f"{what} length")
            if item_type in _SCALAR_CODES:
                return self.numbers(_SCALAR_CODES[item_type], count, what), (vtype, item_type)
            if item_type == _STRING:
                return self.strings(self.count(count, 8, f"the length of {what}"), what), (vtype, item_type)
            if item_type == _ARRAY:
                if depth + 1 >= GGUF_MAX_ARRAY_DEPTH:
                    raise self.error(f"{what} nests arrays too deeply (more than {GGUF_MAX_ARRAY_DEPTH} levels)")
                self.count(count, _MIN_ARRAY_BYTES, f"the length of {what}")
                self.nested_arrays += count
                if self.nested_arrays > GGUF_MAX_NESTED_ARRAYS:
                    raise self.error(f"{what} makes {self.nested_arrays} arrays inside arrays in the file; at most "
                                     f"{GGUF_MAX_NESTED_ARRAYS} are read (llama.cpp reads none)")
                items = [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]
                inner = items[0][1] if items else (_ARRAY,)
                return [v for v, _ in items], (vtype, *inner)
            raise self.error(f"{what} has unknown array item type {item_type}")
        raise self.error(f"{what} has unknown value type {vtype}")


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Read a GGUF file's header over one read-only memory map of the file.

    Reads the magic, version (2 or 3, either byte order), the key/values (every value type,
    arrays of arrays too) and the tensor infos, aligns the data section to
    ``general.alignment`` (default 32) and gives each tensor's bytes as a view of the map
    (:class:`GGUFTensor`). Nothing of the data section is read. This replaces
    ``gguf.GGUFReader``, which builds numpy views for every string of every array (17 s
    for Gemma 3's 262,144-token vocabulary); ``tests/formats/test_gguf_reader.py`` checks the two
    agree on every key, type, value and tensor.

    Args:
        path: the file.
    Returns:
        The :class:`GGUFHeader`.
    Raises:
        FileNotFoundError: no such file (``OSError`` for others from ``open``).
        ValueError: naming the file: a bad magic, an unsupported version, a header that
            runs past the end of the file (or a count whose items cannot fit in what is left
            of it, checked before they are read), an unknown value or tensor type, a string
            that is not UTF-8, a duplicate key or tensor name, arrays of arrays deeper than
            :data:`GGUF_MAX_ARRAY_DEPTH` or more than :data:`GGUF_MAX_NESTED_ARRAYS` of them,
            an alignment that is not a power of two (or not a uint32), a tensor of more than
            :data:`GGML_MAX_DIMS` dimensions, a row length that is not a multiple of its
            type's block size, tensor data at an offset that is not a multiple of the
            alignment, outside the file, or overlapping another tensor's.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # mmap refuses an empty file
            buf = b""
    cur = _Cursor(buf, path)
    if cur.size < 4:
        raise cur.truncated("the magic")
    if buf[:4] != GGUF_MAGIC:
        raise cur.error(f"bad magic {bytes(buf[:4])!r} (a GGUF file starts with {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.scalar("I", "the version")
    if version and not version & 0xFFFF:  # a big-endian file read little-endian
        cur.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in GGUF_VERSIONS:
        raise cur.error(f"unsupported GGUF version {version} (supported: {', '.join(map(str, GGUF_VERSIONS))})")
    n_tensors = cur.scalar("Q", "the tensor count")
    n_kv = cur.scalar("Q", "the key/value count")
    cur.count(n_kv, _MIN_KV_BYTES, "the key/value count")
    cur.count(n_tensors, _MIN_TENSOR_INFO_BYTES, "the tensor count")

    fields: dict[str, GGUFField] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if key in fields:
            raise cur.error(f"duplicate key {key!r}")
        value, types = cur.value(cur.scalar("I", f"the type of {key!r}"), repr(key))
        fields[key] = GGUFField(key, tuple(GGUFValueType(t) for t in types), value)

    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        align = fields["general.alignment"]
        if align.types != (GGUFValueType.UINT32,) or align.value <= 0 or align.value & (align.value - 1):
            raise cur.error(f"general.alignment must be a uint32 power of two, got {align.value!r}")
        alignment = align.value

    infos = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.scalar("I", f"the dimension count of {name!r}")
        if n_dims > GGML_MAX_DIMS:
            raise cur.error(f"tensor {name!r} has {n_dims} dimensions; ggml tensors have at most {GGML_MAX_DIMS}")
        dims = tuple(int(d) for d in cur.numbers("Q", n_dims, f"the dimensions of {name!r}"))
        code = cur.scalar("I", f"the type of {name!r}")
        offset = cur.scalar("Q", f"the offset of {name!r}")
        infos.append((name, dims, code, offset))
    data_offset = -(-cur.pos // alignment) * alignment  # rounded up to the alignment

    tensors, names = [], set()
    for name, dims, code, offset in infos:
        if name in names:
            raise cur.error(f"duplicate tensor name {name!r}")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(code)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise cur.error(f"tensor {name!r} has unknown ggml type {code}") from None
        n_elements = math.prod(dims)
        numpy_shape = tuple(reversed(dims))
        if qtype.name in _NUMERIC_TENSOR_CODES:
            dtype = np.dtype(cur.order + _NUMERIC_TENSOR_CODES[qtype.name])
            count = n_elements
        else:
            if not dims or dims[0] % block_size:
                raise cur.error(f"tensor {name!r} of shape {list(dims)}: its rows are not a multiple of "
                                f"the {qtype.name} block size {block_size}")
            dtype, count = np.dtype(np.uint8), n_elements // block_size * type_size
            numpy_shape = (*numpy_shape[:-1], dims[0] // block_size * type_size)
        n_bytes = n_elements * type_size // block_size
        start = data_offset + offset
        if offset % alignment:
            raise cur.error(f"the offset {offset} of tensor {name!r} is not a multiple of the alignment "
                            f"{alignment} (general.alignment)")
        if start + n_bytes > cur.size:
            raise cur.error(f"the data of tensor {name!r} (bytes {start}..{start + n_bytes}) lies outside "
                            f"the file ({cur.size} bytes)")
        data = np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(numpy_shape)
        tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, data))
    _check_no_overlap(tensors, cur)
    if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        try:  # the header is parsed into copies: its pages of the map are no longer needed
            buf.madvise(mmap.MADV_DONTNEED, 0, min(data_offset, cur.size))
        except (OSError, ValueError):
            pass
    return GGUFHeader(path, version, cur.order, fields, tensors, alignment, data_offset)


def _check_no_overlap(tensors: list[GGUFTensor], cur: _Cursor) -> None:
    """Refuse two tensors whose data share a byte (the GGUF spec lays them out one after
    another; llama.cpp's reader requires exactly that packing)."""
    ranges = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in tensors if t.n_bytes)
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise cur.error(f"the data of tensors {first!r} and {second!r} overlap (bytes {start}..{end})")


# --- metadata ---------------------------------------------------------------------------


def read_metadata(header: GGUFHeader) -> dict:
    """GGUF key -> plain Python value: ``str``, ``int``, ``float``, ``bool``, or a new list
    of those (arrays of arrays as lists of lists).

    Numeric arrays become lists (``tolist``, milliseconds for a 262,144-entry one) because
    the config and tokenizer code tests them as lists (``or``, ``isinstance``) and callers
    may edit the result; the lists are copies, so editing ``meta`` leaves ``header`` as read.
    """
    return {key: _plain(field.value) for key, field in header.fields.items()}


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value] if value and not isinstance(value[0], str) else list(value)
    return value


def _f32(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back 9.999999747e-06. Take the shortest
    decimal that round-trips through float32, which is what the HF config said."""
    return float(str(np.float32(x)))


_REQUIRED = object()

# llama.cpp's LLAMA_MAX_LAYERS (llama-hparams.h): its per-layer hyperparameters are arrays of
# this size, so no file it loads has more blocks.
LLAMA_MAX_LAYERS = 512


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _meta_int(meta: dict, key: str, default=_REQUIRED, minimum: int = 1, maximum: int | None = None) -> int:
    """``meta[key]``, an integer in ``[minimum, maximum]``; ``default`` when absent.

    Raises:
        ValueError: the key is absent without a default, or not such an integer; naming it.
    """
    value = meta.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        limit = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"GGUF metadata {key!r} must be an integer {limit}, got {_short(value)}")
    return value


def _meta_float(meta: dict, key: str, default=_REQUIRED) -> float:
    """``meta[key]``, a finite number > 0, as the shortest decimal of its float32
    (:func:`_f32`); ``default`` when absent.

    Raises:
        ValueError: the key is absent without a default, or not such a number; naming it.
    """
    value = meta.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return None if default is None else _f32(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"GGUF metadata {key!r} must be a finite number > 0, got {_short(value)}")
    return _f32(value)


def _short(value) -> str:
    """``repr(value)``, cut to 80 characters (a hostile value may be a whole vocabulary)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tokens(meta: dict) -> list[str]:
    """``tokenizer.ggml.tokens``: the vocabulary, index = id.

    Raises:
        ValueError: absent, empty, or not an array of strings.
    """
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.tokens' (the vocabulary)")
    # checked on every call (the config, the tokenizer and its special ids each ask): map's C
    # loop keeps it a few milliseconds for a 262,144-token vocabulary
    if not isinstance(tokens, list) or not tokens or not all(map(isinstance, tokens, itertools.repeat(str))):
        raise ValueError("GGUF metadata 'tokenizer.ggml.tokens' must be a non-empty array of strings")
    return tokens


def _token_id(meta: dict, key: str) -> int | None:
    """``tokenizer.ggml.<key>_token_id``, an id of the vocabulary, or None when absent.

    Raises:
        ValueError: not an integer in ``[0, len(tokenizer.ggml.tokens))``, naming the key.
    """
    name = f"tokenizer.ggml.{key}_token_id"
    if meta.get(name) is None:
        return None
    return _meta_int(meta, name, minimum=0, maximum=len(_tokens(meta)) - 1)


def _block_count(meta: dict, arch: str, tensor_names) -> int:
    """``<arch>.block_count``, checked before anything per layer is built: at most
    :data:`LLAMA_MAX_LAYERS`, and (given the file's ``tensor_names``) no more than the
    layers the file holds tensors for (``blk.<i>.*`` for every ``i`` below it).

    Raises:
        ValueError: naming the key, the value and the limit.
    """
    key = f"{arch}.block_count"
    n = _meta_int(meta, key, maximum=LLAMA_MAX_LAYERS)
    if tensor_names is not None:
        present = set()
        for name in tensor_names:
            parts = name.split(".", 2)
            if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
                present.add(int(parts[1]))
        missing = next((i for i in range(n) if i not in present), None)
        if missing is not None:
            raise ValueError(f"GGUF metadata {key!r} is {n}, but the file has no tensors for layer {missing} "
                             f"('blk.{missing}.*'; it has tensors for {len(present)} layers)")
    return n


def hf_config(meta: dict, has_lm_head: bool, tensor_names=None) -> dict:
    """The HF ``config.json`` fields of the file's architecture (``general.architecture``).

    Every count and size is checked before anything is built from it (an integer >= 1, a
    finite number > 0, a token id of the vocabulary); ``block_count`` also against
    :data:`LLAMA_MAX_LAYERS` and the layers of ``tensor_names``.

    Args:
        meta: GGUF key -> value (:func:`read_metadata`).
        has_lm_head: the file stores ``output.weight`` (else the embedding is tied).
        tensor_names: the file's tensor names, or None not to check ``block_count``
            against them.
    Returns:
        ``LlamaConfig`` fields for ``llama`` (:func:`_llama_config`), ``Gemma3TextConfig``
        ones for ``gemma3`` (:func:`_gemma3_config`).
    Raises:
        ValueError: another architecture, a missing or invalid key (naming it), an
            unsupported RoPE scaling.
    """
    arch = meta.get("general.architecture")
    if arch == "llama":
        return _llama_config(meta, has_lm_head, tensor_names)
    if arch == "gemma3":
        return _gemma3_config(meta, has_lm_head, tensor_names)
    raise ValueError(f"unsupported GGUF architecture {_short(arch)}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _llama_config(meta: dict, has_lm_head: bool, tensor_names=None) -> dict:
    """HF ``LlamaConfig`` fields from ``llama.*`` GGUF metadata."""
    n_layers = _block_count(meta, "llama", tensor_names)
    hidden = _meta_int(meta, "llama.embedding_length")
    n_head = _meta_int(meta, "llama.attention.head_count")
    n_kv = _meta_int(meta, "llama.attention.head_count_kv", n_head)
    head_dim = _meta_int(meta, "llama.attention.key_length", hidden // n_head)
    rope_dim = _meta_int(meta, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head_dim {head_dim}) unsupported")
    vocab = _meta_int(meta, "llama.vocab_size", len(_tokens(meta)))

    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _meta_float(meta, "llama.rope.scaling.factor")}
    elif scaling_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling type {_short(scaling_type)}")

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _meta_int(meta, "llama.context_length"),
        "rms_norm_eps": _meta_float(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta_float(meta, "llama.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": _token_id(meta, "bos"),
        "eos_token_id": _token_id(meta, "eos"),
        "pad_token_id": _token_id(meta, "padding"),
        "torch_dtype": "float32",
    }


# llama.cpp's Gemma 3 defaults for what the file may leave out (llama-model.cpp,
# LLM_ARCH_GEMMA3): a global layer after every 5 sliding ones, RoPE base 10000 (and no
# scaling) on the sliding layers.
_GEMMA3_SWA_PERIOD = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B, whose attention scale differs


def _gemma3_config(meta: dict, has_lm_head: bool, tensor_names=None) -> dict:
    """HF ``Gemma3TextConfig`` fields (``config.json`` of ``google/gemma-3-270m``) from
    ``gemma3.*`` GGUF metadata.

    What transformers itself builds from the file (``AutoConfig.from_pretrained(dir,
    gguf_file=...)``) agrees field for field on a Gemma 3 file (the test compares them);
    this is written in the Hub's spelling, ``rope_theta`` (the global layers) and
    ``rope_local_base_freq`` (the sliding ones) and ``rope_scaling``, which transformers
    5 reads into its ``rope_parameters``. Where the file is silent, llama.cpp's values
    (see the module docstring). ``rms_norm_eps`` is the shortest decimal of the stored
    float32 (1e-06, as the Hub config says; transformers keeps 9.99999997e-07, the
    same float32).

    Raises:
        ValueError: a missing key, ``key_length != value_length``, a
            ``sliding_window_pattern`` array of the wrong length, a RoPE scaling other
            than none/linear.
    """
    n_layers = _block_count(meta, "gemma3", tensor_names)  # before anything per layer is built
    hidden = _meta_int(meta, "gemma3.embedding_length")
    n_head = _meta_int(meta, "gemma3.attention.head_count")
    n_kv = _meta_int(meta, "gemma3.attention.head_count_kv", n_head)
    head_dim = _meta_int(meta, "gemma3.attention.key_length", 256)
    if _meta_int(meta, "gemma3.attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF gemma3: attention.key_length != attention.value_length is unsupported")
    vocab = _meta_int(meta, "gemma3.vocab_size", len(_tokens(meta)))

    window = _meta_int(meta, "gemma3.attention.sliding_window", 0, minimum=0)
    pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    if not window:  # llama.cpp: no (or a zero) window means no sliding layers
        window, period, sliding = None, None, [False] * n_layers
    elif isinstance(pattern, list):  # one bool per layer, True = sliding
        if len(pattern) != n_layers or not all(isinstance(p, (bool, int)) for p in pattern):
            raise ValueError(f"GGUF gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                             f"for {n_layers} layers (one bool per layer)")
        period, sliding = None, [bool(p) for p in pattern]
    else:  # a period: layer i is global when (i + 1) % period == 0
        period = _meta_int(meta, "gemma3.attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD, minimum=0)
        sliding = [period == 0 or (i + 1) % period != 0 for i in range(n_layers)]

    rope_scaling = None
    scaling_type = meta.get("gemma3.rope.scaling.type", "none")
    factor = meta.get("gemma3.rope.scaling.factor")
    if scaling_type == "linear" or (scaling_type == "none" and factor is not None and factor != 1.0):
        rope_scaling = {"rope_type": "linear", "factor": _meta_float(meta, "gemma3.rope.scaling.factor")}
    elif scaling_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling type {_short(scaling_type)}")

    softcaps = {key: _meta_float(meta, f"gemma3.{key}", None)
                for key in ("final_logit_softcapping", "attn_logit_softcapping")}
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, "gemma3.feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": _meta_int(meta, "gemma3.context_length"),
        "rms_norm_eps": _meta_float(meta, "gemma3.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta_float(meta, "gemma3.rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": _meta_float(meta, "gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE),
        "rope_scaling": rope_scaling,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": hidden // n_head if n_layers == _GEMMA3_27B_LAYERS else head_dim,
        "final_logit_softcapping": softcaps["final_logit_softcapping"],
        "attn_logit_softcapping": softcaps["attn_logit_softcapping"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": _token_id(meta, "bos"),
        "eos_token_id": _token_id(meta, "eos"),
        "pad_token_id": _token_id(meta, "padding"),
        "torch_dtype": "float32",
    }
    if period:
        config["sliding_window_pattern"] = period
    return config


def generation_config(config: dict, extra_eos: tuple[int, ...] = ()) -> dict:
    """``generation_config.json``: the special token ids the config names, and
    ``extra_eos`` (more ids that end generation) with the config's EOS in a list."""
    out = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[key] is not None
    }
    extra = [t for t in extra_eos if t != out.get("eos_token_id")]
    if extra:
        out["eos_token_id"] = ([out["eos_token_id"]] if "eos_token_id" in out else []) + extra
    return out


def end_of_turn_ids(meta: dict) -> tuple[int, ...]:
    """Ids besides EOS that end generation: the file's ``tokenizer.ggml.eot_token_id`` /
    ``eom_token_id``, and for ``gemma3`` ``<end_of_turn>``, which llama.cpp counts as an
    end-of-generation token by its text (llama-vocab.cpp) and Gemma 3's own
    ``generation_config.json`` lists (``eos_token_id: [1, 106]``)."""
    ids = [_token_id(meta, key) for key in ("eot", "eom")]
    if meta.get("general.architecture") == "gemma3":
        ids += [i for i, t in enumerate(_tokens(meta)) if t == "<end_of_turn>"]
    out: list[int] = []
    for i in ids:
        if i is not None and i not in out:
            out.append(i)
    return tuple(out)


def tokenizer_config(meta: dict, config: dict) -> dict:
    """``tokenizer_config.json`` as ``transformers`` writes it for a fast tokenizer: the
    added tokens :func:`build_tokenizer` registers (not Gemma's space runs, which only the
    BPE model holds, respelled), the special tokens, ``add_bos_token`` and the chat
    template."""
    tokens = _tokens(meta)
    types = _token_types(meta) or [1] * len(tokens)
    spelled = _vocab_spelling(meta)
    added_decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": ty == _TOKEN_TYPE_CONTROL,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) and spelled[i] == t
    }

    def token(key):
        idx = _token_id(meta, _GGUF_SPECIAL_KEYS[key])
        return None if idx is None else tokens[idx]

    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "added_tokens_decoder": added_decoder,
    }
    for key in ("bos", "eos", "unk", "pad"):
        if token(key) is not None:
            out[f"{key}_token"] = token(key)
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


# --- the file -------------------------------------------------------------------------


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (a file ending in ``.gguf``)."""
    return str(path).endswith(".gguf") and Path(path).is_file()


class GGUFFile:
    """One GGUF file: its header read at once (:func:`read_gguf_header`, a fraction of a
    second), its tensors left in the file's memory map until :meth:`weights` copies them.

    Attributes:
        reader: the :class:`GGUFHeader` (``reader.tensors``: the raw tensors).
        meta: GGUF key -> value (:func:`read_metadata`).
        config: the HF ``config.json`` fields (:func:`hf_config`).
    Args:
        path: the ``.gguf`` file.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a readable GGUF (:func:`read_gguf_header`; the message
            says "is not a readable GGUF file" and names it), its architecture is not one
            of :data:`SUPPORTED_ARCHITECTURES` (``llama``, ``gemma3``), a metadata key is
            missing or invalid (:func:`hf_config`: a count out of range, ``block_count``
            beyond :data:`LLAMA_MAX_LAYERS` or the layers present ...), or a tensor is
            unknown, missing or of another shape than the metadata implies; the message
            names the file and the key or tensor. All before anything is sized by the
            metadata.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {str(self.path)!r}")
        self.reader = read_gguf_header(self.path)
        self.meta = read_metadata(self.reader)
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {_short(arch)} in {str(self.path)!r}; "
                             f"supported: {', '.join(map(repr, SUPPORTED_ARCHITECTURES))}")
        self.arch: str = arch
        self._tensors = {t.name: t for t in self.reader.tensors}
        with self._naming_the_file():
            self.config = hf_config(self.meta, has_lm_head="output.weight" in self._tensors,
                                    tensor_names=self._tensors)
            self._names = self._check_tensors()

    @contextlib.contextmanager
    def _naming_the_file(self):
        """Prefix a ValueError's message with the file's path (the metadata checks name
        only the key)."""
        try:
            yield
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    @property
    def generation_config(self) -> dict:
        """The ``generation_config.json`` fields (special token ids) of :attr:`config`;
        ``eos_token_id`` becomes a list when more ids end a turn
        (:func:`end_of_turn_ids`: Gemma 3's ``[1, 106]``, ``<eos>`` and ``<end_of_turn>``)."""
        with self._naming_the_file():
            return generation_config(self.config, end_of_turn_ids(self.meta))

    def tokenizer(self):
        """The :class:`refengine.tokenizer.Tokenizer` the metadata describes (vocabulary,
        merges, special tokens, chat template).

        Raises:
            ValueError: naming the file and the key: a missing or invalid vocabulary,
                merges, token types or special token id, or a vocabulary whose merges
                cannot be rebuilt within the bounds of :func:`_rebuild_merges`.
        """
        from refengine.tokenizer import Tokenizer

        with self._naming_the_file():
            tok, config = build_tokenizer(self.meta), tokenizer_config(self.meta, self.config)
        return Tokenizer(tok, config, self.generation_config, config_source=f"{self.path} (tokenizer metadata)")

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name -> its stored type name (``"Q4_1"``, ``"F32"`` ...)."""
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def weights(self, dequantize: bool = False, quantization: str | None = None) -> dict:
        """Every tensor under its HF name, shapes checked; for ``llama`` the q/k rows
        unpermuted, for ``gemma3`` 1 subtracted from the norms (float32), so the result is
        the HF checkpoint's (module docstring).

        Memory: one tensor at a time. Each tensor's bytes are copied out of the memory map
        (or decoded), then its pages of the map are dropped from this process
        (``madvise(MADV_DONTNEED)``; the file stays in the page cache), so the load peaks at
        the weights plus one tensor, not at the weights plus the whole file.

        Args:
            dequantize: float32 arrays for every tensor (today's ``convert-gguf`` output);
                else matrices stay as stored (:class:`refengine.quant.gguf_blocks.GGUFWeight`,
                F32 ones as float32 arrays) and vectors (norms) become float32 arrays.
            quantization: ``"int8"``: every matrix becomes a per-channel
                :class:`refengine.quant.int8.Int8Weight` of its float32 dequantization
                (:meth:`Int8Weight.from_rows`, decoded a slab of rows at a time: the same
                int8 values as quantizing the ``dequantize=True`` matrix); None: as above.
        Returns:
            HF name -> ``[out, in]`` matrix or ``[n]`` vector.
        Raises:
            ValueError: a ``quantization`` other than None or ``"int8"`` (the tensors'
                names and shapes were checked when the file was opened).
        """
        from gguf.quants import dequantize as gguf_dequantize

        if quantization not in (None, "int8"):
            raise ValueError(f"GGUF weights: quantization={quantization!r} is not None or 'int8'")
        out = {}
        for name, t in self._tensors.items():
            hf, shape, n_head = self._names[name]
            if quantization == "int8" and len(shape) == 2:
                from refengine.quant.gguf_blocks import GGUFWeight
                from refengine.quant.int8 import Int8Weight

                weight = GGUFWeight.from_raw(t.tensor_type, t.data, shape)  # a copy of the blocks
                if n_head:
                    weight = weight.take_rows(rotary_row_order(shape[0], n_head))  # rows move, bytes unchanged
                out[hf] = Int8Weight.from_rows(weight.dequantize, shape, hf)
            elif dequantize or len(shape) == 1 or t.tensor_type.name == "F32":
                array = gguf_dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
                if n_head:
                    array = unpermute_rotary(array, n_head)
                if _NORM_OFFSET[self.arch] and name.endswith("norm.weight"):
                    array = array - np.float32(_NORM_OFFSET[self.arch])  # stays float32
                out[hf] = np.array(array, dtype=np.float32, order="C")  # a copy, never a view of the map
                del array
            else:
                from refengine.quant.gguf_blocks import GGUFWeight

                weight = GGUFWeight.from_raw(t.tensor_type, t.data, shape)  # planes: copies of the map's bytes
                out[hf] = weight.take_rows(rotary_row_order(shape[0], n_head)) if n_head else weight
            _release_pages(t.data)
        return out

    def _check_tensors(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """Every tensor against the config, before anything is sized by the config (the KV
        pool, the weights): each known (:meth:`_hf_name`), of the shape the config implies,
        and none missing. Reads no tensor data.

        Returns:
            GGUF name -> :meth:`_hf_name`'s (HF name, shape, heads to unpermute).
        Raises:
            ValueError: an unknown tensor, one past the layer count, a wrong shape, or a
                missing one; the message names it.
        """
        names = {}
        for name, t in self._tensors.items():
            hf, shape, n_head = names[name] = self._hf_name(name)
            stored = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
            if stored != shape:
                raise ValueError(f"GGUF tensor {name!r} has shape {stored}, expected {shape}")
        present = {hf for hf, _, _ in names.values()}
        layer_names = _LAYER_NAMES[self.arch].values()
        missing = [f"model.layers.{i}.{s}" for i in range(self.config["num_hidden_layers"]) for s in layer_names]
        missing = [m for m in missing + ["model.embed_tokens.weight", "model.norm.weight"] if m not in present]
        if missing:
            raise ValueError(f"GGUF file lacks tensors for {missing[:5]} ({len(missing)} in all)")
        return names

    def _hf_name(self, name: str) -> tuple[str, tuple[int, ...], int]:
        """GGUF tensor name -> (HF name, the shape the config implies, heads to unpermute or 0)."""
        c = self.config
        hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
            return hf, ((hidden,) if hf == "model.norm.weight" else (c["vocab_size"], hidden)), 0
        names = _LAYER_NAMES[self.arch]
        parts = name.split(".", 2)  # "blk", "N", "attn_q.weight"
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in names:
            raise ValueError(f"unknown GGUF tensor {name!r}")
        layer = int(parts[1])
        if not 0 <= layer < c["num_hidden_layers"]:
            raise ValueError(f"GGUF tensor {name!r} is past num_hidden_layers")
        suffix = names[parts[2]]
        shape = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,),
            "self_attn.q_norm.weight": (head_dim,),
            "self_attn.k_norm.weight": (head_dim,),
            "self_attn.q_proj.weight": (n_head * head_dim, hidden),
            "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, n_head * head_dim),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }[suffix]
        heads = {"self_attn.q_proj.weight": n_head, "self_attn.k_proj.weight": n_kv}.get(suffix, 0)
        if not _PERMUTES_QK[self.arch]:
            heads = 0
        return f"model.layers.{layer}.{suffix}", shape, heads


def _release_pages(data: np.ndarray) -> None:
    """Drop the pages of the memory map from its start to the end of ``data`` (a view of it)
    from this process's resident set, once they are copied out: ``madvise(MADV_DONTNEED)``
    on a read-only file mapping only unmaps them (they stay in the page cache, and a later
    read of the view faults them back in, unchanged). From the map's start, not from
    ``data``'s: reading a tensor also maps the pages around the fault (the kernel's
    fault-around, tens of KB), the tail of the tensor before it, which the load has already
    copied. Does nothing for data that is not a view of an ``mmap`` or where ``madvise``
    does not exist."""
    base = data
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer keeps a memoryview of the map
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or not data.nbytes:
        return
    try:
        origin = np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data  # the map's first byte
        base.madvise(mmap.MADV_DONTNEED, 0, data.ctypes.data - origin + data.nbytes)
    except (OSError, ValueError):  # a closed map, or a platform that refuses: the pages just stay
        pass


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """:class:`GGUFFile` of ``path``, shared while the file is unchanged (the engine reads
    the config, the tokenizer and the tensors at different moments of its start) and until
    :func:`close_gguf_files`."""
    st = Path(path).stat()
    return _open_cached(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def close_gguf_files() -> None:
    """Drop the files :func:`open_gguf` shares, and so their memory maps: an engine calls it
    once its weights are loaded (the weights hold copies of the blocks, not views of the map;
    :meth:`GGUFFile.weights` already released each tensor's pages as it copied them)."""
    _open_cached.cache_clear()
