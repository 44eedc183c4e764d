"""Turns a scheduler decision into one flat batch, runs the model, returns logits.

The flat batch (README, "Where to start reading", step 3): the new tokens of every
scheduled sequence concatenated, with their positions and the attention metadata that
says which rows belong to which sequence and where their K/V go in the paged cache.
"""

from __future__ import annotations

import numpy as np

from refengine.attention import paged_metadata
from refengine.attention.kv_cache import KVCache
from refengine.core.sequence import Sequence
from refengine.lora import LoRABatch


def build_batch(scheduled: list[tuple[Sequence, int]], block_size: int,
                spec_tokens: dict[Sequence, list[int]] | None = None):
    """Lay the scheduled chunks out as one flat batch.

    Args:
        scheduled: ``(sequence, num_new_tokens)``; the tokens are positions
            ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1`` of the sequence,
            and its block table already covers them.
        block_size: tokens per KV block.
        spec_tokens: speculative decoding: sequence -> its ``k`` proposed tokens, which
            are the last ``k`` of its ``num_new_tokens`` (they follow the sequence's end).
    Returns:
        ``(input_ids [T] int64, positions [T] int64, meta, sample_rows [S] int64, sample_seqs)``
        where ``sample_seqs`` are the sequences whose chunk reaches their last token (they
        sample a token this step) and ``sample_rows`` their last rows in the batch (all
        ``1 + k`` rows, in order, for a sequence with proposals).
    """
    spec_tokens = spec_tokens or {}
    num_seqs = len(scheduled)
    q_lens = np.array([n for _, n in scheduled], dtype=np.int32)
    max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
    block_tables = np.full((num_seqs, max_blocks), -1, dtype=np.int32)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    input_ids, positions = [], []
    sample_rows, sample_seqs = [], []
    rows = 0
    for i, (seq, n) in enumerate(scheduled):
        start = seq.num_computed_tokens
        drafts = spec_tokens.get(seq, [])
        block_tables[i, :len(seq.block_table)] = seq.block_table
        seq_lens[i] = start + n
        input_ids.append(seq.token_ids_slice(start, start + n - len(drafts)) + list(drafts))
        positions.append(np.arange(start, start + n))
        rows += n
        if start + n - len(drafts) == len(seq):
            sample_rows.extend(range(rows - 1 - len(drafts), rows))
            sample_seqs.append(seq)
    positions = np.concatenate(positions)
    meta = paged_metadata(q_lens, seq_lens, block_tables, block_size)
    ids = np.fromiter((t for chunk in input_ids for t in chunk), dtype=np.int64, count=int(q_lens.sum()))
    return ids, positions.astype(np.int64), meta, np.array(sample_rows, dtype=np.int64), sample_seqs


def prompt_logprob_rows(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, np.ndarray]]:
    """The flat-batch rows whose logits give prompt log-probabilities this step.

    For a sequence with ``SamplingParams.prompt_logprobs`` (``seq.prompt_logprobs`` holds
    entries ``0 .. m - 1``), the row at prompt position ``p`` predicts prompt token
    ``p + 1``: its chunk's rows at positions ``m - 1 .. len(prompt) - 2`` are wanted, the
    last prompt position being the sampling row. Positions already filled (a recompute after
    preemption) or wanted from an earlier sequence of the batch that shares the list (the
    request's other ``n`` completions) are skipped, so no entry is computed twice.

    Returns:
        ``(sequence, first entry index j, rows [r] int64)`` per sequence with rows this step;
        row ``i`` gives entry ``j + i``.
    """
    out = []
    planned: dict[int, int] = {}  # id(shared list) -> first entry not yet wanted in this batch
    offset = 0
    for seq, n in scheduled:
        lps = seq.prompt_logprobs
        if lps is not None and len(lps) < seq.num_prompt_tokens:
            start = seq.num_computed_tokens
            first = max(start, planned.get(id(lps), len(lps)) - 1)  # positions, each giving entry p + 1
            end = min(start + n, seq.num_prompt_tokens - 1)
            if first < end:
                out.append((seq, first + 1, np.arange(offset + first - start, offset + end - start, dtype=np.int64)))
                planned[id(lps)] = end + 1
        offset += n
    return out


def activation_peak(held_before: int, held_after: int, scratch_bytes: int) -> int:
    """Bytes a GPU profile pass needed beyond its scratch KV cache, at least 0: what the
    memory pool held after the pass (``held_after``) less what it held before and less the
    scratch cache's own bytes (the target's or the draft's, in the KV dtype it was made with)."""
    return max(0, int(held_after) - int(held_before) - int(scratch_bytes))


