"""PNG plots of bench results.

matplotlib is an optional dependency (the ``plot`` extra), imported only here and only
when a plot is drawn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Sequence

from refengine.bench.driver import RunResult

MISSING_MATPLOTLIB = "plotting needs matplotlib, which is not installed: pip install 'refengine[plot]'"


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (checked without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed).

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING_MATPLOTLIB) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_report(path: str | os.PathLike, runs: Sequence[RunResult], sweep: dict | None = None) -> None:
    """Save a PNG: throughput and latency vs concurrency (sweeps), and per-step timelines.

    A timeline shows, for each engine step of a refengine run, the prefill and the decode
    tokens it computed (stacked bars as wide as the step lasted), seconds from the run's
    first step. Runs without steps (transformers) get no timeline.

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
    """
    plt = _pyplot()
    timelines = [r for r in runs if r.steps]
    if sweep is not None:  # one timeline is enough: the highest concurrency
        timelines = timelines[-1:]
    n_panels = (2 if sweep is not None else 0) + len(timelines)
    if n_panels == 0:
        n_panels = 1
    fig, axes = plt.subplots(n_panels, 1, figsize=(10, 3.2 * n_panels), squeeze=False)
    axes = [a[0] for a in axes]
    k = 0
    if sweep is not None:
        c = sweep["concurrency"]
        ax = axes[k]
        ax.plot(c, sweep["output_throughput"], "o-", label="output tok/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        if sweep.get("knee_concurrency") is not None:
            ax.axvline(sweep["knee_concurrency"], color="gray", ls="--", label=f"knee = {sweep['knee_concurrency']}")
        ax.legend(loc="best")
        ax.set_title("throughput vs concurrency")
        ax = axes[k + 1]
        ax.plot(c, sweep["median_ttft_ms"], "o-", label="median TTFT")
        ax.plot(c, sweep["median_tpot_ms"], "s-", label="median TPOT")
        ax.plot(c, sweep["p99_tpot_ms"], "s--", label="P99 TPOT")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.legend(loc="best")
        ax.set_title("latency vs concurrency")
        k += 2
    for run in timelines:
        ax = axes[k]
        k += 1
        t0 = run.steps[0].start
        x = [s.start - t0 for s in run.steps]
        w = [max(s.duration, 1e-6) for s in run.steps]
        pre = [s.num_prefill_tokens for s in run.steps]
        dec = [s.num_decode_tokens for s in run.steps]
        ax.bar(x, pre, width=w, align="edge", label="prefill tokens", color="tab:orange", linewidth=0)
        ax.bar(x, dec, width=w, bottom=pre, align="edge", label="decode tokens", color="tab:blue", linewidth=0)
        ax.set_xlabel("seconds since first step")
        ax.set_ylabel("tokens per step")
        ax.set_title(f"step timeline: {run.label} (max concurrency {run.max_concurrency or 'all'})")
        ax.legend(loc="upper right")
    if k == 0:
        axes[0].text(0.5, 0.5, "no engine steps to plot", ha="center", va="center")
        axes[0].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rate_sweep(path: str | os.PathLike, runs: Sequence[dict], percentiles: Sequence[float]) -> None:
    """Save a PNG of ``bench serve``'s TTFT and TPOT percentiles against the request rate
    (the knee is where they climb). ``runs``: the per-rate reports of
    :func:`refengine.bench.serve.summarize` (``request_rate``, ``ttft_ms`` and ``tpot_ms``
    with a ``p<q>`` entry per percentile).

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
    """
    plt = _pyplot()
    labels = [str(r["request_rate"]) for r in runs]
    x = list(range(len(runs)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for q in percentiles:
            ax.plot(x, [r[key][f"p{q:g}"] or float("nan") for r in runs], marker="o", label=f"P{q:g}")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} against load")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
