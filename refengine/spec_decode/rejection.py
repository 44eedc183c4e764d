"""Verification of proposed tokens: speculative (rejection) sampling, and matching.

The target model scored ``k`` proposed tokens ``d_1 .. d_k`` in one pass, which gives
``k + 1`` distributions: ``p_j`` (``j = 0 .. k``) for the token after ``d_1 .. d_j``. The
proposer drew ``d_{j+1}`` from ``q_j``.

**Deterministic proposals** (n-gram lookup, or any proposer for a greedy request):
:func:`verify_tokens`. Let ``t_j`` be the token the plain sampler would emit from ``p_j``:
its argmax (greedy), or its inverse CDF at the position's own uniform ``u_j``
(:class:`refengine.sampler.TokenUniforms`, purpose SAMPLE). Accept ``d_{j+1}`` while it
equals ``t_j``; at the first mismatch emit ``t_j`` and stop; after ``k`` acceptances emit
``t_k``. Every emitted token is the plain sampler's ``t_j``, so the output is token for token
the output without speculation, however many proposals a step verified. For sampled
requests this *is* speculative sampling with a one-hot ``q = 1_d``: ``P(t_j = d) = p_j(d) =
min(1, p_j(d)/q(d))``, and given ``t_j != d``, ``t_j`` follows ``p_j`` with ``d`` removed and
renormalised, which is the residual ``max(0, p_j - q) / Z`` (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", §2.3 and Appendix A.1).

**Drawn proposals** (a draft model, sampled requests): :func:`rejection_sample`. For
``j = 0, 1, ...``: accept ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d))``; on the first
rejection emit one token from the residual ``max(0, p_j - q_j)`` (normalised) and stop; if
all ``k`` are accepted the caller emits the bonus ``t_k`` as above. Every emitted token is
distributed as if drawn from the target alone (Leviathan et al. 2023 §2.3 and Appendix
A.1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", Algorithm 2). The uniforms are keyed by output position and purpose (the draft's
draw, the accept test, the residual draw), so no draw shifts with the number of proposals;
what a draft model's output does depend on is *whether* a position was verified against a
proposal (a verified position emits the accepted proposal or a residual draw, an unverified
one ``t_j``), and the scheduler grants proposals as the step's token budget and
``disable_by_batch_size`` allow. A seeded request with a draft model is therefore
reproducible under the same load, not across loads; with n-gram proposals, across any.
"""

from __future__ import annotations

import numpy as np


@np.errstate(all="ignore")
def probs_from_logits(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 of ``[b, V]`` processed logits (-inf -> probability 0).

    A row that is -inf everywhere gets all its mass on token 0, so it stays a distribution
    (a draft's proposal from it is then judged by the target's row; the verifier never
    reads a target row like it: ``SpecDecoder._verify`` stops before it).
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


def draw(probs: np.ndarray, u: float) -> int:
    """The token of ``probs [V]`` (non-negative, not necessarily normalised, some mass) at
    uniform ``u`` in ``[0, 1)`` by inverse-CDF sampling; never a zero-mass token."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if i >= probs.shape[0] or probs[i] <= 0:  # u * total rounded up to the total
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


def rejection_sample(target_probs: np.ndarray, draft_tokens, draft_probs: np.ndarray | None,
                     accept_u, residual_u) -> tuple[list[int], int]:
    """Verify ``k`` drawn proposals against the target's distributions (module docstring).

    Args:
        target_probs: ``[k, V]`` float, row ``j`` is ``p_j`` (each row sums to 1); the
            distribution after all ``k`` proposals is the caller's (the bonus token).
        draft_tokens: ``k`` proposed token ids.
        draft_probs: ``[k, V]`` float, row ``j`` is ``q_j`` the proposal ``d_{j+1}`` was drawn
            from; None for a one-hot ``q_j`` at ``d_{j+1}`` (prefer :func:`verify_tokens`
            there: the same distribution, and the plain sampler's very tokens).
        accept_u, residual_u: ``k`` uniforms in ``[0, 1)`` each: the accept test and the
            residual draw at each of the ``k`` positions.
    Returns:
        ``(tokens, num_accepted)``: the accepted proposals, then the residual token at the
        first rejection (``num_accepted + 1`` tokens); all ``k`` proposals when every one is
        accepted (the caller appends the bonus token).
    Raises:
        ValueError: shapes that disagree.
    """
    k = len(draft_tokens)
    if target_probs.ndim != 2 or target_probs.shape[0] != k or len(accept_u) != k or len(residual_u) != k or (
            draft_probs is not None and draft_probs.shape != target_probs.shape):
        raise ValueError(f"target_probs and draft_probs must be [k, V] and accept_u, residual_u k long for k={k} "
                         f"proposals, got {target_probs.shape}, {None if draft_probs is None else draft_probs.shape}, "
                         f"{len(accept_u)} and {len(residual_u)}")
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        d = int(d)
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        if accept_u[j] * q_d < p[d]:  # u < p/q, written without dividing by q
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - draft_probs[j], 0.0)
        if not residual.sum() > 0:  # only when p == q, where rejection has probability 0
            residual = p
        out.append(draw(residual, residual_u[j]))
        return out, j
    return out, k


def verify_tokens(target_tokens, draft_tokens) -> tuple[list[int], int]:
    """Verification of deterministic proposals: accept while each equals the target's token.

    Args:
        target_tokens: ``k + 1`` ints, the token the plain sampler emits from each processed
            ``p_j``: its argmax for a greedy request, its inverse CDF at the position's
            uniform for a sampled one (module docstring: this is speculative sampling with a
            one-hot draft distribution).
        draft_tokens: ``k`` proposed ids.
    Returns:
        ``(tokens, num_accepted)``: the accepted proposals then the target's token where the
        first proposal differs (or the bonus token after all ``k``); always
        ``target_tokens[:num_accepted + 1]``.
    """
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        if int(d) != int(target_tokens[j]):
            out.append(int(target_tokens[j]))
            return out, j
        out.append(int(d))
    out.append(int(target_tokens[len(draft_tokens)]))
    return out, len(draft_tokens)
