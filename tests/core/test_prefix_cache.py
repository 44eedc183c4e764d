"""Prefix caching in the block manager and the scheduler, with no model.

The block manager's hash chain, reference counts, LRU eviction of free cached blocks (and
never of a block in use), and the scheduler's admission from the longest cached prefix.
A stub "model step" hands ``postprocess`` one token per sequence whose chunk reached its
end, as the engine does.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from refengine.config import SchedulerConfig
from refengine.core.block_manager import BlockManager, hash_block_tokens
from refengine.core.scheduler import Scheduler
from refengine.core.sequence import Sequence
from refengine.sampling_params import SamplingParams
from tests.helpers import plan, stub_step

BS = 4


def seq(name: str, tokens, salt: str | None = None) -> Sequence:
    return Sequence(name, None, list(tokens), SamplingParams(max_tokens=100), cache_salt=salt)


def computed(bm: BlockManager, s: Sequence, cached=()) -> Sequence:
    """Allocate ``s``'s whole remaining prompt and mark it computed, as a step + postprocess would."""
    n = len(s) - len(cached) * bm.block_size
    bm.allocate(s, n, list(cached))
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)
    return s


def assert_idle(bm: BlockManager):
    assert bm.ref_counts == [0] * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0


# --- hash chain -----------------------------------------------------------------------------

def test_hash_chain_is_sha256_over_parent_tokens_and_salt():
    def sha(parent: bytes, tokens, extra=b"") -> bytes:  # the documented formula, written out
        return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens) + extra).digest()

    bm = BlockManager(8, BS, enable_prefix_caching=True)
    s = seq("a", range(10, 20))
    h0, h1 = bm.block_hash_of(s, 0), bm.block_hash_of(s, 1)
    assert h0 == sha(bytes(32), [10, 11, 12, 13])
    assert h1 == sha(h0, [14, 15, 16, 17])
    assert s.block_hashes == [h0, h1]  # computed once, kept on the sequence
    assert hash_block_tokens(None, [10, 11, 12, 13]) == h0
    # the same tokens after a different parent, or with a salt, are different content
    assert hash_block_tokens(hash_block_tokens(None, [0, 0, 0, 0]), [14, 15, 16, 17]) != h1
    salted = seq("b", range(10, 20), salt="tenant-1")
    assert bm.block_hash_of(salted, 0) == sha(bytes(32), [10, 11, 12, 13], struct.pack("<Q", 8) + b"tenant-1")
    assert bm.block_hash_of(salted, 1) == sha(bm.block_hash_of(salted, 0), [14, 15, 16, 17])
    # generated tokens continue the chain across the prompt/output boundary
    g = seq("c", range(10, 16))
    g.output_token_ids = [16, 17]
    assert bm.block_hash_of(g, 1) == h1


def test_only_full_computed_blocks_are_cached_and_a_salt_separates_them():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq("a", range(10))  # blocks [0..3] [4..7] [8 9 _ _]
    bm.allocate(a, 10)
    a.num_computed_tokens = 6  # a chunk of 6: only block 0 is full
    bm.cache_full_blocks(a)
    assert list(bm.cached.values()) == [a.block_table[0]]
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert list(bm.cached.values()) == a.block_table[:2]  # the partial tail block is not cached
    assert bm.find_cached_prefix(seq("b", list(range(8)) + [99, 98])) == a.block_table[:2]
    assert bm.find_cached_prefix(seq("c", [0, 1, 2, 3, 9, 9, 9, 9, 9])) == a.block_table[:1]
    assert bm.find_cached_prefix(seq("d", range(10), salt="x")) == []


