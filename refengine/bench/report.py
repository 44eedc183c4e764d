"""Printing results (plain-text tables), the JSON report, and where the numbers came from."""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import sys
import time
from typing import Sequence

import numpy as np

from refengine.bench.driver import PERCENTILES, RunResult


def format_value(v, digits: int = 2) -> str:
    """One table cell: floats with ``digits`` decimals, infinity as ``inf``, None as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain-text table, columns right-aligned, floats with two decimals, None as ``-``."""
    cells = [[str(h) for h in headers]] + [[format_value(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_run(run: RunResult) -> str:
    """A block of headline figures and a latency percentile table for one run."""
    s = run.summary()
    head = [
        f"=== {run.label} (max concurrency: {run.max_concurrency or 'all'}) ===",
        f"requests:               {s['num_requests']}",
        f"duration (s):           {s['elapsed_s']:.2f}",
        f"prompt tokens:          {s['total_prompt_tokens']}",
        f"output tokens:          {s['total_output_tokens']}",
        f"request throughput:     {format_value(s['request_throughput'])} req/s",
        f"output throughput:      {format_value(s['output_throughput'])} tok/s",
        f"total token throughput: {format_value(s['total_token_throughput'])} tok/s",
    ]
    if s["requests_with_unexpected_output_len"]:
        head.append(f"WARNING: {len(s['requests_with_unexpected_output_len'])} requests produced "
                    "a different number of tokens than asked")
    cols = ["mean_ms"] + [f"p{p}_ms" for p in PERCENTILES]
    rows = [[name] + [summ[c] for c in cols] for name, summ in s["latency"].items()]
    return "\n".join(head) + "\n" + format_table(["latency (ms)"] + [c[:-3] for c in cols], rows)


def format_spec_decode(s: dict) -> str:
    """Speculative decoding's figures (:func:`refengine.metrics.spec_decode_summary`) as a few lines."""
    per_pos = ", ".join(f"{r:.3f}" for r in s["acceptance_rate_per_pos"])
    return (f"speculative decoding:   {s['num_drafts']} drafts, {s['num_accepted_tokens']}/{s['num_draft_tokens']} "
            f"proposed tokens accepted\n"
            f"acceptance rate:        {100 * s['acceptance_rate']:.1f}%\n"
            f"mean acceptance length: {s['mean_acceptance_length']:.2f} tokens per verify\n"
            f"acceptance by position: {per_pos}")


def environment() -> dict:
    """Where the numbers came from: Python, NumPy, OS, CPU count, thread settings."""
    env = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:  # torch only if it is already loaded (the transformers comparison)
        if "torch" in sys.modules:
            env["torch"] = sys.modules["torch"].__version__
            env["torch_num_threads"] = sys.modules["torch"].get_num_threads()
        if "transformers" in sys.modules:
            env["transformers"] = sys.modules["transformers"].__version__
    except Exception:  # noqa: BLE001 - a version probe must never fail a benchmark
        pass
    return env


def busy_warning() -> str | None:
    """A warning when the machine is already busy (1-minute load average above half the CPUs).

    Other processes skew every figure, BLAS thread pools that spin-wait most of all.
    """
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cpus:
        return (f"WARNING: load average {load:.1f} on {cpus} CPUs before the run; "
                "other processes will skew the numbers")
    return None


def write_json(path: str | os.PathLike, report: dict) -> None:
    """Write ``report`` as indented JSON (infinities as null)."""
    def clean(o):
        if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    pathlib.Path(path).write_text(json.dumps(clean(report), indent=2), encoding="utf-8")
