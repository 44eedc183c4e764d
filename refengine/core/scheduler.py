"""The scheduler: which sequences run in the next step, and how many tokens each.

One step, as vLLM's scheduler does it (continuous batching with chunked prefill):

1. **Running sequences first**, oldest first. A decoding sequence gets one token; one in
   the middle of a chunked prefill gets its next chunk, as much as the token budget
   allows. If its next tokens need a KV block and none is free, the most recently
   admitted running sequence is **preempted by recompute**: its blocks are freed and it
   goes back to the front of the waiting queue (it may be the sequence itself).
2. **Then waiting sequences**, first come first served, while the token budget
   (``max_num_batched_tokens``), ``max_num_seqs`` and free blocks allow. With prefix
   caching, a sequence first takes the longest run of cached full blocks of its tokens
   and only the rest counts against the budget (always at least one token). The last one
   admitted may get only a chunk of its prompt. No admissions in a step that preempted:
   the pool is short, so new work would only be preempted again.

A preempted sequence comes back as a prefill of its prompt plus what it already
generated (minus whatever of it is still cached), and continues exactly where it stopped.

With speculative decoding (:mod:`refengine.spec_decode`), a decoding sequence may also get
``k`` speculative tokens to verify: ``1 + k`` query tokens, ``k`` as many as the proposer
has and as what is left of the token budget and the free blocks once every running
sequence has its own tokens (step 1), oldest first, before any admission. Proposals
never preempt and never take a later running sequence's decode slot; a step that
preempted has none. Its ``num_computed_tokens`` then advances only past the accepted ones
(never past the sequence's end, when a stop rule cut the accepted run short), and the
blocks reserved for rejected ones that it no longer needs go back to the pool.

After the model has run, :meth:`Scheduler.postprocess` is the one place where a step's
results are applied: computed tokens advance (blocks they fill become cached), sampled
tokens are appended, the stop rules (:mod:`refengine.stop`) run, finished sequences leave
the queues and free their blocks. Blocks are registered there and not at scheduling, so
sequences admitted in the same step do not share the blocks that step computes.

Source: Yu et al. 2022 ("Orca", iteration-level scheduling), Kwon et al. 2023 §4.5
(preemption by recompute), Agrawal et al. 2024 ("Sarathi-Serve", chunked prefill).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from refengine.config import SchedulerConfig
from refengine.core.block_manager import BlockManager
from refengine.core.sequence import Sequence, SequenceStatus
from refengine.stop import StopChecker, StopDecision


@dataclass
class SchedulerOutput:
    """What to run this step: ``(sequence, num_new_tokens)`` pairs, and what was preempted.

    ``prefix_cache_queries`` / ``prefix_cache_hits``: tokens of the sequences admitted this
    step that were looked up in the prefix cache / found there (0 with caching off).
    ``spec`` maps each sequence that verifies proposals to their number ``k`` (its
    ``num_new_tokens`` is then ``1 + k``: its last token and the ``k`` proposals).
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec: dict[Sequence, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and the block manager.

    Args:
        config: the limits (token budget, ``max_num_seqs``, chunked prefill).
        block_manager: the KV pool.
        stop_checker: the stop rules :meth:`postprocess` applies (None: sequences end
            only when finished from outside, as in unit tests of scheduling alone).
        speculator: speculative decoding's ``num_spec_tokens(seq, num_running) -> int``
            (:class:`refengine.spec_decode.SpecDecoder`); None: no speculation.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 stop_checker: StopChecker | None = None, speculator=None):
        self.config = config
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of ``waiting``."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Decide the next step.

        Side effects: allocates the KV blocks the scheduled tokens need, moves admitted
        sequences from ``waiting`` to ``running`` and preempted ones back to the front of
        ``waiting``. ``num_computed_tokens`` is advanced by :meth:`postprocess`, once the
        step has run.

        Returns:
            The ``(sequence, num_new_tokens)`` pairs to run (every ``num_new_tokens >= 1``)
            and the sequences preempted.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        num_running = len(self.running)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            assert n > 0, f"running sequence {seq.request_id} has nothing to compute"
            while not bm.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # seq preempted itself; everything after it is gone too
            bm.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1

        if out.preempted:
            return out  # the pool is short: no proposals, no admissions
        if self.speculator is not None:
            budget = self._schedule_spec_tokens(out, budget, num_running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # waiting sequences hold no blocks; one still owed prompt logprobs computes every row (as vLLM's)
            cached = [] if seq.needs_prompt_logprobs else bm.find_cached_prefix(seq)
            num_cached = len(cached) * bm.block_size
            n = len(seq) - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not bm.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            bm.allocate(seq, n, cached)  # num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:  # as vLLM: the first admission's hit is reported
                seq.num_cached_tokens = num_cached
            if bm.enable_prefix_caching:
                out.prefix_cache_queries += len(seq)
                out.prefix_cache_hits += num_cached
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _schedule_spec_tokens(self, out: SchedulerOutput, budget: int, num_running: int) -> int:
        """Speculative decoding: give decoding sequences proposal slots from what every
        running sequence's own tokens left, oldest first. Returns the budget left.

        Runs after the running loop, so a proposal never takes the budget or the block a
        later running sequence needs for its decode token, and never preempts.
        """
        for idx, (seq, n) in enumerate(out.scheduled):
            if budget <= 0:
                break
            if n != 1 or seq.num_uncomputed_tokens != 1:
                continue  # prefill chunks never speculate
            k = self._num_spec_tokens(seq, budget, num_running)
            if k:
                out.spec[seq] = k
                out.scheduled[idx] = (seq, 1 + k)
                budget -= k
        return budget

    def _num_spec_tokens(self, seq: Sequence, budget: int, num_running: int) -> int:
        """Speculative tokens for decoding ``seq`` (its decode slot already allocated): what
        the proposer wants, within ``budget`` and the free blocks (reserved here; never
        preempting for them)."""
        k = min(self.speculator.num_spec_tokens(seq, num_running), budget)
        while k > 0 and not self.block_manager.can_allocate(seq, 1 + k):
            k -= 1
        if k:
            self.block_manager.allocate(seq, 1 + k)
        return k

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def postprocess(self, scheduled: list[tuple[Sequence, int]], sampled: list[tuple[Sequence, int, dict | None]],
                    num_rejected: dict[Sequence, int] | None = None) -> list[tuple[Sequence, StopDecision | None]]:
        """Apply a step's results: the only place a step changes sequences.

        All or nothing: the sampled tokens are appended and the stop rules run first (the
        part that can fail, e.g. inside the detokenizer); if that raises, every sequence is
        rolled back to its state before the call and the exception propagates, so the
        step counts as not run and the next one redoes it. Only then do the chunks count
        as computed and finished sequences leave the queues.

        Args:
            scheduled: what the step ran, ``(sequence, num_new_tokens)``: each chunk now
                counts as computed, and the blocks it filled become cached.
            sampled: ``(sequence, token id, logprobs or None)`` for each sequence that
                sampled this step (logprobs: ``{token_id: logprob}``, kept when asked for).
                A sequence that verified proposals has a list of token ids (the accepted
                proposals, then one more) and a list of logprobs (or None); they are
                appended one by one, and a stop rule met by one of them ends the sequence
                there, the rest dropped.
            num_rejected: sequence -> proposals it rejected: its chunk counts as computed
                only up to the last accepted one (default: none rejected).
        Returns:
            ``(sequence, decision)`` per sampled sequence; a sequence whose decision is not
            None has finished (``finish_reason``/``stop_reason`` set, blocks freed).
        """
        checkpoints = []
        decisions = []
        try:
            for seq, token, logprobs in sampled:
                checkpoints.append((seq, seq.checkpoint()))
                if not isinstance(token, list):
                    token, logprobs = [token], [logprobs]
                elif logprobs is None:
                    logprobs = [None] * len(token)
                decision = None
                for t, lp in zip(token, logprobs):  # one by one: a stop inside a run ends it there
                    if lp is not None:
                        seq.logprobs.append(lp)
                    if self.stop_checker is None:
                        seq.output_token_ids.append(t)
                    else:
                        decision = self.stop_checker.append_and_check(seq, t)
                        if decision is not None:
                            break
                decisions.append(decision)
        except BaseException:
            for seq, checkpoint in reversed(checkpoints):
                seq.rollback(checkpoint)
            raise
        rejected = num_rejected or {}
        for seq, n in scheduled:
            # a stop inside an accepted run drops the tokens after it: their K/V is not the
            # sequence's, and a block past its end must not be hashed into the prefix cache
            seq.num_computed_tokens = min(seq.num_computed_tokens + n - rejected.get(seq, 0), len(seq))
            self.block_manager.cache_full_blocks(seq)
        self._release_rejected_slots(rejected)
        results = []
        for (seq, _, _), decision in zip(sampled, decisions):
            if decision is not None:
                seq.finish_reason, seq.stop_reason = decision.finish_reason, decision.stop_reason
                self.finish(seq)
            results.append((seq, decision))
        return results

    def _release_rejected_slots(self, rejected: dict[Sequence, int]) -> None:
        """Speculative decoding: blocks reserved for proposals that were rejected, past what
        the sequence now needs (its next token's slot included), go back to the pool."""
        for seq, n in rejected.items():
            if n:
                self.block_manager.free_tail(seq, len(seq))

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from either queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
