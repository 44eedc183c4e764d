"""The benchmark workload: prompts cut from real text, with seeded lengths.

Prompts are token windows cut from real text (``refengine/bench/data/*.txt``, see its README):
the text is tokenized once, then each request takes a seeded random window of the
requested length. Requests use ``SamplingParams(temperature=0, ignore_eos=True,
max_tokens=output_len)`` so every request produces exactly ``output_len`` tokens.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from refengine.resources import bench_data_dir


@dataclass
class BenchRequest:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int


def parse_len_range(value: str | int | tuple[int, int]) -> tuple[int, int]:
    """Parse a length flag: ``"128"`` means exactly 128, ``"16-512"`` uniform in [16, 512].

    Raises:
        ValueError: not an int or ``LO-HI`` with ``1 <= LO <= HI`` (0 allowed for outputs is
            not useful for a benchmark, so lengths start at 1).
    """
    if isinstance(value, tuple):
        lo, hi = value
    elif isinstance(value, int):
        lo = hi = value
    else:
        text = value.strip()
        try:
            if "-" in text:
                a, b = text.split("-", 1)
                lo, hi = int(a), int(b)
            else:
                lo = hi = int(text)
        except ValueError:
            raise ValueError(f"length {value!r} is not N or LO-HI (e.g. 128 or 16-512)") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"length range {lo}-{hi} is invalid: need 1 <= LO <= HI")
    return lo, hi


def load_corpus(data_dir: str | os.PathLike | None = None) -> str:
    """All ``*.txt`` files of ``data_dir`` (default: the corpus shipped in ``refengine/bench/data``),
    sorted by name, joined.

    Raises:
        FileNotFoundError: no ``.txt`` file there.
    """
    d = pathlib.Path(data_dir) if data_dir is not None else bench_data_dir()
    files = sorted(d.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {d} to cut benchmark prompts from")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def sample_requests(corpus_token_ids: Sequence[int], num_prompts: int, input_len: tuple[int, int],
                    output_len: tuple[int, int], seed: int, prefix: str = "req") -> list[BenchRequest]:
    """Seeded requests whose prompts are windows of the tokenized corpus.

    Each request draws its prompt length uniformly from ``input_len`` (inclusive), its
    output length from ``output_len``, and a start offset in the corpus; the window wraps
    around the end of the corpus, so any length works with any corpus.

    Raises:
        ValueError: empty corpus or ``num_prompts < 1``.
    """
    if len(corpus_token_ids) == 0:
        raise ValueError("the corpus tokenized to no tokens")
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = np.random.default_rng(seed)
    ids = np.asarray(corpus_token_ids, dtype=np.int64)
    out = []
    for i in range(num_prompts):
        n_in = int(rng.integers(input_len[0], input_len[1] + 1))
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        start = int(rng.integers(0, len(ids)))
        window = np.take(ids, np.arange(start, start + n_in), mode="wrap")
        out.append(BenchRequest(f"{prefix}-{i}", window.tolist(), n_out))
    return out