@pytest.mark.parametrize("length, expected_blocks", [(7, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_a_hit_always_leaves_at_least_one_token_to_compute(length, expected_blocks):
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    bm.free(computed(bm, seq("a", range(40))))
    hit = bm.find_cached_prefix(seq("b", range(length)))
    # at most (length - 1) // BS blocks: a prompt of whole blocks recomputes its last block
    assert len(hit) == expected_blocks == (length - 1) // BS


def test_caching_off_computes_no_hash_and_finds_nothing():
    bm = BlockManager(8, BS)
    a = computed(bm, seq("a", range(9)))
    assert a.block_hashes == [] and bm.cached == {}
    bm.free(a)
    assert bm.find_cached_prefix(seq("b", range(9))) == []
    assert bm.free_blocks == [7, 6, 5, 4, 3, 2, 1, 0]  # the plain stack: last freed (head) reused first


# --- reference counts -------------------------------------------------------------------------

def test_shared_blocks_are_reference_counted():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, seq("a", range(9)))  # 2 full blocks + 1 partial
    hit = bm.find_cached_prefix(seq("probe", range(9)))
    assert hit == a.block_table[:2]
    b = seq("b", range(9))
    assert bm.can_allocate(b, 1, hit)
    bm.allocate(b, 1, hit)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial tail is never shared
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4 and bm.usage == pytest.approx(0.5)
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    bm.free(b)
    assert_idle(bm)
    assert len(bm.cached_free) == 2 and len(bm.cached) == 2  # content kept while free


# --- eviction ---------------------------------------------------------------------------------

def test_eviction_is_lru_and_takes_a_sequence_tail_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = computed(bm, seq("a", range(100, 112)))  # 3 full blocks
    b = computed(bm, seq("b", range(200, 212)))  # 3 full blocks: the pool is full
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    assert bm.num_free_blocks == 0
    bm.free(a)  # a first: least recently used
    bm.free(b)
    assert_idle(bm)
    assert list(bm.cached_free) == a_blocks[::-1] + b_blocks[::-1]
    c = seq("c", range(300, 308))
    bm.allocate(c, 8)  # two blocks: a's tail, then a's middle
    assert c.block_table == [a_blocks[2], a_blocks[1]]
    assert bm.find_cached_prefix(seq("a2", range(100, 112))) == a_blocks[:1]  # a's head survives
    bm.free(c)  # never computed, so no content: back on the plain free stack
    assert bm.free_blocks == [a_blocks[1], a_blocks[2]] and list(bm.cached_free) == [a_blocks[0]] + b_blocks[::-1]
    # d reuses b's head (no longer free) and takes its new block from the plain stack first
    d = seq("d", list(range(200, 204)) + [7, 7])
    computed(bm, d, bm.find_cached_prefix(d))
    assert d.block_table == [b_blocks[0], a_blocks[2]]
    e = seq("e", range(400, 412))
    bm.allocate(e, 12)  # the plain stack, then the least recently used cached blocks
    assert e.block_table == [a_blocks[1], a_blocks[0], b_blocks[2]]
    assert bm.block_hash[a_blocks[0]] is None and bm.find_cached_prefix(seq("a3", range(100, 112))) == []
    assert list(bm.cached_free) == [b_blocks[1]] and bm.ref_counts[b_blocks[0]] == 1
    bm.free(d)
    bm.free(e)
    assert_idle(bm)


def test_a_block_in_use_is_never_evicted():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, seq("a", range(9)))  # 3 blocks in use, 2 of them cached
    hashes = [bm.block_hash[x] for x in a.block_table[:2]]
    b = seq("b", range(50, 58))
    assert not bm.can_allocate(b, 8)  # one free block, two needed: nothing is evicted
    with pytest.raises(RuntimeError, match="out of KV blocks: need 2, 1 free"):
        bm.allocate(b, 8)
    assert b.block_table == []
    bm.allocate(b, 4)
    assert set(b.block_table).isdisjoint(a.block_table)
    assert [bm.block_hash[x] for x in a.block_table[:2]] == hashes
    assert bm.find_cached_prefix(seq("a2", range(9))) == a.block_table[:2]
    # taking a free cached block for a hit counts against the pool like a new block
    bm.free(b)
    bm.free(a)
    c = seq("c", range(9))
    hit = bm.find_cached_prefix(c)
    assert len(hit) == 2 and bm.can_allocate(c, 1, hit)
    assert not bm.can_allocate(c, 1 + 2 * BS, hit)  # 2 hits + 3 new > 4 blocks


def test_duplicate_content_keeps_one_findable_copy():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a, b = seq("a", range(5)), seq("b", range(5))
    bm.allocate(a, 5)
    bm.allocate(b, 5)  # admitted in the same step: both compute block 0
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    assert bm.cached == {a.block_hashes[0]: a.block_table[0]}
    bm.free(b)
    assert b.block_hashes[0] in bm.cached and len(bm.cached_free) == 0  # b's copy went back unregistered
    bm.free(a)
    assert list(bm.cached_free) == [bm.cached[a.block_hashes[0]]]
    assert_idle(bm)


def test_reset_prefix_cache():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, seq("a", range(9)))
    assert bm.reset_prefix_cache() is False and len(bm.cached) == 2  # refused while in use
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert bm.cached == {} and len(bm.cached_free) == 0 and bm.block_hash == [None] * 4
    assert bm.find_cached_prefix(seq("b", range(9))) == []
    assert_idle(bm)


