"""Unit tests of the block manager and the scheduler's decisions, with no model.

A stub "model step" hands the scheduler's ``postprocess`` one token for each sequence whose
chunk reached its end, as the engine does.
"""

from __future__ import annotations

import pytest

from refengine.config import SchedulerConfig
from refengine.core.block_manager import BlockManager
from refengine.core.scheduler import Scheduler
from refengine.core.sequence import Sequence, SequenceStatus
from refengine.sampling_params import SamplingParams
from tests.helpers import plan, stub_step


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, None, list(range(prompt_len)), SamplingParams(max_tokens=100))


def make(num_blocks=100, block_size=4, **kw) -> Scheduler:
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 8, "enable_chunked_prefill": True,
                             "max_model_len": 1000, **kw})
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


# --- block manager --------------------------------------------------------------------

def test_block_manager_allocates_per_block_and_frees_everything():
    bm = BlockManager(num_blocks=5, block_size=4)
    s = seq("a", 5)
    assert bm.blocks_needed(s, 5) == 2
    bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 3
    s.num_computed_tokens = 5
    assert bm.blocks_needed(s, 3) == 0  # positions 5..7 fit block 1
    assert bm.blocks_needed(s, 4) == 1  # position 8 opens block 2
    assert not bm.can_allocate(s, 4 * 4)
    assert bm.usage == pytest.approx(0.4)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 5 and bm.usage == 0.0
    with pytest.raises(RuntimeError, match="out of KV blocks: need 6, 5 free"):
        bm.allocate(seq("b", 24), 24)


def test_block_manager_hands_out_distinct_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    seqs = [seq(str(i), 4) for i in range(3)]
    for s in seqs:
        bm.allocate(s, 4)
    ids = [b for s in seqs for b in s.block_table]
    assert sorted(ids) == list(range(6)) and bm.num_free_blocks == 0


# --- scheduler ------------------------------------------------------------------------

def test_token_budget_chunks_the_last_admitted_prompt():
    sched = make(max_num_batched_tokens=16)
    for name, n in [("a", 10), ("b", 10), ("c", 3)]:
        sched.add(seq(name, n))
    assert plan(stub_step(sched)) == [("a", 10), ("b", 6)]  # b gets a chunk, c waits
    # running first: a decodes (1), b finishes its prompt (4), c is admitted whole (3)
    assert plan(stub_step(sched)) == [("a", 1), ("b", 4), ("c", 3)]
    assert plan(stub_step(sched)) == [("a", 1), ("b", 1), ("c", 1)]


def test_chunked_prefill_off_waits_for_a_whole_prompt():
    sched = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    for name, n in [("a", 10), ("b", 10)]:
        sched.add(seq(name, n))
    assert plan(stub_step(sched)) == [("a", 10)]
    assert plan(stub_step(sched)) == [("a", 1), ("b", 10)]


def test_max_num_seqs_limits_admission():
    sched = make(max_num_seqs=2, max_num_batched_tokens=100)
    for name in "abc":
        sched.add(seq(name, 3))
    assert plan(stub_step(sched)) == [("a", 3), ("b", 3)]
    assert plan(stub_step(sched)) == [("a", 1), ("b", 1)]
    sched.finish(sched.running[0])
    assert plan(stub_step(sched)) == [("b", 1), ("c", 3)]


def test_preemption_takes_the_most_recent_and_requeues_it_first():
    # 4 blocks of 4 tokens; a and b each take 2 blocks for 8-token prompts
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b, c = seq("a", 8), seq("b", 8), seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    assert plan(stub_step(sched)) == [("a", 8), ("b", 8)]  # pool full, c waits
    # a's 9th token needs a new block: b (newest) is preempted, its blocks freed
    out = stub_step(sched)
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b, c]
    # b comes back as a prefill of prompt + its generated token (9 tokens) once a finishes
    sched.finish(a)
    assert plan(stub_step(sched)) == [("b", 9), ("c", 2)]
    assert b.output_token_ids == [7, 7]


def test_a_sequence_that_cannot_grow_preempts_itself():
    sched = make(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    a = seq("a", 8)
    sched.add(a)
    stub_step(sched)
    out = stub_step(sched)
    assert out.scheduled == [] and out.preempted == [a]
    assert sched.block_manager.num_free_blocks == 2


def test_finish_frees_blocks_from_either_queue():
    sched = make(num_blocks=10, block_size=4)
    a, b = seq("a", 5), seq("b", 40)
    sched.add(a)
    sched.add(b)
    stub_step(sched)  # a whole, b a chunk of 11
    assert sched.block_manager.num_free_blocks == 10 - 2 - 3
    sched.finish(b)
    sched.finish(a)
    assert sched.block_manager.num_free_blocks == 10
    assert not sched.has_unfinished()
