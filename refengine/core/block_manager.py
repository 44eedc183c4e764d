"""The paged KV cache: a pool of fixed-size blocks and the manager that hands them out.

A sequence's keys and values live in blocks of ``block_size`` tokens; its block table
lists them in position order, so memory is never fragmented and a sequence grows one
block at a time. Source: Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention", §4.1-4.2.

Automatic prefix caching (vLLM's design; Zheng et al. 2024, "SGLang", does the same with
a radix tree): a *full* block's content is named by a hash chain,
``hash(parent block's hash, its token ids, extra keys)``, so two sequences whose first
``k`` blocks hold the same tokens can share those ``k`` physical blocks. Blocks carry
reference counts; a block whose count drops to 0 keeps its K/V and hash and stays
findable until a new allocation needs the memory, which evicts the least recently used
such block first. See :class:`BlockManager`.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from refengine.attention.kv_cache import cdiv
from refengine.core.sequence import Sequence
from refengine.lora import lora_cache_key


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
    """The hash of one full KV block: SHA-256 over its parent's hash, its token ids and
    ``extra_keys``, so equal hashes mean equal prefixes (up to a SHA-256 collision).

    Args:
        parent_hash: the previous block's hash; None for a sequence's first block.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else the block's K/V depend on (a cache salt, a LoRA adapter); empty for none.
    Returns:
        32 bytes.
    """
    h = hashlib.sha256(parent_hash if parent_hash is not None else bytes(32))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra_keys)
    return h.digest()


def cache_salt_key(cache_salt: str | None) -> bytes:
    """The ``extra_keys`` of a sequence's first block for its ``cache_salt``: nothing for
    None, else the salt's UTF-8 bytes after their length (8 bytes, little-endian), so ""
    and None differ and no two salts (nor a salt and different token ids) give the same
    hashed bytes.

    Raises:
        ValueError: ``cache_salt`` is neither None nor a str.
    """
    if cache_salt is None:
        return b""
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt={cache_salt!r} is invalid: must be None or a str")
    data = cache_salt.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(data)) + data


class BlockManager:
    """Hands out KV blocks to sequences, takes them back, and (optionally) reuses them by content.

    Blocks are ints in ``[0, num_blocks)``. Each has a reference count: the number of
    block tables holding it. A block with count 0 is *free*, and sits in one of two places:

    * ``free_blocks``: a stack of blocks with no reusable content; the most recently
      freed is handed out first (it is likely still in the CPU cache).
    * ``cached_free``: blocks whose content is registered under a hash, ordered least
      recently used first. A sequence is freed tail block first, so its tail is evicted
      before its head (a later request is more likely to share the head).

    A new block comes from ``free_blocks`` while there is one, else by evicting the
    front of ``cached_free`` (its hash is dropped). A block with a count above 0 is never
    evicted or overwritten. Cached-but-free blocks count as free for :attr:`usage`,
    :attr:`num_free_blocks` and admission, as in vLLM: an idle engine has usage 0.

    With prefix caching (``enable_prefix_caching``):

    * :meth:`cache_full_blocks` (called by the scheduler's ``postprocess`` as computed
      tokens advance) registers each block of a sequence once it is full of computed
      tokens, prompt or generated; ``cached`` maps hash -> block. If another block
      already holds the same content, the new one is not registered (one copy is findable).
    * :meth:`find_cached_prefix` returns the blocks of the longest run of a sequence's
      full blocks that are registered, leaving at least one token to compute: a prompt
      that is entirely cached recomputes its last block (writing into a shared block
      would change K/V another sequence reads).
    * :meth:`allocate` with those blocks starts the sequence from them.

    Args:
        num_blocks: pool size in blocks.
        block_size: tokens per block.
        enable_prefix_caching: keep and reuse the content of full blocks (off: every
            freed block goes to ``free_blocks`` and no hash is ever computed).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # front: evicted first
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0, cached content or not."""
        return len(self.free_blocks) + len(self.cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (reference count above 0), 0-1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # --- hashes ---------------------------------------------------------------------------
    def block_hash_of(self, seq: Sequence, i: int) -> bytes:
        """The hash of ``seq``'s full block ``i`` (positions ``i*block_size ..``), extending
        ``seq.block_hashes`` (the chain, computed once per sequence) as far as needed. The
        first block's extra keys are the sequence's cache salt and LoRA adapter
        (:func:`refengine.lora.lora_cache_key`): K/V computed under an adapter differ from the
        base model's for the same tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            # the chain carries both to every later block
            extra = cache_salt_key(seq.cache_salt) + lora_cache_key(seq.lora_request) if j == 0 else b""
            hashes.append(hash_block_tokens(parent, seq.token_ids_slice(j * bs, (j + 1) * bs), extra))
        return hashes[i]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached run of ``seq``'s leading full blocks.

        At most ``(len(seq) - 1) // block_size`` blocks, so at least one token is left to
        compute (its logits are needed). Changes no reference count; [] without prefix caching.
        """
        if not self.enable_prefix_caching:
            return []
        hit = []
        for i in range((len(seq) - 1) // self.block_size):
            block = self.cached.get(self.block_hash_of(seq, i))
            if block is None:
                break
            hit.append(block)
        return hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are now full of computed tokens.

        Blocks are registered in order, so the walk back from the last full block stops
        at the first one that already has a hash (one per step in steady decode).
        """
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        first = num_full
        while first > 0 and self.block_hash[seq.block_table[first - 1]] is None:
            first -= 1
        for i in range(first, num_full):
            block, h = seq.block_table[i], self.block_hash_of(seq, i)
            self.block_hash[block] = h
            self.cached.setdefault(h, block)  # a duplicate keeps its hash but is not findable

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's content (e.g. after changing weights).

        Returns:
            True when done; False, changing nothing, while any block is in use.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_free:
            self.block_hash[block] = None
            self.free_blocks.append(block)
        self.cached_free.clear()
        self.cached.clear()
        return True

    # --- allocation -----------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """New blocks ``seq`` must take to hold ``num_computed_tokens + num_new_tokens`` tokens
        (with ``num_cached_blocks``: after starting from that many cached blocks)."""
        if num_cached_blocks:
            return max(0, cdiv(num_cached_blocks * self.block_size + num_new_tokens, self.block_size)
                       - num_cached_blocks)
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Whether the free pool covers :meth:`blocks_needed` plus the free ones among
        ``cached_blocks`` (taking a free cached block removes it from the pool)."""
        taken = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return self.blocks_needed(seq, num_new_tokens, len(cached_blocks)) + taken <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> None:
        """Grow ``seq.block_table`` so the next ``num_new_tokens`` tokens have slots.

        Args:
            cached_blocks: from :meth:`find_cached_prefix`, for a sequence being admitted
                (no blocks, nothing computed): its block table starts with them (their
                counts go up) and ``num_computed_tokens`` becomes the tokens they hold;
                ``num_new_tokens`` then counts from there.
        Raises:
            RuntimeError: not enough free blocks (the scheduler checks first, so this is a bug).
        """
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            need = self.blocks_needed(seq, num_new_tokens, len(cached_blocks))
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        if cached_blocks:
            assert not seq.block_table and seq.num_computed_tokens == 0, "cached blocks start a sequence"
            for block in cached_blocks:
                if self.ref_counts[block] == 0:
                    del self.cached_free[block]
                self.ref_counts[block] += 1
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # evict the least recently used cached block
            block, _ = self.cached_free.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink ``seq.block_table`` to the blocks that hold its first ``num_tokens`` tokens
        and release the rest (speculative decoding: slots of rejected proposals)."""
        keep = cdiv(num_tokens, self.block_size)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first); those no other sequence holds become free,
        keeping their content when it is registered."""
        self._release(seq.block_table)
        seq.block_table = []

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``, tail first; a block left unreferenced
        becomes free (a cached one at the most recently used end of the LRU)."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                continue
            h = self.block_hash[block]
            if h is not None and self.cached.get(h) == block:
                self.cached_free[block] = None  # most recently used end
            else:
                self.block_hash[block] = None
                self.free_blocks.append(block)
