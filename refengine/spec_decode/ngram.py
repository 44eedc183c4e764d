"""N-gram proposals ("prompt lookup decoding"): guess that the text repeats itself.

For a sequence ``x_0 .. x_{L-1}`` (prompt and output together) and ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``: find the most recent earlier
occurrence of the last ``n`` tokens, ``x[i:i+n] == x[L-n:L]`` with ``i < L - n``, and
propose the (up to ``k``) tokens that followed it, ``x[i+n : i+n+k]``. The first ``n`` that
matches wins; no match, no proposal. The proposal is deterministic, so for the rejection
sampler the draft distribution is one-hot at each proposed token.

Source: Saxena 2023, "Prompt Lookup Decoding" (github.com/apoorvumang/prompt-lookup-decoding);
vLLM's ``NgramProposer`` uses the same idea.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: np.ndarray | list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the last n-gram.

    Args:
        token_ids: ``[L]`` int, the whole sequence (prompt then output).
        min_n, max_n: n-gram sizes to try, longest first (``1 <= min_n <= max_n``).
        k: most tokens to propose (``>= 0``).
    Returns:
        Between 0 and ``k`` token ids (fewer than ``k`` when the match is near the end).
    """
    x = np.asarray(token_ids, dtype=np.int64)
    L = x.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows[i] = x[i:i+n] for every start i < L - n (an occurrence that some token follows)
        windows = sliding_window_view(x[:L - 1], n)
        hits = np.flatnonzero((windows == x[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return x[start:start + k].tolist()
    return []
