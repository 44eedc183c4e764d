"""Perplexity of a model over a text, and how far a model's predictions are from a baseline's.

The method is llama.cpp's ``perplexity`` tool (``examples/perplexity/perplexity.cpp``,
``perplexity()`` and ``kl_divergence()``), written anew:

1. The text is tokenized once, with the special tokens the tokenizer adds (a BOS for
   Llama, none for SmolLM2).
2. The token ids are cut into consecutive, non-overlapping **windows** of ``ctx`` tokens;
   a tail shorter than a window is dropped. If the model's tokenizer adds a BOS, the first
   token of every window is replaced by BOS (as llama.cpp does; the replaced token is
   never scored).
3. Each window runs through the engine's own prefill (:meth:`LLMEngine.prompt_logits`:
   the model forward over the paged KV cache, in chunks of ``max_num_batched_tokens``,
   its KV blocks freed afterwards).
4. Only the **second half** is scored, so every scored token has at least ``ctx // 2``
   tokens of context: with ``first = ctx // 2``, the logits at positions ``first`` ..
   ``ctx - 2`` predict the tokens at ``first + 1`` .. ``ctx - 1``. That is
   ``ctx - 1 - ctx // 2`` tokens per window (255 at ``ctx=512``).
5. ``NLL`` of a token is ``-log softmax(logits)[token]`` in nats (log-softmax in float64);
   ``PPL = exp(mean NLL)`` over every scored token of every window.

Against a baseline (:func:`compare`), both engines run the same windows, one window at a
time, and per scored position:

- ``KLD = KL(baseline || model) = sum_v p_base(v) * (log p_base(v) - log p_model(v))``, nats
  (exact over the whole vocabulary, in float64; llama.cpp drops ``p_base < e^-16`` from
  the sum because it stores the baseline's log-probabilities in 16 bits);
- whether the most likely token (argmax, first index on ties) is the same.

Nothing of size ``vocab`` is kept past its window: the statistics are gathered online
(one float per scored position is kept, for the percentiles).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

#: rows of a window whose log-softmax is taken at once (caps the float64 scratch at
#: ``ROW_BLOCK * vocab * 8`` bytes per engine)
ROW_BLOCK = 128


# --- text -> token ids -> windows ------------------------------------------------------------

def load_text(path: str | os.PathLike | None = None) -> str:
    """The text to score: the file at ``path`` (UTF-8), or the corpus shipped with the
    benchmarks (``refengine/bench/data/*.txt``, joined as ``refengine bench`` joins them).

    Raises:
        FileNotFoundError: no such file (or no corpus: a broken install).
        ValueError: the file is not valid UTF-8.
    """
    if path is None:
        from refengine.bench.workload import load_corpus

        return load_corpus()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: byte {e.start} ({e.object[e.start:e.start + 1]!r}) "
                         f"cannot be decoded") from None


def tokenize(engine, text: str) -> list[int]:
    """``text`` as the model's token ids, with the special tokens its tokenizer adds
    (llama.cpp tokenizes with ``add_special=true`` too).

    Args:
        engine: an ``LLMEngine`` or an ``LLM``.
    Raises:
        ValueError: the model has no tokenizer.
    """
    engine = _engine(engine)
    if engine.tokenizer is None:
        raise ValueError(f"{engine.model_dir} has no tokenizer: perplexity over a text needs one "
                         "(pass token ids to perplexity() instead)")
    return engine.tokenizer.encode(text, add_special_tokens=True)


def bos_token_id(engine) -> int | None:
    """The BOS id if the model's tokenizer puts one before a text (llama.cpp's
    ``add_bos``), else None (also without a tokenizer)."""
    tok = _engine(engine).tokenizer
    if tok is None or tok.bos_token_id is None:
        return None
    return tok.bos_token_id if tok.encode("a", add_special_tokens=True)[:1] == [tok.bos_token_id] else None


def windows(token_ids, ctx: int, bos_token_id: int | None = None, max_windows: int | None = None) -> np.ndarray:
    """The consecutive, non-overlapping windows of ``ctx`` tokens (the tail shorter than a
    window is dropped), each starting with ``bos_token_id`` when one is given.

    Returns:
        ``[num_windows, ctx]`` int64 (a copy: ``token_ids`` is not changed).
    Raises:
        ValueError: ``ctx < 3`` (fewer scores nothing), fewer than ``ctx`` tokens, or
            ``max_windows < 1``.
    """
    _check_ctx(ctx)
    if max_windows is not None and (isinstance(max_windows, bool) or max_windows < 1):
        raise ValueError(f"max_windows={max_windows!r} is invalid: must be None or >= 1")
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n = len(ids) // ctx
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of ctx={ctx} tokens: "
                         "give a longer text or a smaller ctx")
    if max_windows is not None:
        n = min(n, max_windows)
    out = ids[:n * ctx].reshape(n, ctx).copy()
    if bos_token_id is not None:
        out[:, 0] = bos_token_id
    return out


# --- results ---------------------------------------------------------------------------------

@dataclass
class PerplexityResult:
    """Perplexity over the scored tokens of every window.

    Attributes:
        ctx: tokens per window.
        nll: ``[num_windows, ctx - 1 - ctx // 2]`` float64, the NLL (nats) of each scored
            token, window by window, in position order.
        seconds: wall time of the run (the model forwards and the scoring).
    """

    ctx: int
    nll: np.ndarray
    seconds: float = 0.0

    @property
    def num_windows(self) -> int:
        return self.nll.shape[0]

    @property
    def num_tokens(self) -> int:
        """Tokens scored."""
        return self.nll.size

    @property
    def mean_nll(self) -> float:
        """Mean NLL per scored token, nats (``log(ppl)``)."""
        return float(self.nll.mean())

    @property
    def ppl(self) -> float:
        """``exp(mean NLL)``."""
        return math.exp(self.mean_nll)

    @property
    def ppl_stderr(self) -> float:
        """Standard error of ``ppl`` (llama.cpp's ``+/-``: ``ppl * stderr(NLL)``, to first
        order); nan with one scored token."""
        n = self.num_tokens
        return self.ppl * float(self.nll.std(ddof=1)) / math.sqrt(n) if n > 1 else float("nan")

    @property
    def window_ppl(self) -> list[float]:
        """PPL of each window alone."""
        return [math.exp(float(m)) for m in self.nll.mean(axis=1)]

    def to_dict(self) -> dict:
        """The figures as plain JSON types (no per-token arrays)."""
        return {"ppl": self.ppl, "ppl_stderr": self.ppl_stderr, "mean_nll": self.mean_nll, "ctx": self.ctx,
                "num_windows": self.num_windows, "num_tokens": self.num_tokens, "seconds": self.seconds,
                "window_ppl": self.window_ppl}


@dataclass
class ComparisonResult:
    """A model against a baseline on the same windows.

    Attributes:
        model, baseline: each one's perplexity.
        kld: ``[num_windows, ctx - 1 - ctx // 2]`` float64, ``KL(baseline || model)`` in
            nats at each scored position.
        same_top: same shape, bool: whether both put the same token first.
    """

    model: PerplexityResult
    baseline: PerplexityResult
    kld: np.ndarray
    same_top: np.ndarray

    @property
    def delta_ppl(self) -> float:
        """``PPL(model) - PPL(baseline)``."""
        return self.model.ppl - self.baseline.ppl

    @property
    def delta_ppl_pct(self) -> float:
        """``delta_ppl`` in percent of the baseline's PPL."""
        return 100.0 * self.delta_ppl / self.baseline.ppl

    @property
    def kld_mean(self) -> float:
        return float(self.kld.mean())

    @property
    def kld_median(self) -> float:
        return float(np.median(self.kld))

    @property
    def kld_p99(self) -> float:
        """99th percentile of the per-position KLD (linear interpolation, NumPy's default)."""
        return float(np.percentile(self.kld, 99))

    @property
    def kld_max(self) -> float:
        return float(self.kld.max())

    @property
    def top1_agreement(self) -> float:
        """Share of scored positions, in [0, 1], where both put the same token first."""
        return float(self.same_top.mean())

    def quarters(self) -> list[tuple[int, int]]:
        """The four position buckets of the scored half: ``(first, last)`` positions in
        the window (0-based, inclusive) of the tokens each quarter scores."""
        first = self.model.ctx // 2 + 1
        cols = np.array_split(np.arange(self.kld.shape[1]), 4)
        return [(first + int(c[0]), first + int(c[-1])) if len(c) else (-1, -1) for c in cols]

    @property
    def kld_by_quarter(self) -> list[float]:
        """Mean KLD in each quarter of the scored half window, nearest the window's start
        first (nan for an empty quarter: fewer than 4 scored positions per window)."""
        return [float(self.kld[:, c].mean()) if len(c) else float("nan")
                for c in np.array_split(np.arange(self.kld.shape[1]), 4)]

    def to_dict(self) -> dict:
        """The figures as plain JSON types (no per-position arrays; nan as None)."""
        def num(x: float):
            return None if math.isnan(x) else x

        return {"model": self.model.to_dict(), "baseline": self.baseline.to_dict(), "delta_ppl": self.delta_ppl,
                "delta_ppl_pct": self.delta_ppl_pct, "kld_mean": self.kld_mean, "kld_median": self.kld_median,
                "kld_p99": self.kld_p99, "kld_max": self.kld_max, "top1_agreement": self.top1_agreement,
                "kld_by_quarter": [{"positions": list(q), "kld_mean": num(m)}
                                   for q, m in zip(self.quarters(), self.kld_by_quarter)]}


# --- running ---------------------------------------------------------------------------------

def perplexity(engine, token_ids, ctx: int = 512, *, max_windows: int | None = None,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of the engine's model over ``token_ids`` (the module docstring's method).

    Args:
        engine: an ``LLMEngine`` or an ``LLM``; it may serve other requests meanwhile (a
            window takes ``ceil(ctx / block_size)`` KV blocks while it runs).
        token_ids: the text's ids (e.g. :func:`tokenize`); a window's first one becomes BOS
            where the model's tokenizer adds one (:func:`bos_token_id`).
        ctx: tokens per window, in ``[3, max_model_len]``.
        max_windows: score only the first this many windows (llama.cpp's ``--chunks``).
        progress: a tqdm bar of windows, with the PPL so far (on a terminal only).
    Returns:
        A :class:`PerplexityResult`.
    Raises:
        ValueError: ``ctx`` out of range, fewer than ``ctx`` tokens, a token id outside the
            vocabulary, or too few free KV blocks for a window now.
    """
    engine = _engine(engine)
    wins = _check(engine, None, token_ids, ctx, max_windows)
    start = time.perf_counter()
    nll = np.empty((len(wins), ctx - 1 - ctx // 2))
    with _bar(len(wins), progress) as bar:
        for i, window in enumerate(wins):
            targets = window[ctx // 2 + 1:]
            logits = _scored_logits(engine, window)
            for rows in _row_blocks(len(targets)):
                logp = log_softmax(logits[rows])
                nll[i, rows] = -logp[np.arange(len(logp)), targets[rows]]
            _advance(bar, nll[:i + 1])
    return PerplexityResult(ctx, nll, time.perf_counter() - start)


def compare(engine, baseline, token_ids, ctx: int = 512, *, max_windows: int | None = None,
            progress: bool = False) -> ComparisonResult:
    """``engine``'s model against ``baseline``'s on the same windows: both perplexities,
    ``KL(baseline || model)`` and top-1 agreement per scored position (module docstring).

    Each window runs through the baseline, then the model; only that window's logits are
    held (``2 * (ctx - ctx // 2) * vocab`` floats).

    Args:
        engine, baseline: ``LLMEngine`` or ``LLM``, over the same vocabulary (e.g. the
            model quantized and in float32). BOS follows ``engine``'s tokenizer.
        token_ids, ctx, max_windows, progress: as :func:`perplexity`; ``ctx`` must fit both.
    Returns:
        A :class:`ComparisonResult`.
    Raises:
        ValueError: as :func:`perplexity`, or vocabularies of different sizes.
    """
    engine, baseline = _engine(engine), _engine(baseline)
    wins = _check(engine, baseline, token_ids, ctx, max_windows)
    n_scored = ctx - 1 - ctx // 2
    nll, nll_base, kld = (np.empty((len(wins), n_scored)) for _ in range(3))
    same_top = np.empty((len(wins), n_scored), dtype=bool)
    seconds = {"model": 0.0, "baseline": 0.0}
    with _bar(len(wins), progress) as bar:
        for i, window in enumerate(wins):
            targets = window[ctx // 2 + 1:]
            t0 = time.perf_counter()
            logits_base = _scored_logits(baseline, window)
            t1 = time.perf_counter()
            logits = _scored_logits(engine, window)
            t2 = time.perf_counter()
            for rows in _row_blocks(n_scored):
                logp_base, logp = log_softmax(logits_base[rows]), log_softmax(logits[rows])
                at = np.arange(len(logp))
                nll_base[i, rows] = -logp_base[at, targets[rows]]
                nll[i, rows] = -logp[at, targets[rows]]
                kld[i, rows] = kl_divergence(logp_base, logp)
                same_top[i, rows] = logp_base.argmax(axis=-1) == logp.argmax(axis=-1)
            t3 = time.perf_counter()
            seconds["baseline"] += t1 - t0 + (t3 - t2) / 2  # the scoring shared half and half
            seconds["model"] += t2 - t1 + (t3 - t2) / 2
            _advance(bar, nll[:i + 1], kld[:i + 1])
    return ComparisonResult(PerplexityResult(ctx, nll, seconds["model"]),
                            PerplexityResult(ctx, nll_base, seconds["baseline"]), kld, same_top)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``[S, vocab]`` logits -> ``[S, vocab]`` float64 log-probabilities (max subtracted
    first, so no overflow)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(logp_base: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """``KL(base || model)`` per row, nats: ``[S, vocab]`` float64 log-probabilities each
    -> ``[S]`` float64, ``>= 0`` up to rounding (tokens with ``p_base == 0`` add nothing)."""
    p_base = np.exp(logp_base)
    terms = p_base * (logp_base - logp)
    return np.where(p_base > 0, terms, 0.0).sum(axis=-1)


# --- helpers ---------------------------------------------------------------------------------

def _engine(engine):
    """An ``LLM``'s engine, or the ``LLMEngine`` itself."""
    return getattr(engine, "llm_engine", engine)


def _check_ctx(ctx) -> None:
    if isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < 3:
        raise ValueError(f"ctx={ctx!r} is invalid: a window must have at least 3 tokens (its second half, "
                         f"positions ctx//2+1 .. ctx-1, is scored)")


def _check(engine, baseline, token_ids, ctx: int, max_windows: int | None) -> np.ndarray:
    """The windows, after every check that needs no forward pass."""
    _check_ctx(ctx)
    engines = [("", engine)] + ([("the baseline's ", baseline)] if baseline is not None else [])
    for which, eng in engines:
        limit = eng.config.max_model_len
        if ctx > limit:
            raise ValueError(f"ctx={ctx} is more than {which}max_model_len={limit}, the most tokens one sequence "
                             "may hold (the model's context, or what the KV pool holds)")
    wins = windows(token_ids, ctx, bos_token_id(engine), max_windows)
    for which, eng in engines:
        vocab = eng.model_config.vocab_size
        bad = wins[(wins < 0) | (wins >= vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside {which or 'the '}vocabulary [0, {vocab})")
    if baseline is not None and baseline.model_config.vocab_size != engine.model_config.vocab_size:
        raise ValueError(f"the baseline's vocabulary has {baseline.model_config.vocab_size} tokens, the model's "
                         f"{engine.model_config.vocab_size}: KL divergence needs the same vocabulary")
    return wins


def _scored_logits(engine, window: np.ndarray) -> np.ndarray:
    """``[ctx - 1 - ctx // 2, vocab]`` float32: the logits at positions ``ctx // 2`` ..
    ``ctx - 2`` of the window, from the engine's prefill."""
    ctx = len(window)
    return engine.prompt_logits(window.tolist(), first_row=ctx // 2)[:-1]  # the last row predicts past the window


def _row_blocks(n: int) -> list[slice]:
    return [slice(i, min(i + ROW_BLOCK, n)) for i in range(0, n, ROW_BLOCK)]


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _bar(total: int, progress: bool):
    """A tqdm bar of windows (shown on a terminal only), or a stand-in."""
    if not progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="perplexity", unit="window", disable=None)  # None: TTY only


def _advance(bar, nll: np.ndarray, kld: np.ndarray | None = None) -> None:
    if bar is None:
        return
    figures = {"ppl": f"{math.exp(float(nll.mean())):.4f}"}
    if kld is not None:
        figures["kld"] = f"{float(kld.mean()):.5f}"
    bar.set_postfix(figures, refresh=False)
    bar.update(1)
