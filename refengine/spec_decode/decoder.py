"""The engine's side of speculative decoding: how many tokens to propose, the proposals,
and the verification of a step's logits.

One step with speculation (``core/engine.py``, ``core/scheduler.py``)::

    scheduler.schedule()   once every running sequence has its own tokens, asks
                           num_spec_tokens(seq) for each decoding sequence and gives it
                           1 + k query tokens (k within what the token budget and the free
                           blocks have left, never preempting; KV slots reserved)
    propose(sched)         the k proposals of each such sequence (n-gram lookup or draft model)
    runner.execute()       one target pass; logits at all 1 + k rows of those sequences
    sample()               plain sequences: the sampler; speculating ones: verification
                           (refengine/spec_decode/rejection.py) on the distributions the
                           sampler would use at each position, with the uniforms the
                           sampler would use there (keyed by output position)
    scheduler.postprocess  appends the emitted tokens one by one through the stop rules,
                           advances num_computed_tokens past the accepted ones only, and
                           gives back the blocks that held rejected ones

Speculation is skipped for a sequence whose proposer has nothing (no n-gram match) and in
a step that starts with more running sequences than ``disable_by_batch_size``; ``k`` is
capped so no token past ``max_tokens`` or ``max_model_len`` is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refengine.sampler import (ACCEPT, NO_TOKEN, RESIDUAL, SAMPLE, Sampler, greedy_tokens, log_softmax, sample_rows,
                               sanitize_logits, top_logprobs)
from refengine.spec_decode.config import SpeculativeConfig
from refengine.spec_decode.draft_model import DraftModelProposer, HistoryView, Proposal
from refengine.spec_decode.ngram import propose_ngram
from refengine.spec_decode.rejection import probs_from_logits, rejection_sample, verify_tokens

# ``Sequence`` (:mod:`refengine.core.sequence`) appears in annotations only, as a name: the core loop
# imports this module, never the other way round.


@dataclass
class SpecDecodeStats:
    """One step's verification counts (vLLM's ``SpecDecodingStats``).

    Attributes:
        num_drafts: sequences that verified at least one proposal.
        num_draft_tokens: proposals verified.
        num_accepted_tokens: proposals accepted (counted by the verification, including
            any after a stop rule ended the sequence inside the accepted run).
        num_accepted_tokens_per_pos: ``[k]``, proposals accepted at each position 0..k-1.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    """Speculative decoding for one engine (module docstring).

    Args:
        config: the resolved ``speculative_config``.
        sampler: the engine's sampler (plain rows, and the processing of verified rows).
        max_model_len: most tokens a sequence may hold.
        draft: the draft-model proposer (``method="draft_model"``), else None.
    """

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int,
                 draft: DraftModelProposer | None = None):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"method {config.method!r} and draft={draft!r} do not go together")
        self.config = config
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.draft = draft
        self._ngram: dict[Sequence, list[int]] = {}  # proposals found while scheduling this step
        self.last_stats = SpecDecodeStats()

    # --- scheduling ------------------------------------------------------------------------
    def num_spec_tokens(self, seq: Sequence, num_running: int) -> int:
        """How many tokens to propose for decoding ``seq`` in a step that started with
        ``num_running`` running sequences (0: decode normally). The scheduler may grant fewer.

        At most k, at most ``max_tokens - 1`` past the outputs and ``max_model_len - 1``
        past the sequence (the step emits up to one token more than it verifies).
        """
        cfg = self.config
        if cfg.disable_by_batch_size is not None and num_running > cfg.disable_by_batch_size:
            return 0
        k = min(cfg.num_speculative_tokens, self.max_model_len - len(seq) - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return 0
        if cfg.method == "ngram":
            tokens = propose_ngram(seq.prompt_token_ids + seq.output_token_ids, cfg.prompt_lookup_min,
                                   cfg.prompt_lookup_max, k)
            self._ngram[seq] = tokens
            return len(tokens)
        return k

    # --- proposing -------------------------------------------------------------------------
    def propose(self, spec: dict[Sequence, int], preempted: list[Sequence]) -> dict[Sequence, Proposal]:
        """The proposals of a scheduled step.

        Args:
            spec: sequence -> number of speculative tokens the scheduler granted it.
            preempted: the sequences the step preempted (the draft forgets them).
        Returns:
            sequence -> :class:`Proposal` of exactly the granted length.
        """
        found, self._ngram = self._ngram, {}
        if self.draft is not None:
            self.draft.forget(preempted)
        items = list(spec.items())
        if self.draft is not None:
            proposals = self.draft.propose(items)
        else:
            proposals = [Proposal(found[seq][:k]) for seq, k in items]
        assert all(len(p.token_ids) == k for p, (_, k) in zip(proposals, items))
        return {seq: p for (seq, _), p in zip(items, proposals)}

    # --- verifying -------------------------------------------------------------------------
    def sample(self, logits: np.ndarray, sample_seqs: list[Sequence], proposals: dict[Sequence, Proposal]):
        """Turn a step's logits into emitted tokens.

        Args:
            logits: ``[R, V]`` float32, rows in ``sample_seqs`` order: one row per plain
                sequence, ``1 + k`` rows per sequence in ``proposals``.
            sample_seqs: the sequences that sample this step.
            proposals: what each speculating sequence proposed.
        Returns:
            ``(sampled, num_rejected)``: ``sampled`` as :meth:`Scheduler.postprocess` takes
            it (a token id for a plain sequence; a list of ids and a list of logprobs
            dicts or None for a speculating one), and sequence -> proposals rejected.
            Also sets :attr:`last_stats`.
        """
        sizes = [1 + len(proposals[s].token_ids) if s in proposals else 1 for s in sample_seqs]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        plain = [i for i, s in enumerate(sample_seqs) if s not in proposals]
        out = self.sampler(logits[starts[plain]], [sample_seqs[i] for i in plain]) if plain else None
        sampled: list = [None] * len(sample_seqs)
        for j, i in enumerate(plain):
            sampled[i] = (sample_seqs[i], int(out.token_ids[j]), out.logprobs[j] if out.logprobs is not None else None)
        k_max = max((len(p.token_ids) for p in proposals.values()), default=0)
        stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * k_max)
        num_rejected = {}
        spec = [i for i, s in enumerate(sample_seqs) if s in proposals]
        if spec:
            # every verified row processed in one batch: the row for position j of a sequence
            # sees its proposals d_1 .. d_j in the history (penalties, min_tokens)
            rows = np.concatenate([np.arange(starts[i], starts[i] + sizes[i]) for i in spec])
            views = [HistoryView(sample_seqs[i], proposals[sample_seqs[i]].token_ids[:j])
                     for i in spec for j in range(sizes[i])]
            # owners: each row's grammar (structured outputs) is its sequence's matcher
            # after the row's proposals; a rejected proposal is rolled back at the next use
            processed = self.sampler.process_logits(logits[rows], views,
                                                    owners=[sample_seqs[i] for i in spec for _ in range(sizes[i])])
        offset = 0
        for i in spec:
            seq, prop = sample_seqs[i], proposals[sample_seqs[i]]
            x = processed[offset:offset + sizes[i]]
            offset += sizes[i]
            tokens, accepted = self._verify(seq, x, prop)
            logprobs = None
            if seq.sampling_params.logprobs is not None:
                raw = log_softmax(sanitize_logits(logits[starts[i]:starts[i] + len(tokens)]))
                logprobs = [None if t == NO_TOKEN else top_logprobs(raw[j], t, seq.sampling_params.logprobs)
                            for j, t in enumerate(tokens)]
            sampled[i] = (seq, tokens, logprobs)
            num_rejected[seq] = len(prop.token_ids) - accepted
            stats.num_drafts += 1
            stats.num_draft_tokens += len(prop.token_ids)
            stats.num_accepted_tokens += accepted
            for j in range(accepted):
                stats.num_accepted_tokens_per_pos[j] += 1
        self.last_stats = stats
        return sampled, num_rejected

    @staticmethod
    def _verify(seq: Sequence, x: np.ndarray, prop: Proposal) -> tuple[list[int], int]:
        """Verify one sequence's ``k`` proposals on its ``[k + 1, V]`` processed logits ``x``
        (refengine/spec_decode/rejection.py); position ``j`` is output position
        ``seq.num_output_tokens + j``, whose uniforms are the sequence's own. A row the
        masks left without any token gives :data:`NO_TOKEN` there (no proposal matches
        it), which ends the sequence."""
        k, first = len(prop.token_ids), seq.num_output_tokens
        if seq.sampling_params.greedy:
            return verify_tokens(greedy_tokens(x), prop.token_ids)
        if prop.probs is None:  # deterministic proposals: the plain sampler's tokens, matched
            return verify_tokens(sample_rows(x, [seq.uniforms(first + j, SAMPLE) for j in range(k + 1)]),
                                 prop.token_ids)
        # verify only up to the first row without a token: nothing can be accepted there
        empty = np.flatnonzero(~np.isfinite(x[:k].max(axis=-1)))
        e = int(empty[0]) if empty.size else k
        tokens, accepted = rejection_sample(probs_from_logits(x[:e]), prop.token_ids[:e], prop.probs[:e],
                                            [seq.uniforms(first + j, ACCEPT) for j in range(e)],
                                            [seq.uniforms(first + j, RESIDUAL) for j in range(e)])
        if accepted == e:  # the bonus token: what the plain sampler emits at that position
            tokens.append(NO_TOKEN if e < k else int(sample_rows(x[k:], [seq.uniforms(first + k, SAMPLE)])[0]))
        return tokens, accepted
