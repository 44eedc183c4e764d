"""Printing results (plain-text tables), the JSON report, where the numbers came from, and
the sections of ``docs/PERFORMANCE.md`` (:func:`write_performance`)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import shlex
import stat
import sys
import tempfile
import time
from typing import Sequence, Union

import numpy as np

from refengine.bench.driver import PERCENTILES, RunResult
from refengine.bench.machine import SOURCE_ROOT, machine_facts

#: One table: ``(headers, rows)``, cells as :func:`format_value` writes them.
Table = tuple[Sequence[str], Sequence[Sequence]]


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


def runs_table(runs: Sequence[RunResult]) -> tuple[list[str], list[list]]:
    """``(headers, rows)``: one row of headline figures per run (throughputs; TTFT, TPOT and
    inter-token latency percentiles in ms)."""
    rows = []
    for run in runs:
        lat = run.latencies()
        rows.append([run.label, run.max_concurrency or "all", run.num_requests, run.output_throughput,
                     run.total_token_throughput, run.request_throughput, lat["ttft"]["median_ms"],
                     lat["ttft"]["p99_ms"], lat["tpot"]["median_ms"], lat["tpot"]["p99_ms"], lat["itl"]["median_ms"]])
    return (["run", "concurrency", "requests", "output tok/s", "total tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
             "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms"], rows)


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


# --- docs/PERFORMANCE.md ----------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table, cells as in :func:`format_table` (floats with two decimals, None as
    ``-``); a ``|`` in a cell is escaped and a line break becomes a space."""
    def cell(v) -> str:
        return format_value(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def describe_engine(summary: dict) -> str:
    """One line naming an engine's resolved settings (``EngineConfig.summary()``), the model
    by its directory's name only (no machine path in a document)."""
    spec = summary.get("speculative_config")
    parts = [f"{os.path.basename(str(summary['model_dir']).rstrip('/'))} ({summary['architecture']})",
             f"{summary['device']}", f"{summary['dtype']}", f"{summary['attention_backend']} attention",
             f"{summary['layer_ops']} layer ops", f"block size {summary['block_size']}",
             f"max_num_seqs {summary['max_num_seqs']}", f"max_num_batched_tokens {summary['max_num_batched_tokens']}",
             f"chunked prefill {'on' if summary['enable_chunked_prefill'] else 'off'}",
             f"max_model_len {summary['max_model_len']}"]
    if spec:
        parts.append(f"speculative {spec.get('method')} k={spec.get('num_speculative_tokens')}")
    return ", ".join(parts)


def command_line(argv: Sequence[str] | None = None, root: str | os.PathLike = SOURCE_ROOT) -> str:
    """The command as a reader would type it again, from ``argv`` (default ``sys.argv``).

    ``refengine`` for the console script, ``python -m refengine.bench`` for a module of the
    package, ``python benchmarks/NAME.py`` for a script of this checkout; every argument
    that is a path inside the checkout is written relative to it, so no machine's
    directory ends up in the document.
    """
    argv = list(sys.argv if argv is None else argv)
    root = pathlib.Path(root).resolve()
    package = root / "refengine"

    def inside(path: pathlib.Path, base: pathlib.Path) -> bool:
        return path == base or base in path.parents

    def relative(arg: str) -> str:
        if not os.path.isabs(arg):
            return arg
        path = pathlib.Path(arg).resolve()
        return os.path.relpath(path, root) if inside(path, root) else arg

    prog = pathlib.Path(argv[0]).resolve() if argv else pathlib.Path("refengine")
    if prog.suffix == ".py" and inside(prog, package):
        module = prog.relative_to(root).with_suffix("").parts
        head = ["python", "-m", ".".join(module[:-1] if module[-1] == "__main__" else module)]
    elif prog.suffix == ".py":
        head = ["python", relative(str(prog)) if inside(prog, root) else prog.name]
    else:
        head = [prog.name]
    return shlex.join(head + [relative(a) for a in argv[1:]])


def performance_section(title: str, body: Sequence[Union[Table, str]], facts: dict, command: str) -> str:
    """One section of ``docs/PERFORMANCE.md``: ``## title``, where and when it was measured
    (``facts`` from :func:`refengine.bench.machine.machine_facts`), the command, then
    ``body``: each item a :data:`Table` (written as Markdown) or a paragraph of text."""
    lines = [f"## {title}", "",
             f"- date: {facts['date_utc']}",
             f"- commit: {facts['commit']}",
             f"- CPU: {facts['cpu']} ({facts['threads']} of {facts['cpu_count']} cores used)",
             f"- measured in this run: read bandwidth {facts['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
             f"float32 BLAS {facts['float32_flops_per_s'] / 1e9:.1f} GFLOP/s",
             f"- command: `{command}`"]
    for item in body:
        lines += ["", item if isinstance(item, str) else markdown_table(*item)]
    return "\n".join(lines) + "\n"


def replace_section(text: str, title: str, section: str) -> str:
    """``text`` (a Markdown document) with its ``## title`` section replaced by ``section``,
    or with ``section`` appended when there is none. A section runs from its heading to the
    next level-2 heading (``### `` subsections belong to it; fenced code is skipped); every
    other section is left byte for byte as it was."""
    lines = text.splitlines(keepends=True)
    headings, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            headings.append(i)
    start = next((i for i in headings if lines[i][3:].strip() == title), None)
    if start is None:
        head = text.rstrip("\n")
        return (head + "\n\n" if head else "") + section
    end = next((i for i in headings if i > start), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + tail if tail else "")


def write_performance(path: str | os.PathLike | None, title: str, body: Sequence[Union[Table, str]], *,
                      command: str | None = None, limits: tuple[float, float] | None = None,
                      echo=None) -> str | None:
    """Write or replace the ``## title`` section of the Markdown file ``path``
    (``--performance-md``, for ``docs/PERFORMANCE.md``): date (UTC), commit, CPU model,
    cores used, this machine's read bandwidth and float32 FLOP/s measured now, the command,
    then ``body`` (tables and paragraphs). Every other section stays as it was; a missing
    file is created with a ``# Performance`` title.

    Args:
        path: the file; None writes nothing (a bench run without ``--performance-md``).
        title: the section's heading; a later run with the same title replaces it.
        command: the command line to record (default :func:`command_line` of ``sys.argv``).
        limits: ``(bandwidth bytes/s, flop/s)`` this run already measured; None runs the
            short probes of :func:`refengine.bench.machine.machine_facts`.
        echo: called with a line saying what was written, if given.
    Returns:
        the section written, or None when ``path`` is None.
    Raises:
        ValueError: an empty title, or one with a line break.
        OSError: the file cannot be read or written.
    """
    if path is None:
        return None
    if not title.strip() or "\n" in title:
        raise ValueError(f"section title {title!r} must be one non-empty line")
    path = pathlib.Path(path)
    section = performance_section(title.strip(), body, machine_facts(limits=limits),
                                  command if command is not None else command_line())
    text = path.read_text(encoding="utf-8") if path.exists() else "# Performance\n"
    new = replace_section(text, title.strip(), section)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:  # a whole file or none: never half a document
        f.write(new)
    mode = path.stat().st_mode if path.exists() else 0o666 & ~_umask()
    os.chmod(tmp, stat.S_IMODE(mode))  # mkstemp's file is private; the document keeps its mode
    os.replace(tmp, path)
    if echo is not None:
        echo(f"wrote section '{title.strip()}' of {path}")
    return section


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
