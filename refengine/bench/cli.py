"""``refengine bench``: the click group and one command per scenario."""

from __future__ import annotations

import dataclasses
import os

import click

from refengine.bench.driver import build_llm
from refengine.bench.plot import MISSING_MATPLOTLIB, matplotlib_available
from refengine.bench.scenarios import BenchContext, run_long_context, run_simple, run_sweep
from refengine.bench.workload import parse_len_range
from refengine.cli import engine_options
from refengine.engine_args import EngineArgs, resolve_model_dir


def _len_type(value):
    try:
        return parse_len_range(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _options(*, num_prompts: int, input_len: str, output_len: str, max_concurrency: int | None, compare: bool):
    """The flags every scenario shares, with that scenario's workload defaults, and the
    engine flags of ``refengine generate`` (same names, same defaults)."""
    def deco(f):
        opts = [
            click.option("--num-prompts", type=int, default=num_prompts, show_default=True,
                         help="Number of requests."),
            click.option("--input-len", default=input_len, show_default=True,
                         help="Prompt length in tokens: N, or LO-HI for seeded uniform lengths."),
            click.option("--output-len", default=output_len, show_default=True,
                         help="Output length in tokens: N, or LO-HI (EOS ignored)."),
            click.option("--max-concurrency", type=int, default=max_concurrency, show_default=True,
                         help="Most requests in flight (unset: all submitted at once); "
                              "--max-num-seqs is raised to it if lower."),
            click.option("--seed", type=int, default=0, show_default=True, help="Workload seed."),
            click.option("--dataset-dir", default=None, help="Directory of .txt files to cut prompts from "
                         "(default: the corpus shipped with refengine.bench)."),
            click.option("--json", "json_path", default=None, help="Write every figure and the engine settings here."),
            click.option("--plot", "plot_path", default=None,
                         help="Write a PNG of the results here (needs matplotlib)."),
            click.option("--trace", "trace_path", default=None,
                         help="Write a Chrome trace (Perfetto) of the engine steps here."),
            click.option("--disable-tqdm", is_flag=True, help="No progress bars."),
            click.option("--no-warmup", is_flag=True, help="Skip the two warm-up requests."),
        ]
        if compare:
            opts += [
                click.option("--compare-transformers", is_flag=True,
                             help="Also run the requests through transformers generate (same run)."),
                click.option("--hf-batch-size", type=int, default=None,
                             help="transformers batch size (default: --max-concurrency, else "
                                  "--max-num-seqs capped at 32)."),
                click.option("--hf-dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
                             default="float32", show_default=True, help="transformers weight dtype."),
            ]
        for opt in reversed(opts):
            f = opt(f)
        return engine_options(f)
    return deco


def _context(kw: dict) -> BenchContext:
    """The scenario's context from the command's flags.

    A missing model directory, or ``--plot`` without matplotlib, ends the command before
    any work is done.
    """
    try:
        engine_kw = dataclasses.asdict(EngineArgs.from_cli(kw))  # every engine flag checked here
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    engine_kw["model"] = str(resolve_model_dir(engine_kw["model"]))
    if not os.path.isdir(engine_kw["model"]):
        raise click.UsageError(f"model directory {engine_kw['model']!r} not found (set --model or $REFENGINE_MODEL)")
    if kw["plot_path"] and not matplotlib_available():
        raise click.ClickException(MISSING_MATPLOTLIB)
    return BenchContext(engine_kwargs=engine_kw, num_prompts=kw["num_prompts"], input_len=_len_type(kw["input_len"]),
                        output_len=_len_type(kw["output_len"]), max_concurrency=kw["max_concurrency"],
                        seed=kw["seed"], json_path=kw["json_path"], plot_path=kw["plot_path"],
                        trace_path=kw["trace_path"], data_dir=kw["dataset_dir"], progress=not kw["disable_tqdm"],
                        compare_transformers=kw.get("compare_transformers", False),
                        hf_batch_size=kw.get("hf_batch_size"), hf_dtype=kw.get("hf_dtype", "float32"),
                        warmup=not kw["no_warmup"])


def _build_llm(engine_kw: dict):
    """:func:`build_llm`, with bad engine settings ending the command with their message (as ``generate``)."""
    try:
        return build_llm(engine_kw)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        raise click.ClickException(str(e)) from None


@click.group("bench")
def bench():
    """Throughput and latency benchmarks (see `refengine bench SCENARIO --help`).

    The engine flags are those of `refengine generate`, with the same defaults; unset,
    --max-model-len is the workload's longest prompt plus longest output.
    """


@bench.command("throughput")
@_options(num_prompts=64, input_len="16-512", output_len="16-256", max_concurrency=None, compare=True)
def throughput_cmd(**kw):
    """N requests of random lengths submitted at once: requests/s and tokens/s."""
    run_simple(_context(kw), "throughput", _build_llm)


@bench.command("chat")
@_options(num_prompts=32, input_len="32-128", output_len="32-128", max_concurrency=8, compare=False)
def chat_cmd(**kw):
    """Short prompts and answers at fixed concurrency: P50/P90/P99 TTFT and TPOT."""
    run_simple(_context(kw), "chat", _build_llm)


@bench.command("generation")
@_options(num_prompts=16, input_len="16-64", output_len="256", max_concurrency=None, compare=True)
def generation_cmd(**kw):
    """Short prompts, long outputs: decode throughput."""
    run_simple(_context(kw), "generation", _build_llm)


@bench.command("long-context")
@_options(num_prompts=8, input_len="1024", output_len="16", max_concurrency=4, compare=True)
def long_context_cmd(**kw):
    """Long prompts, short outputs, chunked prefill on vs off: TTFT and inter-token latency."""
    run_long_context(_context(kw), _build_llm)


@bench.command("sweep")
@_options(num_prompts=16, input_len="128", output_len="64", max_concurrency=16, compare=False)
@click.option("--latency-metric", type=click.Choice(["tpot", "ttft", "e2e", "itl"]), default="tpot",
              show_default=True, help="Latency whose climb marks the knee.")
@click.option("--min-gain", type=float, default=0.10, show_default=True,
              help="Relative throughput gain below which growth counts as stopped.")
def sweep_cmd(latency_metric, min_gain, **kw):
    """One workload at concurrency 1, 2, 4 .. N: throughput and latency curves, and the knee."""
    run_sweep(_context(kw), latency_metric, min_gain, _build_llm)


def _register_serve_bench() -> None:
    """``bench serve``: the HTTP benchmark lives with the server (refengine/server/benchmark.py)."""
    from refengine.server.benchmark import serve_bench

    bench.add_command(serve_bench, "serve")


_register_serve_bench()