# --- scheduler ------------------------------------------------------------------------------

def make(num_blocks=64, **kw) -> Scheduler:
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, "enable_chunked_prefill": True,
                             "max_model_len": 1000, **kw})
    return Scheduler(cfg, BlockManager(num_blocks, BS, enable_prefix_caching=True))


def test_admission_computes_only_the_uncached_rest():
    sched = make()
    a = seq("a", range(30))
    sched.add(a)
    out = stub_step(sched)
    assert plan(out) == [("a", 30)] and (out.prefix_cache_queries, out.prefix_cache_hits) == (30, 0)
    assert a.num_cached_tokens == 0
    sched.finish(a)
    b = seq("b", list(range(30)) + [5, 5])
    sched.add(b)
    out = stub_step(sched)
    # 7 of a's blocks are full (28 tokens); b computes 4
    assert plan(out) == [("b", 4)] and (out.prefix_cache_queries, out.prefix_cache_hits) == (32, 28)
    assert b.num_cached_tokens == 28 and b.num_computed_tokens == 32 and b.output_token_ids == [7]


def test_chunked_prefill_after_a_hit_and_blocks_cached_as_chunks_fill():
    sched = make(max_num_batched_tokens=6)
    a = seq("a", range(20))
    sched.add(a)
    assert plan(stub_step(sched)) == [("a", 6)]
    assert len(sched.block_manager.cached) == 1  # block 0 filled by the first chunk: cached at once
    b = seq("b", list(range(16)) + [50] * 10)
    sched.add(b)
    assert plan(stub_step(sched)) == [("a", 6)]  # the budget is spent on a
    assert plan(stub_step(sched)) == [("a", 6)]
    assert len(sched.block_manager.cached) == 4
    # b reuses a's 4 blocks (16 tokens) and its remaining 10 tokens are chunked
    assert plan(stub_step(sched)) == [("a", 2), ("b", 4)]
    assert b.num_cached_tokens == 16 and b.num_computed_tokens == 20
    assert plan(stub_step(sched)) == [("a", 1), ("b", 5)]
    assert plan(stub_step(sched)) == [("a", 1), ("b", 1)]
    assert b.output_token_ids == [7]


def test_preempted_sequence_comes_back_from_its_cached_blocks():
    # 6 blocks of 4: a (9 tokens) and b (9 tokens) take 3 each
    sched = make(num_blocks=6)
    a, b = seq("a", range(9)), seq("b", range(100, 109))
    sched.add(a)
    sched.add(b)
    assert plan(stub_step(sched)) == [("a", 9), ("b", 9)]
    for _ in range(4):  # decode until a needs a fourth block (position 12)
        out = stub_step(sched)
    assert out.preempted == [b] and b.block_table == []
    bm = sched.block_manager
    # b's 3 full blocks (9 prompt + 3 generated tokens) kept their content; a's new block
    # evicted the least recently used of them, b's tail
    assert len(bm.cached_free) == 2
    sched.finish(a)
    out = stub_step(sched)
    # b holds 13 tokens (9 prompt + 4 generated): 2 blocks cached, 5 tokens recomputed
    assert plan(out) == [("b", 5)] and out.prefix_cache_hits == 8
    assert b.num_cached_tokens == 0  # reported from its first admission, as vLLM
    sched.finish(b)
    assert_idle(bm)
