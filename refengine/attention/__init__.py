"""The attention contract every backend follows: cache layout, metadata, the ``AttentionBackend`` protocol.

The contract (``docs/architecture.md``, "The attention contract"):

* Cache per layer: ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``.
* New keys/values are written first, token ``t`` to slot ``slot_mapping[t]``
  (``block = slot // block_size``, ``offset = slot % block_size``).
* ``attention(q [T, num_heads, head_dim], k_cache, v_cache, meta) -> [T, num_heads, head_dim]``:
  sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]``; its context
  holds ``seq_lens[i]`` tokens (cached + new); query row ``j`` of a sequence with ``q_len``
  rows sits at position ``seq_lens[i] - q_len + j`` and sees keys ``0 ..= that position``.
  Key position ``p`` lives in block ``block_tables[i, p // block_size]``.
* Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
* Softmax in float32.
* Per-layer keywords of ``forward``: ``sliding_window`` W (query position ``p`` sees keys
  ``max(0, p - W + 1) ..= p``: W keys including itself, transformers' rule) and
  ``logits_soft_cap`` c (scores ``c * tanh(s / c)`` before the softmax); None for neither.
* float16 caches under float32 queries (``kv_cache_dtype="float16"``, the CPU backends):
  ``write_kv`` rounds each value to nearest (NumPy's cast), ``forward`` reads it exactly.
* Quantized caches (``kv_cache_dtype="int8"``): ``k_cache``/``v_cache`` hold int8 and
  ``k_scale``/``v_scale [num_blocks, block_size, num_kv_heads]`` float32 beside them, one
  scale per token and KV head (:func:`refengine.attention.kv_cache.quantize_int8`); ``write_kv``
  quantizes and ``forward`` reads ``q * scale``, prefill and decode alike. The scales are
  keyword arguments, None for unquantized caches. fp8 caches (``"fp8_e4m3"`` / ``"fp8_e5m2"``,
  the CUDA backends and the NumPy twin) hold uint8 codes, and ``k_scale``/``v_scale`` are
  :class:`refengine.attention.kv_cache.FP8Scale` (format and the layer's float scale): stored
  ``fp8(x / scale)``, read ``fp8 * scale``.

Every backend implements :class:`AttentionBackend`: ``prepare`` once per step, then per
layer ``write_kv`` and ``forward``. The backends: :mod:`refengine.attention.numpy_ref` (the
NumPy twin, the reference), :mod:`refengine.cpu.attention` (the CPU default) and
:mod:`refengine.attention.cuda` (CUDA, and its CPU emulation); built by name in
:mod:`refengine.attention.selector`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys live in one flat batch.

    Attributes (all int32 host arrays; a GPU backend copies them to the device):
        query_start_loc: ``[B + 1]`` prefix sum of query lengths; sequence ``i`` owns
            query rows ``query_start_loc[i] : query_start_loc[i + 1]``.
        seq_lens: ``[B]`` context length of each sequence after this step (cached + new).
        block_tables: ``[B, max_blocks]`` physical block ids; entries past a sequence's
            last block are ``-1`` (padding, never read).
        slot_mapping: ``[T]`` cache slot (``block * block_size + offset``) of each new token.
        max_query_len: largest ``q_len`` in the batch (``1`` means a pure decode batch).
        max_seq_len: largest ``seq_lens`` entry.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def paged_metadata(q_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                   block_size: int) -> AttentionMetadata:
    """The metadata of a batch whose sequence ``i`` brings its last ``q_lens[i]`` tokens.

    Sequence ``i``'s new tokens are positions ``seq_lens[i] - q_lens[i] .. seq_lens[i] - 1``
    (the earlier ones are already cached); they take query rows in batch order, and token
    at position ``p`` goes to slot ``block_tables[i, p // block_size] * block_size + p % block_size``.

    Args:
        q_lens: ``[B]`` int, new tokens per sequence (``0 <= q_lens[i] <= seq_lens[i]``).
        seq_lens: ``[B]`` int, context length after this step (cached + new).
        block_tables: ``[B, max_blocks]`` int physical block ids covering each context
            (``-1`` padding past a sequence's last block).
        block_size: tokens per KV block.
    Returns:
        :class:`AttentionMetadata` with int32 ``query_start_loc [B + 1]``, ``seq_lens [B]``,
        ``block_tables [B, max_blocks]`` and ``slot_mapping [sum(q_lens)]``; ``max_query_len``
        and ``max_seq_len`` (0 for an empty batch).
    Raises:
        ValueError: the arrays disagree in length, a ``q_lens`` entry is outside
            ``[0, seq_lens]``, or a block table is too short for its context.
    """
    q_lens = np.asarray(q_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    block_tables = np.asarray(block_tables)
    num_seqs = q_lens.shape[0]
    if q_lens.shape != (num_seqs,) or seq_lens.shape != (num_seqs,) or block_tables.ndim != 2 \
            or block_tables.shape[0] != num_seqs:
        raise ValueError(f"q_lens {q_lens.shape}, seq_lens {seq_lens.shape} and block_tables "
                         f"{block_tables.shape} must be [B], [B] and [B, max_blocks]")
    if ((q_lens < 0) | (q_lens > seq_lens)).any():
        raise ValueError("every q_lens entry must lie in [0, seq_lens]")
    if num_seqs and int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"block_tables of {block_tables.shape[1]} blocks of {block_size} cannot hold "
                         f"a context of {int(seq_lens.max())} tokens")
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    seq_index = np.repeat(np.arange(num_seqs), q_lens)
    # position of each new token: its row within the sequence, shifted past the cached tokens
    positions = (np.arange(int(query_start_loc[-1])) - query_start_loc[seq_index]
                 + (seq_lens - q_lens)[seq_index])
    slot_mapping = block_tables[seq_index, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    return AttentionMetadata(
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables.astype(np.int32, copy=False),
        slot_mapping=slot_mapping.astype(np.int32),
        max_query_len=int(q_lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
    )


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer (e.g. to copy ``meta`` to the device once)."""

    def write_kv(self, k_cache: Any, v_cache: Any, k: Any, v: Any, meta: AttentionMetadata, *,
                 k_scale: Any = None, v_scale: Any = None) -> None:
        """Store ``k, v [T, num_kv_heads, head_dim]`` at ``meta.slot_mapping`` (in place;
        quantized, with each row's scale into ``k_scale``/``v_scale``, for an int8 cache)."""

    def forward(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMetadata, scale: float, *,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                k_scale: Any = None, v_scale: Any = None) -> Any:
        """Return ``[T, num_heads, head_dim]`` attention output per the contract above
        (``scale``: the softmax scale; ``sliding_window``, ``logits_soft_cap``: the layer's
        options; ``k_scale``/``v_scale``: an int8 cache's scales)."""
