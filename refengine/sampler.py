"""The sampler: one next token per sequence from the last-position logits.

Pipeline (the order of vLLM's v0 sampler and of Hugging Face's ``generate`` warpers):

    raw logits ──▶ logprobs (log-softmax of the raw logits: vLLM's default "raw_logprobs")
        │
        ├─ structured outputs: tokens the request's grammar does not allow next -> -inf
        │                      (refengine/structured_output.py, llguidance's bitmask)
        ├─ allowed_token_ids: every other token -> -inf
        ├─ bad_words: the last token of a banned word whose other tokens end the output -> -inf
        ├─ min_tokens: EOS / stop_token_ids banned while the output is shorter than min_tokens
        ├─ logit_bias: added to the logits (OpenAI's rule: before any penalty or warper)
        ├─ penalties: repetition (HF rule, prompt + output), then frequency and presence
        │             (OpenAI rule, output only)
        ├─ greedy rows (temperature 0): argmax, ties to the lowest id; no random draw
        └─ sampled rows: temperature → top-k → top-p → min-p → one uniform, keyed on the
                         token's position, inverted through the CDF

Sources: the formulas mirror ``transformers/generation/logits_process.py``
(``RepetitionPenaltyLogitsProcessor``, ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``) and vLLM's penalties
(``vllm/model_executor/layers/utils.py: apply_penalties``). vLLM's v1 sampler applies
min-p before top-k/top-p and treats temperature < 1e-5 as greedy; we follow the HF /
vLLM-v0 order above (so ``transformers``' warpers chained in that order are a golden
reference) and sample at any temperature > 0, however small.

Every step after the sanitising is vectorised over the batch ([B, V] arrays); Python only
loops over rows to gather per-request parameters and to invert each row's CDF.

Randomness is keyed, not streamed (:class:`TokenUniforms`): the uniform behind the token at
output position ``i`` of completion ``index`` of a request seeded ``seed`` is a pure function
of ``(seed, index, i)``. Nothing is consumed, so a seeded request gives the same tokens
whatever its batch companions, its row, a preemption and recompute, a step that failed and
is redone, or how many tokens speculative decoding verified in each step (with n-gram
proposals the tokens are exactly these: refengine/spec_decode/rejection.py).

The masks come first, as vLLM's v1 sampler orders them (``vllm/v1/sample/sampler.py``:
allowed token ids, bad words, min_tokens and logit_bias, then penalties, then the
warpers); nothing after them can lift a -inf. Where the other masks would leave a
grammar's row without any token (min_tokens banning the EOS a complete grammar needs,
allowed_token_ids outside the grammar), the grammar wins: the row keeps the grammar's
mask alone.

Robustness: NaN logits count as -inf, +inf as the largest float32; the most likely token
always survives every filter, so the warpers never leave a row without candidates. A row
that the masks leave -inf everywhere (e.g. a multi-token bad word banning the only allowed
continuation) has nothing to choose: its token is :data:`NO_TOKEN`, never a token drawn
from outside the masks, and the stop checker finishes that sequence with
``finish_reason="error"`` (vLLM's finish reason for a request-level error).
Where such a row can be foreseen from the request alone, :meth:`Sampler.check_sampling_params`
refuses it up front (vLLM's check of ``allowed_token_ids`` against single-token ``bad_words``).

Request ``stop_token_ids`` under a grammar: they end the output only where the grammar may
end, so they are masked while it may not, and allowed (as EOS is) once it may (vLLM's
structured-output manager masks them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence as SequenceT

import numpy as np

from refengine.sampling_params import SamplingParams
from refengine.structured_output import StructuredOutputManager, banned_by_bad_words, bad_words_token_ids

_F32_MAX = np.finfo(np.float32).max

#: The token of a row with no candidate (every logit -inf after the masks): not a token id.
NO_TOKEN = -1


# What a uniform is for: its own stream per purpose, so that the draws of one never shift
# those of another (speculative decoding uses all four; plain sampling SAMPLE only).
SAMPLE = 0  # the target's token at a position (the sampler; n-gram verification; the bonus token)
DRAFT = 1  # a draft model's proposal
ACCEPT = 2  # the accept test of a draft model's proposal
RESIDUAL = 3  # the token drawn from the residual after a draft model's proposal is rejected


class TokenUniforms:
    """The random numbers of one sequence, keyed by output position: a counter-based stream.

    ``uniforms(position, purpose)`` is the first output of Philox4x64-10 (Salmon et al.
    2011, "Parallel Random Numbers: As Easy as 1, 2, 3"; ``numpy.random.Philox``) under the
    128-bit key ``(seed, index)`` at the 256-bit counter ``(position, purpose, 0, 0)`` (NumPy
    increments the counter before a block, so the block is ``(position + 1, purpose, 0, 0)``),
    mapped to a float64 in ``[0, 1)`` as ``Generator.random`` maps it (the top 53 bits).
    Distinct ``(seed, index)`` are distinct cipher keys and distinct ``(position, purpose)``
    distinct counters, so every uniform is independent of every other. Nothing is consumed:
    calling it twice gives the same number (the Philox object kept is scratch space, so one
    instance must not be called from two threads at once; the engine's thread makes a
    sequence's draws).

    Args:
        seed: the request's seed, an int in ``[0, 2**64)`` (an unseeded request draws one at
            random once, when its sequences are made: ``refengine.core.sequence.Sequence``).
        index: which of the request's ``n`` completions (``>= 0``).
    Raises:
        ValueError: ``seed`` or ``index`` out of range.
    """

    __slots__ = ("seed", "index", "_key", "_philox", "_counter", "_state")

    def __init__(self, seed: int, index: int = 0):
        if not 0 <= seed < 2**64 or not 0 <= index < 2**64:
            raise ValueError(f"TokenUniforms needs 0 <= seed < 2**64 and 0 <= index < 2**64, got {seed}, {index}")
        self.seed, self.index = int(seed), int(index)
        self._key = np.array([seed, index], dtype=np.uint64)
        self._philox: np.random.Philox | None = None  # made at the first draw (greedy requests never draw)

    def __call__(self, position: int, purpose: int = SAMPLE) -> float:
        """The uniform in ``[0, 1)`` for output position ``position`` (>= 0) and ``purpose``."""
        if self._philox is None:
            self._philox = np.random.Philox(key=self._key)
            self._counter = np.zeros(4, dtype=np.uint64)
            # buffer_pos 4 (the buffer used up): the next output is a fresh block at the counter
            self._state = {"bit_generator": "Philox", "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4,
                           "has_uint32": 0, "uinteger": 0, "state": {"counter": self._counter, "key": self._key}}
        self._counter[0], self._counter[1] = position, purpose
        self._philox.state = self._state  # copied in: cheaper than a new Philox per draw
        return (int(self._philox.random_raw()) >> 11) * 2.0**-53

    def __repr__(self) -> str:
        return f"TokenUniforms(seed={self.seed}, index={self.index})"


class SequenceLike(Protocol):
    """What the sampler reads from a sequence (``refengine.core.sequence.Sequence`` fits). The
    token it samples sits at output position ``len(output_token_ids)``."""

    sampling_params: SamplingParams
    uniforms: TokenUniforms  # any callable (position, purpose) -> float in [0, 1)
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of ``B`` rows.

    Attributes:
        token_ids: ``[B]`` int64, the chosen token of each row; :data:`NO_TOKEN` for a row
            the masks left without any token.
        logprobs: None when no row asked for logprobs; otherwise a list of length ``B``
            whose entry ``i`` is None (row ``i`` did not ask, or has no token) or a ``{token_id: logprob}``
            dict holding the sampled token first and then the ``params.logprobs`` most
            likely tokens (so ``logprobs`` or ``logprobs + 1`` entries), computed from the
            raw logits.
    """

    token_ids: np.ndarray
    logprobs: list[dict[int, float] | None] | None


