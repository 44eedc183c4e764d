"""Draft-model proposals: a smaller model with the same vocabulary guesses the next k tokens.

**KV cache.** The draft has its own :class:`~refengine.attention.kv_cache.KVCache` (its own layer
count and head sizes) with as many blocks as the target's and the same block size, and it
uses *the target's block tables*: position ``p`` of a sequence lives in block
``seq.block_table[p // block_size]`` of both pools. So the target's ``BlockManager`` and
scheduler decide for both: every slot the draft writes was reserved by the scheduler for
the target (the last token and the ``k`` speculative positions), a preemption or a finish
frees both at once, and no second block manager has to agree with the first.

**What the draft has computed.** The proposer remembers, per sequence, how many leading
positions hold valid draft K/V (``_computed``). Positions at or past the target's
``num_computed_tokens`` may hold K/V of rejected proposals, so the count is capped by it
at each use; a preempted sequence starts again from 0 (:meth:`DraftModelProposer.forget`,
which the engine calls with each step's preempted sequences). A sequence's first pass of
a step therefore catches up on whatever the draft has not seen (the whole prompt the
first time, then the last token, or two after a fully accepted run) and the draft only
ever runs for sequences that speculate.

**Proposals.** Pass 1 runs the catch-up chunks and takes the logits of each last row;
passes 2..k feed one proposed token per sequence. Every draft forward keeps to the
engine's ``max_num_batched_tokens`` rows, as the target's steps do (a first proposal after
a long prompt or a preemption catches up in chunks over several forwards, a sequence at
most once per forward), and sizes the CPU thread pools for its own rows first
(:func:`refengine.cpu.threads.adapt_threads`, as :class:`refengine.core.model_runner.ModelRunner`
does for the target), not for whatever the last target step was. Each distribution is
processed as the sampler would at that position (penalties see the earlier proposals)
and a greedy request proposes its argmax, a sampled one draws from it with the uniform its
sequence keys on the proposal's output position (purpose DRAFT); the processed draft
distributions are returned for the rejection sampler.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from refengine.attention import paged_metadata
from refengine.attention.kv_cache import KVCache
from refengine.sampler import DRAFT, Sampler
from refengine.spec_decode.rejection import draw, probs_from_logits

# ``Sequence`` (:mod:`refengine.core.sequence`) appears in annotations only, as a name: the core loop
# imports this module, never the other way round.


class HistoryView:
    """A sequence as the sampler sees it ``len(extra)`` positions later: the same request,
    its outputs followed by ``extra`` (proposed tokens). Fits :class:`refengine.sampler.SequenceLike`."""

    __slots__ = ("sampling_params", "uniforms", "prompt_token_ids", "output_token_ids")

    def __init__(self, seq: Sequence, extra: list[int]):
        self.sampling_params = seq.sampling_params
        self.uniforms = seq.uniforms
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + list(extra)


@dataclass
class Proposal:
    """What a proposer offers one sequence in one step.

    Attributes:
        token_ids: the ``k`` proposed ids.
        probs: ``[k, V]`` float64, row ``j`` the distribution ``token_ids[j]`` was drawn
            from; None when the proposals are deterministic (n-gram, or a greedy request).
    """

    token_ids: list[int]
    probs: np.ndarray | None = None


class DraftModelProposer:
    """Runs the draft model for the sequences that speculate in a step (module docstring).

    Args:
        model: the draft model (same vocabulary as the target, loaded on the same device).
        kv_cache: its KV pool, ``num_blocks`` and ``block_size`` equal to the target's.
        sampler: the engine's sampler (for the processing of each distribution).
        max_num_batched_tokens: most rows one draft forward may run (the engine's token
            budget; None: no limit).
    Raises:
        ValueError: ``max_num_batched_tokens < 1``.
    """

    def __init__(self, model, kv_cache: KVCache, sampler: Sampler, max_num_batched_tokens: int | None = None):
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.max_num_batched_tokens = max_num_batched_tokens
        self.xp = model.xp
        self._computed: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def forget(self, seqs) -> None:
        """Drop what the draft computed for ``seqs`` (preempted: their blocks are gone)."""
        for seq in seqs:
            self._computed.pop(seq, None)

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        """Propose ``k`` tokens for each ``(sequence, k)``.

        Each sequence must be decoding (``num_computed_tokens == len(seq) - 1``) with
        blocks reserved for positions up to ``len(seq) + k - 1`` (the scheduler does both).
        A sampled request's proposal at output position ``i`` inverts its uniform
        ``seq.uniforms(i, DRAFT)``.

        Returns:
            One :class:`Proposal` per item, in order.
        """
        if not items:
            return []
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[np.ndarray]] = [[] for _ in items]
        # pass 1: catch up to the last token, propose d_1
        chunks = []
        for seq, _ in items:
            start = min(self._computed.get(seq, 0), seq.num_computed_tokens)
            chunks.append((seq, start, seq.token_ids_slice(start, len(seq))))
        self._choose(self._forward(chunks), list(range(len(items))), items, drafts, probs)
        for j in range(1, max(k for _, k in items)):  # passes 2..k: feed d_j, propose d_{j+1}
            active = [i for i, (_, k) in enumerate(items) if k > j]
            chunks = [(items[i][0], len(items[i][0]) + j - 1, [drafts[i][-1]]) for i in active]
            self._choose(self._forward(chunks), active, items, drafts, probs)
        for seq, k in items:
            # positions < len + k - 1 hold draft K/V of the real tokens and d_1 .. d_{k-1};
            # the next use caps this at the target's num_computed_tokens (drops rejected ones)
            self._computed[seq] = len(seq) + k - 1
        return [Proposal(d, np.stack(p) if p and p[0] is not None else None) for d, p in zip(drafts, probs)]

    def _forward(self, chunks: list[tuple[Sequence, int, list[int]]]) -> np.ndarray:
        """Draft forwards over ``(sequence, first position, token ids)`` chunks, one per
        sequence, each forward at most ``max_num_batched_tokens`` rows (a chunk longer than
        what is left of a forward runs in pieces, in order); returns the ``[len(chunks), V]``
        float32 logits of each chunk's last row."""
        limit = self.max_num_batched_tokens
        if limit is None or sum(len(t) for _, _, t in chunks) <= limit:
            return self._forward_once(chunks)
        results: list[np.ndarray | None] = [None] * len(chunks)
        batch, owners, used = [], [], 0  # pieces of this forward; the chunk index each ends, or None
        for i, (seq, start, tokens) in enumerate(chunks):
            offset = 0
            while offset < len(tokens):
                take = min(len(tokens) - offset, limit - used)
                end = offset + take
                batch.append((seq, start + offset, tokens[offset:end]))
                owners.append(i if end == len(tokens) else None)
                used, offset = used + take, end
                if used == limit:  # full: run it; the rest of this chunk starts the next forward
                    self._run_pieces(batch, owners, results)
                    batch, owners, used = [], [], 0
        if batch:
            self._run_pieces(batch, owners, results)
        return np.stack(results)

    def _run_pieces(self, batch, owners, results) -> None:
        logits = self._forward_once(batch)
        for row, owner in enumerate(owners):
            if owner is not None:
                results[owner] = logits[row]

    def _forward_once(self, chunks: list[tuple[Sequence, int, list[int]]]) -> np.ndarray:
        """One draft forward over ``(sequence, first position, token ids)`` chunks (one per
        sequence); returns the ``[len(chunks), V]`` float32 logits of each chunk's last row."""
        xp, bs = self.xp, self.kv_cache.block_size
        q_lens = np.array([len(t) for _, _, t in chunks], dtype=np.int64)
        seq_lens = np.array([start + len(t) for _, start, t in chunks], dtype=np.int64)
        width = max(len(seq.block_table) for seq, _, _ in chunks)
        tables = np.full((len(chunks), width), -1, dtype=np.int32)
        for i, (seq, _, _) in enumerate(chunks):
            tables[i, :len(seq.block_table)] = seq.block_table
        meta = paged_metadata(q_lens, seq_lens, tables, bs)
        ids = np.fromiter((t for _, _, toks in chunks for t in toks), dtype=np.int64, count=int(q_lens.sum()))
        positions = np.concatenate([np.arange(start, start + len(t)) for _, start, t in chunks]).astype(np.int64)
        last_rows = np.cumsum(q_lens) - 1
        self.model.ops.begin_step(self.model, int(q_lens.sum()), int(q_lens.max()))  # this forward's thread pools
        logits = self.model.forward(xp.asarray(ids), positions, self.kv_cache, meta, xp.asarray(last_rows))
        return logits if xp is np else xp.asnumpy(logits)

    def _choose(self, logits: np.ndarray, active: list[int], items, drafts, probs) -> None:
        """Append one proposal per active item from its logits row (greedy: argmax; else a
        draw from the processed distribution, which is kept)."""
        views = [HistoryView(items[i][0], drafts[i]) for i in active]
        x = self.sampler.process_logits(logits, views)
        for row, i in enumerate(active):
            seq = items[i][0]
            if seq.sampling_params.greedy:
                drafts[i].append(int(np.argmax(x[row])))
                probs[i].append(None)
            else:
                q = probs_from_logits(x[row:row + 1])[0]
                drafts[i].append(draw(q, seq.uniforms(len(views[row].output_token_ids), DRAFT)))
                probs[i].append(q)
