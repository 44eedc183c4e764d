"""The scenarios: build the engine and the workload, run, compare, report.

The engine is built from the same flags and defaults as ``refengine generate``
(:func:`refengine.cli_options.engine_options`), once per scenario (twice for ``long-context``),
with three adjustments that keep a workload runnable and the load set by the client:
``max_num_seqs`` is raised to the concurrency; ``max_model_len``, when not given, is the
longest prompt plus the longest output (rounded up to a KV block); and with chunked
prefill off, a token budget given explicitly is raised to ``max_model_len`` so every
prompt fits one step (left unset, the engine picks one that does).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
from dataclasses import dataclass
from typing import Callable

import click

from refengine.bench.breakdown import StepBreakdown, format_breakdown
from refengine.bench.driver import RunResult, build_llm, run_engine, warm_up
from refengine.bench.hf_baseline import HF_DEFAULT_BATCH, compare, run_transformers
from refengine.bench.plot import plot_report
from refengine.bench.report import (busy_warning, describe_engine, environment, format_run, format_spec_decode,
                                    format_table, format_value, runs_table, write_json, write_performance)
from refengine.bench.sweep import concurrency_levels, sweep_table
from refengine.bench.workload import load_corpus, sample_requests
from refengine.resources import bench_data_dir


@dataclass
class BenchContext:
    """Everything a scenario needs from the command line.

    ``engine_kwargs`` are ``LLMEngine`` keyword arguments, ``model`` included (see
    :func:`refengine.bench.scenarios.llm_kwargs`); the scenarios adjust them as the module says.
    """

    engine_kwargs: dict
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    max_concurrency: int | None
    seed: int
    json_path: str | None
    plot_path: str | None
    trace_path: str | None
    data_dir: str | None
    progress: bool
    compare_transformers: bool = False
    hf_batch_size: int | None = None
    hf_dtype: str = "float32"
    warmup: bool = True
    breakdown: bool = False
    performance_md: str | None = None
    echo: Callable[[str], None] = click.echo

    def needed_model_len(self) -> int:
        """Longest prompt plus longest output, rounded up to a whole KV block."""
        need = self.input_len[1] + self.output_len[1]
        bs = self.engine_kwargs["block_size"]
        return -(-need // bs) * bs

    def raise_max_num_seqs(self, concurrency: int | None) -> None:
        """At least ``concurrency`` sequences per step, so the client sets the load."""
        if concurrency:
            self.engine_kwargs["max_num_seqs"] = max(self.engine_kwargs["max_num_seqs"], concurrency)


def llm_kwargs(engine_kwargs: dict) -> dict:
    """``engine_kwargs`` with the token budget raised to ``max_model_len`` when chunked prefill
    is off and both are given (without chunking a whole prompt must fit one step)."""
    kw = dict(engine_kwargs)
    budget, max_len = kw["max_num_batched_tokens"], kw["max_model_len"]
    if not kw["enable_chunked_prefill"] and budget is not None and max_len is not None:
        kw["max_num_batched_tokens"] = max(budget, max_len)
    return kw


def _settings(kwargs: dict, engine) -> dict:
    """The kwargs an engine was built with and, for a real engine, the limits it resolved
    them to (``EngineConfig``: the token budget, ``max_model_len``, the KV pool size)."""
    config = getattr(engine, "config", None)
    if hasattr(config, "summary"):
        return {**kwargs, "resolved_config": config.summary()}
    return dict(kwargs)


def _prepare(ctx: BenchContext, settings: list[dict], llm_factory=build_llm):
    """Build the engine (its settings appended to ``settings``) and the workload;
    return (llm, engine, corpus_ids, requests)."""
    if ctx.engine_kwargs["max_model_len"] is None:
        ctx.engine_kwargs["max_model_len"] = ctx.needed_model_len()
    warning = busy_warning()
    if warning:
        ctx.echo(warning)
    kwargs = llm_kwargs(ctx.engine_kwargs)
    ctx.echo(f"building engine: {kwargs}")
    llm = llm_factory(kwargs)
    engine = llm.llm_engine
    settings.append(_settings(kwargs, engine))
    if ctx.trace_path:
        engine.metrics.trace = True  # EngineMetrics checks the flag when it records and writes
    tokenizer = llm.get_tokenizer()
    corpus_ids = tokenizer.encode(load_corpus(ctx.data_dir))
    requests = sample_requests(corpus_ids, ctx.num_prompts, ctx.input_len, ctx.output_len, ctx.seed)
    if ctx.warmup:
        warm_up(engine, corpus_ids)
    return llm, engine, corpus_ids, requests


def _finish(ctx: BenchContext, scenario: str, runs: list[RunResult], engine, settings: list[dict], *,
            extra: dict | None = None, sweep: dict | None = None, notes: list[str] | None = None) -> dict:
    """Print, and write the JSON / plot / trace files and the ``--performance-md`` section
    (the runs' table, then ``notes``) the flags asked for; return the report."""
    report = {
        "scenario": scenario,
        "workload": {"num_prompts": ctx.num_prompts, "input_len": list(ctx.input_len),
                     "output_len": list(ctx.output_len), "max_concurrency": ctx.max_concurrency,
                     "seed": ctx.seed, "data_dir": str(ctx.data_dir or bench_data_dir())},
        "engine_settings": settings,
        "environment": environment(),
        "runs": [r.to_dict() for r in runs],
    }
    if sweep is not None:
        report["sweep"] = sweep
    if extra:
        report.update(extra)
    if ctx.json_path:
        write_json(ctx.json_path, report)
        ctx.echo(f"wrote {ctx.json_path}")
    if ctx.plot_path:
        plot_report(ctx.plot_path, runs, sweep)
        ctx.echo(f"wrote {ctx.plot_path}")
    if ctx.trace_path and engine is not None:
        engine.metrics.write_trace(ctx.trace_path)
        ctx.echo(f"wrote {ctx.trace_path} (open in https://ui.perfetto.dev)")
    write_performance(ctx.performance_md, f"bench {scenario}", [_workload_line(ctx, settings), runs_table(runs),
                                                                 *(notes or [])], echo=ctx.echo)
    return report


def _workload_line(ctx: BenchContext, settings: list[dict]) -> str:
    """The workload and the engine(s) in one paragraph, for ``docs/PERFORMANCE.md``."""
    def span(lo_hi):
        lo, hi = lo_hi
        return str(lo) if lo == hi else f"{lo}-{hi}"

    engines = "; ".join(describe_engine(s["resolved_config"]) for s in settings if "resolved_config" in s)
    return (f"{ctx.num_prompts} requests, prompts of {span(ctx.input_len)} tokens, outputs of "
            f"{span(ctx.output_len)} tokens (greedy, EOS ignored, seed {ctx.seed}), max concurrency "
            f"{ctx.max_concurrency or 'all at once'}" + (f"; engine: {engines}." if engines else "."))


def _maybe_compare(ctx: BenchContext, ours: RunResult, requests) -> tuple[list[RunResult], dict | None]:
    if not ctx.compare_transformers:
        return [], None
    batch = ctx.hf_batch_size or ctx.max_concurrency or min(ctx.engine_kwargs["max_num_seqs"], HF_DEFAULT_BATCH)
    device = ctx.engine_kwargs["device"]
    if device == "auto":  # torch needs a concrete device: the one the engine picked
        from refengine.engine_args import resolve_device

        device = resolve_device(device)
    theirs = run_transformers(str(ctx.engine_kwargs["model"]), requests, batch_size=batch, progress=ctx.progress,
                              device=device, dtype=ctx.hf_dtype)
    ctx.echo(format_run(theirs))
    cmp = compare(ours, theirs)
    ctx.echo(_comparison_line(cmp))
    return [theirs], cmp


def _comparison_line(cmp: dict) -> str:
    return (f"refengine / transformers: output throughput x{format_value(cmp['output_throughput_ratio'])}, "
            f"total token throughput x{format_value(cmp['total_token_throughput_ratio'])}; "
            f"median TTFT transformers/refengine x{format_value(cmp['median_ttft_ratio_theirs_over_ours'])}, "
            f"median TPOT transformers/refengine x{format_value(cmp['median_tpot_ratio_theirs_over_ours'])}; "
            f"identical greedy outputs: {cmp['greedy_exact_match']}/{cmp['num_requests']}")


def _spec_decode_since(engine, before: dict | None) -> dict | None:
    """Speculative decoding's figures since ``before`` (a copy of ``metrics.spec_totals``);
    None when the engine did not speculate."""
    totals = getattr(getattr(engine, "metrics", None), "spec_totals", None)
    if not totals or before is None or totals["num_drafts"] == before["num_drafts"]:
        return None
    from refengine.metrics import spec_decode_summary

    per_pos = [n - (before["num_accepted_tokens_per_pos"][i] if i < len(before["num_accepted_tokens_per_pos"]) else 0)
               for i, n in enumerate(totals["num_accepted_tokens_per_pos"])]
    return spec_decode_summary({**{k: totals[k] - before[k] for k in ("num_drafts", "num_draft_tokens",
                                                                       "num_accepted_tokens")},
                                "num_accepted_tokens_per_pos": per_pos})


def _run(ctx: BenchContext, engine, requests, breakdowns: list, **kw) -> RunResult:
    """:func:`run_engine`; with ``--breakdown``, under a :class:`StepBreakdown` whose table
    is printed and whose summary is appended to ``breakdowns`` (labelled by the run)."""
    if not ctx.breakdown:
        return run_engine(engine, requests, progress=ctx.progress, **kw)
    with StepBreakdown(engine) as timer:
        run = run_engine(engine, requests, progress=ctx.progress, **kw)
    summary = timer.summary()
    ctx.echo(f"{run.label}: " + format_breakdown(summary))
    breakdowns.append({"run": run.label, **summary})
    return run


def run_simple(ctx: BenchContext, scenario: str, llm_factory=build_llm) -> dict:
    """One workload, one engine (``throughput``, ``chat``, ``generation``), optional comparison."""
    ctx.raise_max_num_seqs(ctx.max_concurrency)
    settings: list[dict] = []
    llm, engine, _, requests = _prepare(ctx, settings, llm_factory)
    totals = getattr(getattr(engine, "metrics", None), "spec_totals", None)
    before = copy.deepcopy(totals) if totals is not None else None  # the warm-up left out
    breakdowns: list = []
    ours = _run(ctx, engine, requests, breakdowns, max_concurrency=ctx.max_concurrency)
    ctx.echo(format_run(ours))
    extra = {"step_breakdown": breakdowns} if breakdowns else {}
    spec = _spec_decode_since(engine, before)
    if spec is not None:
        ctx.echo(format_spec_decode(spec))
        extra["speculative_decoding"] = spec
    theirs, cmp = _maybe_compare(ctx, ours, requests)
    if cmp:
        extra["comparison"] = cmp
    return _finish(ctx, scenario, [ours] + theirs, engine, settings, extra=extra or None,
                   notes=[_comparison_line(cmp)] if cmp else None)


def run_long_context(ctx: BenchContext, llm_factory=build_llm) -> dict:
    """The same long-prompt workload with chunked prefill on, then off (a fresh engine each)."""
    ctx.raise_max_num_seqs(ctx.max_concurrency)
    runs, settings, requests, breakdowns = [], [], None, []
    for chunked in (True, False):
        ctx.engine_kwargs["enable_chunked_prefill"] = chunked
        llm, engine, _, requests = _prepare(ctx, settings, llm_factory)
        run = _run(ctx, engine, requests, breakdowns, max_concurrency=ctx.max_concurrency,
                   label=f"refengine chunked_prefill={'on' if chunked else 'off'}")
        ctx.echo(format_run(run))
        runs.append(run)
        if ctx.trace_path:  # one trace per mode: NAME.chunked-on.json, NAME.chunked-off.json
            base, ext = os.path.splitext(ctx.trace_path)
            path = f"{base}.chunked-{'on' if chunked else 'off'}{ext or '.json'}"
            engine.metrics.write_trace(path)
            ctx.echo(f"wrote {path}")
        del llm, engine  # free the first model before loading the second
        gc.collect()
    on, off = runs
    ttft_on, ttft_off = on.latencies()["ttft"], off.latencies()["ttft"]
    itl_on, itl_off = on.latencies()["itl"], off.latencies()["itl"]
    ctx.echo(format_table(
        ["chunked prefill", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s"],
        [["on", ttft_on["median_ms"], ttft_on["p99_ms"], itl_on["median_ms"], itl_on["p99_ms"], on.output_throughput],
         ["off", ttft_off["median_ms"], ttft_off["p99_ms"], itl_off["median_ms"], itl_off["p99_ms"], off.output_throughput]]))
    theirs, cmp = _maybe_compare(ctx, on, requests)
    extra = {"step_breakdown": breakdowns} if breakdowns else {}
    if cmp:
        extra["comparison"] = cmp
    return _finish(ctx, "long-context", runs + theirs, None, settings, extra=extra or None,
                   notes=[_comparison_line(cmp)] if cmp else None)


def run_sweep(ctx: BenchContext, latency_metric: str, min_gain: float, llm_factory=build_llm) -> dict:
    """The same workload at concurrency 1, 2, 4, ... ``max_concurrency`` on one engine."""
    top = ctx.max_concurrency or ctx.num_prompts
    levels = concurrency_levels(top)
    ctx.raise_max_num_seqs(top)
    settings: list[dict] = []
    llm, engine, _, requests = _prepare(ctx, settings, llm_factory)
    runs, breakdowns = [], []
    for c in levels:
        reqs = [dataclasses.replace(r, request_id=f"c{c}-{r.request_id}") for r in requests]
        run = _run(ctx, engine, reqs, breakdowns, max_concurrency=c, label=f"concurrency {c}")
        runs.append(run)
        ctx.echo(f"concurrency {c}: {run.output_throughput:.2f} output tok/s, "
                 f"median TTFT {format_value(run.latencies()['ttft']['median_ms'])} ms, "
                 f"median TPOT {format_value(run.latencies()['tpot']['median_ms'])} ms")
    sweep = sweep_table(runs, latency_metric, min_gain)
    ctx.echo(format_table(
        ["concurrency", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"],
        [[c, t, rq, a, b, d, e] for c, t, rq, a, b, d, e in zip(
            sweep["concurrency"], sweep["output_throughput"], sweep["request_throughput"],
            sweep["median_ttft_ms"], sweep["p99_ttft_ms"], sweep["median_tpot_ms"], sweep["p99_tpot_ms"])]))
    knee = sweep["knee_concurrency"]
    knee_line = (f"knee: concurrency {knee} (beyond it output throughput grows < {min_gain:.0%} "
                 f"while median {latency_metric.upper()} climbs)" if knee is not None
                 else f"no knee up to concurrency {top}: throughput still grows >= {min_gain:.0%} per step")
    ctx.echo(knee_line)
    return _finish(ctx, "sweep", runs, engine, settings, sweep=sweep,
                   extra={"step_breakdown": breakdowns} if breakdowns else None, notes=[knee_line])