# --- the processing steps, each a pure function on a [b, V] float32 array ------------------
# Each runs under np.errstate(all="ignore"): exp underflow, and -inf - -inf in a row that is
# -inf everywhere, are expected and handled, not errors to report.

def sanitize_logits(logits: np.ndarray) -> np.ndarray:
    """NaN -> -inf, +inf -> the largest float32; -inf kept. Returns a new float32 array."""
    x = np.array(logits, dtype=np.float32)  # a copy: the caller's logits stay untouched
    if not np.isfinite(x).all():  # the rare case pays for the slower fix-up
        x = np.nan_to_num(x, nan=-np.inf, posinf=_F32_MAX, neginf=-np.inf)
    return x


@np.errstate(all="ignore")
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``[b, V]`` float32 logits (max subtracted first, so no overflow)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@np.errstate(all="ignore")
def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """The CTRL repetition penalty, as HF's ``RepetitionPenaltyLogitsProcessor``.

    Args:
        logits: ``[b, V]`` float32.
        seen: ``[b, V]`` bool, True for every token in the prompt or the output.
        penalty: ``[b]`` penalties (> 0). A seen token's logit is divided by the penalty
            when it is >= 0 and multiplied by it when negative, so a penalty > 1 always
            makes a seen token less likely. Applied once per token, however often it occurs.

    Returns: a new ``[b, V]`` float32 array.
    """
    p = penalty.astype(np.float32)[:, None]
    penalised = np.where(logits < 0, logits * p, logits / p)
    # a tiny penalty can overflow: keep +-inf out of the later x - max
    penalised = np.clip(penalised, -_F32_MAX, _F32_MAX, where=np.isfinite(logits), out=penalised)
    return np.where(seen, penalised, logits)


