"""The paged KV cache: a pool of fixed-size blocks and the manager that hands them out.

A sequence's keys and values live in blocks of ``block_size`` tokens; its block table
lists them in position order, so memory is never fragmented and a sequence grows one
block at a time. Source: Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention", §4.1-4.2 (no prefix sharing here).
"""

from __future__ import annotations

import numpy as np

from refengine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)


class KVCache:
    """Per-layer key and value pools.

    ``k[layer]`` and ``v[layer]`` have shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (the attention contract's layout). On the CPU the pool is allocated lazily by the OS
    (``zeros``), so untouched blocks cost no memory.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32, xp=np):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [xp.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [xp.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class BlockManager:
    """Hands out KV blocks to sequences and takes them back.

    Blocks are ints in ``[0, num_blocks)``; free ones sit on a stack so the most recently
    freed block is reused first (it is likely still in cache).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must add to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free pool covers :meth:`blocks_needed`."""
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` so the next ``num_new_tokens`` tokens have slots.

        Raises:
            RuntimeError: not enough free blocks (the scheduler checks first, so this is a bug).
        """
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free_blocks)} free")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.pop())

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink ``seq.block_table`` to the blocks that hold its first ``num_tokens`` tokens
        and return the rest to the pool (speculative decoding: slots of rejected proposals)."""
        keep = cdiv(num_tokens, self.block_size)
        self.free_blocks.extend(reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool."""
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
