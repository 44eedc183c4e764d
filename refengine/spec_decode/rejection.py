"""Verification of proposed tokens: speculative (rejection) sampling and its greedy case.

The target model scored ``k`` proposed tokens ``d_1 .. d_k`` in one pass, which gives
``k + 1`` distributions: ``p_j`` (``j = 0 .. k``) for the token after ``d_1 .. d_j``. The
proposer drew ``d_{j+1}`` from ``q_j`` (one-hot for a deterministic proposer such as the
n-gram lookup). For ``j = 0, 1, ...``:

* accept ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d))``;
* on the first rejection, emit one token from the residual ``max(0, p_j - q_j)``
  (normalised) and stop;
* if all ``k`` are accepted, emit a bonus token from ``p_k``.

Every emitted token is then distributed exactly as if drawn from the target alone, one
position at a time (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", §2.3 and Appendix A.1; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling", Algorithm 2). Greedy requests accept
while the proposal equals the target's argmax and emit the argmax where they differ, so
the output is exactly greedy decoding's.

Random draws come from the request's own ``numpy.random.Generator``: one per examined
proposal, plus one for the residual or bonus token.
"""

from __future__ import annotations

import numpy as np


@np.errstate(all="ignore")
def probs_from_logits(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 of ``[b, V]`` processed logits (-inf -> probability 0).

    A row that is -inf everywhere gets all its mass on token 0 (as the sampler's argmax).
    """
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    w = np.exp(x - np.where(np.isfinite(top), top, 0.0))
    w = np.nan_to_num(w, nan=0.0)
    total = w.sum(axis=-1, keepdims=True)
    empty = total[:, 0] <= 0
    if empty.any():
        w[empty] = 0.0
        w[empty, 0] = 1.0
        total[empty] = 1.0
    return w / total


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token from ``probs [V]`` (non-negative, not necessarily normalised, some mass)
    by inverse-CDF sampling with exactly one ``generator.random()``; never a zero-mass token."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = generator.random() * cdf[-1]
    i = int(np.searchsorted(cdf, u, side="right"))
    if i >= probs.shape[0] or probs[i] <= 0:  # u * total rounded up to the total
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


def rejection_sample(target_probs: np.ndarray, draft_tokens, draft_probs: np.ndarray | None,
                     generator: np.random.Generator) -> tuple[list[int], int]:
    """Verify ``k`` proposals against the target's distributions (module docstring).

    Args:
        target_probs: ``[k + 1, V]`` float, row ``j`` is ``p_j`` (each row sums to 1).
        draft_tokens: ``k`` proposed token ids.
        draft_probs: ``[k, V]`` float, row ``j`` is ``q_j`` the proposal ``d_{j+1}`` was drawn
            from; None for a deterministic proposer (``q_j`` one-hot at ``d_{j+1}``).
        generator: the request's generator; takes ``a + 1`` draws when ``a`` proposals
            are accepted before a rejection, ``k + 1`` when all are.
    Returns:
        ``(tokens, num_accepted)``: the accepted proposals then one residual or bonus
        token (``num_accepted + 1`` tokens).
    Raises:
        ValueError: shapes that disagree.
    """
    k = len(draft_tokens)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1 or (
            draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1])):
        raise ValueError(f"target_probs must be [k + 1, V] and draft_probs [k, V] for k={k} proposals, got "
                         f"{target_probs.shape} and {None if draft_probs is None else draft_probs.shape}")
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        d = int(d)
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        if generator.random() * q_d < p[d]:  # u < p/q, written without dividing by q
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - draft_probs[j], 0.0)
        if not residual.sum() > 0:  # only when p == q, where rejection has probability 0
            residual = p
        out.append(draw(residual, generator))
        return out, j
    out.append(draw(target_probs[k], generator))
    return out, k


def greedy_verify(target_argmax, draft_tokens) -> tuple[list[int], int]:
    """Greedy verification: accept while each proposal equals the target's argmax.

    Args:
        target_argmax: ``k + 1`` ints, the argmax of each processed ``p_j``.
        draft_tokens: ``k`` proposed ids.
    Returns:
        ``(tokens, num_accepted)``: the accepted proposals then the argmax where the first
        proposal differs (or the bonus argmax after all ``k``).
    """
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        if int(d) != int(target_argmax[j]):
            out.append(int(target_argmax[j]))
            return out, j
        out.append(int(d))
    out.append(int(target_argmax[len(draft_tokens)]))
    return out, len(draft_tokens)