@np.errstate(all="ignore")
def apply_presence_frequency_penalties(logits: np.ndarray, counts: np.ndarray,
                                       presence: np.ndarray, frequency: np.ndarray) -> np.ndarray:
    """OpenAI's rule: ``logit -= frequency * count + presence * (count > 0)``.

    Args:
        logits: ``[b, V]`` float32.
        counts: ``[b, V]`` int, how often each token occurs in the *output* (not the prompt).
        presence, frequency: ``[b]`` penalties in [-2, 2].

    Returns: a new ``[b, V]`` float32 array.
    """
    out = logits - frequency.astype(np.float32)[:, None] * counts.astype(np.float32)
    return out - presence.astype(np.float32)[:, None] * (counts > 0)


@np.errstate(all="ignore")
def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Divide each row by its temperature (> 0), as HF's ``TemperatureLogitsWarper``.

    A tiny temperature (1e-6) can push large logits past float32's range; those become the
    largest float32 again instead of +inf, so the later ``x - max`` stays finite.
    """
    scaled = logits / temperature.astype(np.float32)[:, None]
    return np.minimum(scaled, _F32_MAX, out=scaled)  # +inf -> max; no NaN can arise here


@np.errstate(all="ignore")
def apply_top_k_top_p(logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Top-k then top-p (nucleus) filtering, removed tokens set to -inf.

    Args:
        logits: ``[b, V]`` float32.
        top_k: ``[b]`` int; keep the tokens whose logit is >= the k-th largest (so ties
            with the k-th are all kept, exactly as HF's ``TopKLogitsWarper``). ``k <= 0``
            or ``k >= V`` keeps everything.
        top_p: ``[b]`` float in (0, 1]; after top-k, keep the smallest set of most likely
            tokens whose probability sums to >= p: a token survives when the probability
            of the tokens strictly more likely than it is < p (HF's ``TopPLogitsWarper``
            removes a token when the ascending cumulative sum up to it is <= 1 - p, the
            same set). Ties with the last kept token are all kept. ``p >= 1`` keeps all.

    The most likely token always survives: its k-rank is 1 and nothing is more likely.
    Returns a new ``[b, V]`` float32 array.
    """
    _, V = logits.shape
    k = np.where((top_k <= 0) | (top_k > V), V, top_k).astype(np.int64)
    # Only the K = max(k) largest logits of each row can survive: sort just those (a
    # partition is O(V); a full sort and cumsum over V dominate the sampler's time).
    K = int(k.max()) if k.size else V
    top = logits if K == V else np.partition(logits, V - K, axis=-1)[:, V - K:]
    asc = np.sort(top, axis=-1)  # [b, K] ascending (contiguous: fast cumsum)
    kth = np.take_along_axis(asc, (K - k)[:, None], axis=-1)  # [b, 1] the k-th largest
    asc = np.where(asc < kth, -np.inf, asc)
    # Unnormalised probabilities (top = 1), summed in float64. A row -inf everywhere gives
    # NaN here; it keeps one "token" and filters nothing, since all are -inf already.
    weights = np.exp(asc - asc[:, -1:])
    cum = np.cumsum(weights.astype(np.float64), axis=-1)  # (cumsum(dtype=) is slower)
    total = cum[:, -1:]
    mass_above = (total - cum) / total  # probability of the strictly more likely tokens
    p = np.where(top_p >= 1.0, np.inf, top_p)[:, None]
    num_kept = np.maximum((mass_above < p).sum(axis=-1), 1)  # a suffix of the ascending row
    threshold = np.take_along_axis(asc, (K - num_kept)[:, None], axis=-1)  # -inf when top-p keeps all
    return np.where(logits < np.maximum(kth, threshold), np.float32(-np.inf), logits)