def gpu_kv_pool_blocks(total_bytes: int, free_bytes: int, activation_peak_bytes: int, bytes_per_block: int,
                       draft_bytes_per_block: int, utilization: float) -> int:
    """KV blocks that fit in ``utilization`` of a GPU (vLLM's ``determine_num_available_blocks``).

    ``budget = total * utilization - (total - free) - activation_peak``: ``total - free`` is
    what is held when memory is read (the target's and the draft's weights, both loaded
    by then), ``activation_peak`` the larger of the target's and the draft's profile passes
    (:func:`activation_peak`); one block costs the target's bytes plus the draft's (the
    draft's pool has as many blocks, :mod:`refengine.spec_decode.draft_model`).

    Returns:
        ``budget // (bytes_per_block + draft_bytes_per_block)``.
    Raises:
        ValueError: not one block fits, naming ``gpu_memory_utilization`` and what is held.
    """
    per_block = int(bytes_per_block) + int(draft_bytes_per_block)
    held = total_bytes - free_bytes
    budget = total_bytes * utilization - held - max(0, activation_peak_bytes)
    if budget < per_block:
        raise ValueError(f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization} "
                         f"(weights and activations take {(held + max(0, activation_peak_bytes)) / 2**30:.2f} GiB "
                         f"of {total_bytes / 2**30:.2f} GiB; one block takes {per_block} bytes for this model"
                         + (" and its draft model)" if draft_bytes_per_block else ")"))
    return int(budget // per_block)


class ModelRunner:
    """Holds the model and its KV cache; runs one flat batch per call."""

    def __init__(self, model, kv_cache: KVCache, *, capture_decode: bool = True, max_model_len: int | None = None,
                 lora_manager=None):
        self.model = model
        #: The LoRA adapters (:class:`refengine.lora.LoRAManager`), None without ``enable_lora``.
        self.lora_manager = lora_manager
        self.kv_cache = kv_cache
        self.xp = model.xp
        self.block_size = kv_cache.block_size
        #: Batch-1 decode steps replayed from a recording of the model's own forward
        #: (:meth:`LayerOps.capture_decode`, :mod:`refengine.cpu.capture`) up to ``max_model_len``
        #: tokens, None where the layer ops record nothing or ``capture_decode`` is off (every step
        #: runs the forward).
        self.decode_capture = None
        if capture_decode:
            self.decode_capture = model.ops.capture_decode(model, kv_cache, max_model_len)

    def execute(self, scheduled: list[tuple[Sequence, int]], all_logits: bool = False,
                spec_tokens: dict[Sequence, list[int]] | None = None, prompt_logits: list | None = None):
        """Run the model over the scheduled chunks (their K/V land in the cache).

        Args:
            scheduled: ``(sequence, num_new_tokens)`` pairs whose blocks are allocated.
            all_logits: return logits for every row, not only the sampling ones.
            spec_tokens: proposed tokens per speculating sequence (see :func:`build_batch`).
            prompt_logits: a list to receive the logits of the prompt rows that sequences
                with ``prompt_logprobs`` want (:func:`prompt_logprob_rows`): appended as
                ``(sequence, first entry index, logits [r, vocab] float32)``. The LM head
                runs on those rows and the sampling rows only. None: no prompt rows.
        Returns:
            ``(logits, sample_seqs)``: ``logits [S, vocab]`` float32 NumPy for the sequences
            that sample this step, ``1 + k`` rows for one with ``k`` proposals (or
            ``[T, vocab]`` for every row when ``all_logits``).
        """
        ids, positions, meta, sample_rows, sample_seqs = build_batch(scheduled, self.block_size, spec_tokens)
        rows = np.arange(ids.shape[0]) if all_logits else sample_rows
        extra = prompt_logprob_rows(scheduled) if prompt_logits is not None and not all_logits else []
        if extra:  # the prompt rows after the sampling ones, split off below
            rows = np.concatenate([rows, *(r for _, _, r in extra)])
        lora = None
        if self.lora_manager is not None:
            lora = LoRABatch.from_sequences(scheduled, self.lora_manager.adapter)
        logits = self.run_model(ids, positions, meta, rows, lora)
        if extra:
            at = len(sample_rows)
            for seq, first, r in extra:
                prompt_logits.append((seq, first, logits[at:at + len(r)]))
                at += len(r)
            logits = logits[:len(sample_rows)]
        return logits, sample_seqs

    def run_model(self, ids: np.ndarray, positions: np.ndarray, meta, rows: np.ndarray,
                  lora: LoRABatch | None = None) -> np.ndarray:
        """One forward pass over a flat batch (:func:`build_batch`'s arrays, all host NumPy):
        ``logits [len(rows), vocab]`` float32 NumPy of the batch rows ``rows``. ``lora``: the
        rows grouped by LoRA adapter (None: none has one). A tensor-parallel worker
        (:mod:`refengine.core.executor`) runs the same call."""
        xp = self.xp
        self.model.ops.begin_step(self.model, ids.shape[0], int(np.diff(meta.query_start_loc).max(initial=0)))
        capture = self.decode_capture
        if (capture is not None and lora is None and ids.shape[0] == 1 and rows.shape == (1,) and rows[0] == 0
                and meta.seq_lens[0] <= capture.max_model_len):  # a recording holds the base products only
            return capture(ids, positions, meta)
        self.model.lora_batch = lora
        try:
            logits = self.model.forward(xp.asarray(ids), positions, self.kv_cache, meta, xp.asarray(rows))
        finally:
            self.model.lora_batch = None
        return logits if xp is np else xp.asnumpy(logits)
