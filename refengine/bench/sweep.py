"""Concurrency sweeps: the levels, the per-level table, and the knee."""

from __future__ import annotations

from typing import Sequence

from refengine.bench.driver import RunResult


def concurrency_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to ``max_concurrency``, which is always included as the last level."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    levels.append(max_concurrency)
    return levels


def find_knee(concurrency: Sequence[int], throughput: Sequence[float], latency: Sequence[float],
              min_gain: float = 0.10) -> int | None:
    """The concurrency past which more concurrency buys little throughput but costs latency.

    Walks the levels in order and returns the first ``concurrency[i]`` such that going to
    ``concurrency[i+1]`` raises throughput by less than ``min_gain`` (relative) while
    latency rises. Returns None when throughput keeps growing (or latency does not climb)
    up to the last level, i.e. no knee within the sweep.

    Args:
        concurrency: increasing levels.
        throughput: e.g. output tokens/s at each level.
        latency: e.g. median TPOT at each level (any unit; only the direction matters).
        min_gain: relative throughput gain below which growth counts as stopped (0.10 = 10 %).
    """
    if not len(concurrency) == len(throughput) == len(latency):
        raise ValueError("concurrency, throughput and latency must have the same length")
    for i in range(len(concurrency) - 1):
        if throughput[i] <= 0:
            continue
        gain = throughput[i + 1] / throughput[i] - 1.0
        if gain < min_gain and latency[i + 1] > latency[i]:
            return concurrency[i]
    return None


def sweep_table(runs: Sequence[RunResult], latency_metric: str = "tpot", min_gain: float = 0.10) -> dict:
    """Throughput and latency per concurrency level, and the knee (see :func:`find_knee`)."""
    levels = [r.max_concurrency for r in runs]
    thr = [r.output_throughput for r in runs]
    lat = [r.latencies()[latency_metric]["median_ms"] or 0.0 for r in runs]
    return {
        "concurrency": levels,
        "output_throughput": thr,
        "request_throughput": [r.request_throughput for r in runs],
        "median_ttft_ms": [r.latencies()["ttft"]["median_ms"] for r in runs],
        "median_tpot_ms": [r.latencies()["tpot"]["median_ms"] for r in runs],
        "p99_ttft_ms": [r.latencies()["ttft"]["p99_ms"] for r in runs],
        "p99_tpot_ms": [r.latencies()["tpot"]["p99_ms"] for r in runs],
        "knee_latency_metric": latency_metric,
        "knee_min_gain": min_gain,
        "knee_concurrency": find_knee(levels, thr, lat, min_gain),
    }