@np.errstate(all="ignore")
def apply_min_p(logits: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Min-p filtering, as HF's ``MinPLogitsWarper``: drop tokens with probability below
    ``min_p`` times the top token's probability, i.e. with ``exp(logit - max) < min_p``.

    Args:
        logits: ``[b, V]`` float32.
        min_p: ``[b]`` in [0, 1]; 0 keeps all, 1 keeps only the tokens tied with the top.

    The top token has ``exp(0) = 1 >= min_p``, so it always survives.
    Returns a new ``[b, V]`` float32 array.
    """
    ratio = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.where(ratio < min_p.astype(np.float32)[:, None], np.float32(-np.inf), logits)


@np.errstate(all="ignore")
def sample_rows(logits: np.ndarray, uniforms: SequenceT[float] | np.ndarray) -> np.ndarray:
    """Draw one token per row from ``softmax(logits)`` by inverse-CDF sampling.

    Args:
        logits: ``[b, V]`` float32, filtered (-inf for excluded tokens).
        uniforms: ``[b]`` floats in ``[0, 1)``, row ``i``'s uniform.

    Returns: ``[b]`` int64, row ``i``'s token the first whose CDF exceeds ``uniforms[i]``
    (token ids in increasing order). The chosen token always has a non-zero probability; a
    row that is -inf everywhere gives :data:`NO_TOKEN`.
    """
    out = np.empty(logits.shape[0], dtype=np.int64)
    if logits.shape[0] == 0:
        return out
    row_max = logits.max(axis=-1, keepdims=True)
    ok = np.isfinite(row_max[:, 0])
    weights = np.exp(logits - row_max)  # [b, V] unnormalised probabilities, the top is 1
    for i, u in enumerate(uniforms):
        if not ok[i]:
            out[i] = NO_TOKEN
            continue
        # The CDF over the candidates only (weight > 0), in float64: after top-k/top-p
        # that is a handful of tokens instead of the whole vocabulary.
        cand = np.flatnonzero(weights[i])
        cdf = np.cumsum(weights[i, cand].astype(np.float64))
        # searchsorted(right) returns the first candidate whose CDF exceeds u * total;
        # min() covers u * total rounding up to total.
        j = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), cand.size - 1)
        out[i] = cand[j]
    return out


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """``[b]`` int64, the argmax of each row of ``[b, V]`` processed logits (ties to the
    lowest id); :data:`NO_TOKEN` for a row that is -inf everywhere."""
    out = np.argmax(logits, axis=-1).astype(np.int64)
    if out.size:
        out[~np.isfinite(logits.max(axis=-1))] = NO_TOKEN
    return out


def top_logprobs(logprobs_row: np.ndarray, sampled: int, n: int) -> dict[int, float]:
    """``{sampled: lp, then the n most likely tokens: lp}`` from one ``[V]`` log-softmax row.

    The top n are ordered most likely first, ties to the lower id (ties across the
    partition boundary of ``np.argpartition`` may pick either token).
    """
    result = {int(sampled): float(logprobs_row[sampled])}
    n = min(n, logprobs_row.shape[0])
    if n > 0:
        cand = np.argpartition(-logprobs_row, n - 1)[:n]
        cand = cand[np.lexsort((cand, -logprobs_row[cand]))]
        for t in cand:
            result.setdefault(int(t), float(logprobs_row[t]))
    return result


#: Bytes of float32 logits :func:`prompt_logprobs_rows` processes at once: its scratch (the
#: block's copy, log-softmax temporaries and top-k indices) is a few times this.
PROMPT_LOGPROBS_BLOCK_BYTES = 4 * 2**20


def prompt_logprobs_rows(logits: np.ndarray, token_ids: np.ndarray, k: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's log-probability and rank of one token, and its top ``k``, from raw logits.

    Args:
        logits: ``[r, V]`` float32, raw (NaN counts as -inf); not modified.
        token_ids: ``[r]`` ints in ``[0, V)``, row ``i``'s token.
        k: how many most likely tokens per row (``0 <= k``; more than ``V`` means ``V``).
    Returns:
        ``(token_logprobs [r] float32, ranks [r] int64, top_ids [r, k] int64,
        top_logprobs [r, k] float32)``: float32 log-softmax values; rank = how many tokens
        are strictly more likely, plus one; the top ``k`` most likely first, ties to the
        lower id (across ``np.argpartition``'s boundary either may be kept).

    The rows go through in blocks of :data:`PROMPT_LOGPROBS_BLOCK_BYTES`: the memory on
    top of ``logits`` is a few blocks and ``O(r * k)`` for the results, not several
    ``[r, V]`` arrays (a 2,048-row prefill chunk of a 262k vocabulary is 2 GiB per
    array). Each row's values are those of the whole array at once: every step is per row.
    """
    r, V = logits.shape
    k = min(int(k), V)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    token_lp = np.empty(r, dtype=np.float32)
    ranks = np.empty(r, dtype=np.int64)
    top_ids = np.empty((r, k), dtype=np.int64)
    top_lp = np.empty((r, k), dtype=np.float32)
    step = max(1, PROMPT_LOGPROBS_BLOCK_BYTES // (4 * max(V, 1)))
    for start in range(0, r, step):
        rows = slice(start, min(start + step, r))
        lp = log_softmax(sanitize_logits(logits[rows]))
        at = np.arange(lp.shape[0])
        token_lp[rows] = lp[at, token_ids[rows]]
        ranks[rows] = (lp > token_lp[rows, None]).sum(axis=-1) + 1
        if k > 0:
            top = np.argpartition(-lp, k - 1, axis=-1)[:, :k]
            order = np.lexsort((top, -np.take_along_axis(lp, top, axis=-1)), axis=-1)  # most likely first
            top_ids[rows] = np.take_along_axis(top, order, axis=-1)
            top_lp[rows] = np.take_along_axis(lp, top_ids[rows], axis=-1)
    return token_lp, ranks, top_ids, top_lp


def position_uniform(seq: SequenceLike) -> float:
    """The uniform the sampler inverts for ``seq``'s next token (output position
    ``len(seq.output_token_ids)``, purpose SAMPLE)."""
    return seq.uniforms(len(seq.output_token_ids), SAMPLE)


# --- the sampler -------------------------------------------------------------------------

class Sampler:
    """Turns the last-position logits of a batch into one token per sequence.

    Args:
        eos_token_id: the model's EOS id(s); banned (with each request's
            ``stop_token_ids``) while a request has fewer than ``min_tokens`` outputs,
            unless it sets ``ignore_eos`` (then only the stop ids are banned). None: only
            ``stop_token_ids`` are banned.
        tokenizer: the engine's tokenizer, for ``bad_words`` and structured outputs (None:
            requests with them are refused by :meth:`check_sampling_params`).
        vocab_size: the logits' width (default: the tokenizer's size).

    Call: ``sampler(logits, seqs) -> SamplerOutput``
        logits: ``[B, V]`` float (cast to float32), row ``i`` belongs to ``seqs[i]``; not
            modified.
        seqs: ``B`` sequence-like objects (``sampling_params``, ``uniforms``,
            ``prompt_token_ids``, ``output_token_ids``); a sampled row's uniform is
            ``uniforms(len(output_token_ids), SAMPLE)``. Token ids outside ``[0, V)`` in
            the history are ignored by the penalties.

    Never raises on odd values (NaN/inf logits, top_k > V, top_p near 0 or 1, min_p 1,
    tiny temperature); SamplingParams has already rejected out-of-range settings. A row
    the masks leave without any token gets :data:`NO_TOKEN`.
    """

    def __init__(self, eos_token_id: int | Iterable[int] | None = None, tokenizer=None,
                 vocab_size: int | None = None):
        if eos_token_id is None:
            self.eos_token_ids: list[int] = []
        elif isinstance(eos_token_id, (int, np.integer)):
            self.eos_token_ids = [int(eos_token_id)]
        else:
            self.eos_token_ids = [int(t) for t in eos_token_id]
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else (
            tokenizer.vocab_size if tokenizer is not None else None)
        # llguidance's side: its tokenizer is built by the first structured request, or before
        # serving by StructuredOutputManager.prepare (the server's start-up)
        self.structured = (StructuredOutputManager(tokenizer, self.vocab_size, self.eos_token_ids)
                           if tokenizer is not None else None)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Whether this sampler can apply ``params`` (the engine's ``check_sampling_params``).

        Builds what the steps use, once per request, and keeps it on ``params``: the
        bad-words token sequences, the allowed_token_ids mask, the logit_bias arrays, the
        grammar's first matcher. Checking the same ``params`` again costs O(1) per field
        (the engine checks a request when it is added too, on the server's event loop).

        Raises:
            ValueError: logit_bias or allowed_token_ids naming an id outside the vocabulary
                ``[0, vocab_size)``, or more allowed_token_ids than the vocabulary has;
                bad_words or structured outputs without a tokenizer; a grammar llguidance
                refuses with this tokenizer (its message); masks that leave the first token
                nothing (:meth:`_check_first_token_allowed`).
        """
        V = self.vocab_size
        if V is not None:  # checked unless built for this vocabulary already
            bias, ids, mask = params._logit_bias_arrays, params.allowed_token_ids, params._disallowed_token_mask
            if params.logit_bias and (bias is None or bias[0] != V):
                _check_in_vocabulary("logit_bias", params.logit_bias, list(params.logit_bias), V)
                self._logit_bias(params, V)
            if ids is not None and (mask is None or mask.shape[0] != V):
                if len(ids) > V:
                    raise ValueError(f"SamplingParams.allowed_token_ids=<{len(ids)} ids> is invalid: at most {V} ids "
                                     "(the vocabulary's size)")
                _check_in_vocabulary("allowed_token_ids", ids, ids, V)
                self._disallowed(params, V)
        for name in ("bad_words", "structured_outputs"):
            if getattr(params, name) is not None and self.tokenizer is None:
                raise ValueError(f"SamplingParams.{name}={getattr(params, name)!r} is invalid: it needs a "
                                 "tokenizer and this model has none (no tokenizer.json)")
        if params.bad_words is not None:
            self._bad_words(params)
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)
        self._check_first_token_allowed(params)

    def _check_first_token_allowed(self, params: SamplingParams) -> None:
        """Refuse ``allowed_token_ids`` that the masks of the first step all ban: the
        single-token ``bad_words`` (banned at every step) and, while ``min_tokens`` is not
        reached, ``stop_token_ids`` and EOS (unless ``ignore_eos``). vLLM refuses the
        ``bad_words`` case (``SamplingParams.update_from_tokenizer``). With a grammar the
        grammar's own mask wins over these, so such a request still has tokens.

        Raises:
            ValueError: naming ``allowed_token_ids`` and the fields that ban each id.
        """
        if params.allowed_token_ids is None or params.structured_outputs is not None:
            return
        bans: dict[int, str] = {}
        if params.min_tokens > 0:
            for t in params.stop_token_ids:
                bans.setdefault(t, "stop_token_ids (min_tokens)")
            if not params.ignore_eos:
                for t in self.eos_token_ids:
                    bans.setdefault(t, "EOS (min_tokens)")
        if params.bad_words is not None and self.tokenizer is not None:
            for ids in self._bad_words(params):
                if len(ids) == 1:
                    bans[ids[0]] = "bad_words"
        allowed = set(params.allowed_token_ids)
        if allowed <= set(bans):
            shown = params.allowed_token_ids
            shown = shown if len(repr(shown)) <= 200 else f"<{len(shown)} entries>"
            by = sorted({bans[t] for t in allowed})
            raise ValueError(f"SamplingParams.allowed_token_ids={shown!r} is invalid: {' and '.join(by)} ban every "
                             "allowed token, so no token could be generated")

    def _bad_words(self, params: SamplingParams) -> list[list[int]]:
        if params._bad_words_token_ids is None:
            params._bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        return params._bad_words_token_ids

    @staticmethod
    def _disallowed(params: SamplingParams, V: int) -> np.ndarray:
        """``params``' :func:`disallowed_token_mask` for logits ``V`` wide (built once)."""
        mask = params._disallowed_token_mask
        if mask is None or mask.shape[0] != V:
            mask = params._disallowed_token_mask = disallowed_token_mask(params.allowed_token_ids, V)
        return mask

    @staticmethod
    def _logit_bias(params: SamplingParams, V: int) -> tuple[np.ndarray, np.ndarray]:
        """``params``' logit_bias as ``(ids, biases)`` arrays, ids below ``V`` (built once)."""
        cached = params._logit_bias_arrays
        if cached is None or cached[0] != V:
            kept = [(t, b) for t, b in params.logit_bias.items() if t < V]
            cached = params._logit_bias_arrays = (V, np.array([t for t, _ in kept], dtype=np.int64),
                                                  np.array([b for _, b in kept], dtype=np.float32))
        return cached[1], cached[2]

    @np.errstate(all="ignore")
    def __call__(self, logits: np.ndarray, seqs: SequenceT[SequenceLike]) -> SamplerOutput:
        params = [s.sampling_params for s in seqs]
        x = self._check(logits, seqs)
        # Raw logprobs: from the model's distribution, before any processing.
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp = log_softmax(x[want_lp]) if want_lp else None

        x = self._process(x, seqs, seqs)
        token_ids = np.empty(len(seqs), dtype=np.int64)
        greedy = np.array([p.greedy for p in params], dtype=bool)
        if greedy.any():
            token_ids[greedy] = greedy_tokens(x[greedy])
        rows = np.flatnonzero(~greedy)
        if rows.size:
            token_ids[rows] = sample_rows(x[rows], [position_uniform(seqs[i]) for i in rows])

        logprobs = None
        if want_lp:
            logprobs = [None] * len(seqs)
            for j, i in enumerate(want_lp):
                if token_ids[i] != NO_TOKEN:
                    logprobs[i] = top_logprobs(raw_lp[j], int(token_ids[i]), params[i].logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @np.errstate(all="ignore")
    def process_logits(self, logits: np.ndarray, seqs: SequenceT[SequenceLike],
                       owners: SequenceT | None = None) -> np.ndarray:
        """The ``[B, V]`` float32 logits each row's token is taken from: the masks
        (grammar, allowed_token_ids, bad_words, min_tokens), logit_bias and penalties for
        every row; then, for rows with temperature > 0, temperature, top-k, top-p and
        min-p (removed tokens are -inf). Greedy rows take the argmax of theirs.

        ``owners``: per row, the sequence whose grammar matcher masks it (speculative
        verification passes views of a sequence ``j`` proposals ahead, whose histories
        the matcher follows); None (the default): no grammar mask. ``__call__`` uses
        each row's own sequence. Draws nothing."""
        return self._process(self._check(logits, seqs), seqs, owners)

    @staticmethod
    def _check(logits: np.ndarray, seqs) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [B, V] with B == len(seqs) == {len(seqs)}, got shape {logits.shape}")
        return sanitize_logits(logits)

    def _process(self, x: np.ndarray, seqs, owners=None) -> np.ndarray:
        grammar_rows, grammar_only = self._apply_grammar(x, seqs, owners)
        x = self._apply_token_masks(x, seqs)
        x = self._ban_stop_tokens_before_min_tokens(x, seqs)
        x = self._apply_logit_bias(x, seqs)
        if grammar_rows:  # the grammar wins over masks that would leave its row empty
            empty = ~np.isfinite(x[grammar_rows].max(axis=-1))
            for j in np.flatnonzero(empty):
                x[grammar_rows[j]] = grammar_only[j]
        x = self._apply_penalties(x, seqs)
        rows = np.array([i for i, s in enumerate(seqs) if not s.sampling_params.greedy], dtype=np.int64)
        if rows.size:
            x[rows] = self._warp(x[rows], [seqs[i].sampling_params for i in rows])
        return x

    # --- steps ---------------------------------------------------------------------------
    def _apply_grammar(self, x: np.ndarray, seqs, owners) -> tuple[list[int], np.ndarray | None]:
        """Structured outputs: -inf where each row's grammar refuses the token (in place).
        Returns the rows masked and a copy of them as masked (for the fallback above)."""
        if owners is None or self.structured is None:
            return [], None
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.structured_outputs is not None
                and owners[i] is not None]
        if not rows:
            return [], None
        allowed = self.structured.allowed([owners[i] for i in rows],
                                          [seqs[i].sampling_params.structured_outputs for i in rows],
                                          [seqs[i].output_token_ids for i in rows])
        V = x.shape[1]
        if allowed.shape[1] < V:  # logits wider than the grammar's vocabulary: the rest refused
            allowed = np.pad(allowed, ((0, 0), (0, V - allowed.shape[1])))
        allowed = allowed[:, :V]
        # A request's stop_token_ids end it only where its grammar may end (where the grammar
        # allows EOS): masked before, allowed like EOS then. A stop id the grammar also takes
        # mid-value (the id of '"' inside a JSON string) would otherwise end the output there.
        eos = [t for t in self.eos_token_ids if t < V]
        for j, i in enumerate(rows):
            stop = [t for t in seqs[i].sampling_params.stop_token_ids if t < V]
            if stop:
                allowed[j, stop] = bool(eos) and bool(allowed[j, eos].any())
        masked = np.where(allowed, x[rows], np.float32(-np.inf))
        x[rows] = masked
        return rows, masked

    def _apply_token_masks(self, x: np.ndarray, seqs) -> np.ndarray:
        """allowed_token_ids (others -inf, the request's mask built once) and bad_words (in place)."""
        V = x.shape[1]
        for i, s in enumerate(seqs):
            p = s.sampling_params
            if p.allowed_token_ids is not None:
                x[i, self._disallowed(p, V)] = -np.inf
            if p.bad_words is not None and self.tokenizer is not None:
                banned = [t for t in banned_by_bad_words(self._bad_words(p), s.output_token_ids) if t < V]
                x[i, banned] = -np.inf
        return x

    def _apply_logit_bias(self, x: np.ndarray, seqs) -> np.ndarray:
        """OpenAI's logit_bias: ``logit += bias`` for each listed token (in place)."""
        V = x.shape[1]
        for i, s in enumerate(seqs):
            if s.sampling_params.logit_bias:
                ids, biases = self._logit_bias(s.sampling_params, V)
                x[i, ids] += biases
        return x

    def _ban_stop_tokens_before_min_tokens(self, x: np.ndarray, seqs) -> np.ndarray:
        V = x.shape[1]
        for i, s in enumerate(seqs):
            p = s.sampling_params
            if len(s.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                banned = [t for t in banned if 0 <= t < V]
                x[i, banned] = -np.inf
        return x

    @staticmethod
    def _apply_penalties(x: np.ndarray, seqs) -> np.ndarray:
        V = x.shape[1]
        params = [s.sampling_params for s in seqs]

        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            seen = _token_counts([seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rep_rows], V) > 0
            penalty = np.array([params[i].repetition_penalty for i in rep_rows])
            x[rep_rows] = apply_repetition_penalty(x[rep_rows], seen, penalty)

        pf_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if pf_rows:
            counts = _token_counts([seqs[i].output_token_ids for i in pf_rows], V)
            presence = np.array([params[i].presence_penalty for i in pf_rows])
            frequency = np.array([params[i].frequency_penalty for i in pf_rows])
            x[pf_rows] = apply_presence_frequency_penalties(x[pf_rows], counts, presence, frequency)
        return x

    @staticmethod
    def _warp(x: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
        """Temperature, top-k, top-p, min-p on the rows that sample (temperature > 0)."""
        x = apply_temperature(x, np.array([p.temperature for p in params]))
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        has_k = (top_k > 0) & (top_k < x.shape[1])
        # Rows with a top-k sort only their k largest logits, so they go in their own call.
        for rows in (np.flatnonzero(has_k), np.flatnonzero(~has_k & (top_p < 1.0))):
            if rows.size:
                x[rows] = apply_top_k_top_p(x[rows], top_k[rows], top_p[rows])
        min_p = np.array([p.min_p for p in params], dtype=np.float64)
        mp_rows = np.flatnonzero(min_p > 0.0)
        if mp_rows.size:
            x[mp_rows] = apply_min_p(x[mp_rows], min_p[mp_rows])
        return x


def disallowed_token_mask(allowed_token_ids: list[int], vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` bool, True for every token ``allowed_token_ids`` leaves out (ids at or
    past ``vocab_size`` are ignored): what a step sets to -inf."""
    mask = np.ones(vocab_size, dtype=bool)
    mask[np.array([t for t in allowed_token_ids if t < vocab_size], dtype=np.int64)] = False
    return mask


def _check_in_vocabulary(name: str, value, ids, vocab_size: int) -> None:
    """Raise the error of the field ``name`` (its ``value``) when one of ``ids`` is not below
    ``vocab_size`` (``max`` first: a list of any length costs one pass in C)."""
    if ids and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        shown = repr(value) if len(value) <= 20 else f"<{len(value)} entries>"
        raise ValueError(f"SamplingParams.{name}={shown} is invalid: token id {bad} is "
                         f"outside the vocabulary [0, {vocab_size})")


def _token_counts(histories: list[list[int]], vocab_size: int) -> np.ndarray:
    """``[len(histories), vocab_size]`` int64 occurrence counts, one bincount for the batch."""
    rows = np.concatenate([np.full(len(h), r, dtype=np.int64) for r, h in enumerate(histories)])
    toks = np.concatenate([np.asarray(h, dtype=np.int64) for h in histories])
    keep = (toks >= 0) & (toks < vocab_size)
    flat = rows[keep] * vocab_size + toks[keep]
    return np.bincount(flat, minlength=len(histories) * vocab_size).reshape(len(histories), vocab_size)
