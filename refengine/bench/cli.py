"""``refengine bench``: the click group and one command per scenario.

The in-process scenarios are defined here; the other commands live in their own modules
and are registered at the end: ``serve`` (:mod:`refengine.bench.serve`), ``spec``,
``prefix-cache``, ``kernels``, ``import-order``, ``peers`` and ``invariance``.
"""

from __future__ import annotations

import click

from refengine.bench.hf_baseline import MISSING_TRANSFORMERS, transformers_available
from refengine.bench.import_order import import_order_cmd
from refengine.bench.kernels import kernels_cmd
from refengine.bench.peers import peers_cmd
from refengine.bench.invariance import invariance_cmd
from refengine.bench.options import (LenRange, build_llm_or_fail, engine_kwargs, output_path,
                                     performance_md_option)
from refengine.bench.plot import MISSING_MATPLOTLIB, matplotlib_available
from refengine.bench.prefix_cache import prefix_cache_cmd
from refengine.bench.scenarios import BenchContext, llm_kwargs, run_long_context, run_simple, run_sweep
from refengine.bench.serve import serve_bench
from refengine.bench.spec import spec_cmd
from refengine.cli_options import IntList, engine_options, fail, log_level_option
from refengine.engine_args import EngineArgs


def _options(*, num_prompts: int, input_len: str, output_len: str, max_concurrency: int | None, compare: bool):
    """The flags every scenario shares, with that scenario's workload defaults, and the
    engine flags of ``refengine generate`` (same names, same defaults)."""
    def deco(f):
        opts = [
            click.option("--num-prompts", type=click.IntRange(min=1), default=num_prompts, show_default=True,
                         help="Number of requests."),
            click.option("--input-len", type=LenRange(), default=input_len, show_default=True,
                         help="Prompt length in tokens: N, or LO-HI for seeded uniform lengths."),
            click.option("--output-len", type=LenRange(), default=output_len, show_default=True,
                         help="Output length in tokens: N, or LO-HI (EOS ignored)."),
            click.option("--max-concurrency", type=click.IntRange(min=1), default=max_concurrency,
                         show_default="all submitted at once" if max_concurrency is None else True,
                         help="Most requests in flight; --max-num-seqs is raised to it if lower."),
            click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Workload seed."),
            click.option("--dataset-dir", type=click.Path(exists=True, file_okay=False), default=None,
                         show_default="the corpus shipped with refengine.bench",
                         help="Directory of .txt files to cut prompts from."),
            click.option("--json", "json_path", default=None, callback=output_path, show_default="none",
                         help="Write every figure and the engine settings here."),
            click.option("--plot", "plot_path", default=None, callback=output_path, show_default="none",
                         help="Write a PNG of the results here (needs matplotlib)."),
            click.option("--trace", "trace_path", default=None, callback=output_path, show_default="none",
                         help="Write a Chrome trace (Perfetto) of the engine steps here."),
            click.option("--disable-tqdm", is_flag=True, show_default="off",
                         help="No progress bars (there are none anyway when stderr is not a terminal)."),
            click.option("--no-warmup", is_flag=True, show_default="off", help="Skip the two warm-up requests."),
            click.option("--breakdown", is_flag=True, show_default="off",
                         help="Also print where a step's time goes: matrix products, attention, elementwise "
                              "layers, sampler, the rest (decode and prefill steps apart)."),
        ]
        if compare:
            opts += [
                click.option("--compare-transformers", is_flag=True, show_default="off",
                             help="Also run the requests through transformers generate (same run; needs the "
                                  "compare extra: torch and transformers)."),
                click.option("--hf-batch-size", type=click.IntRange(min=1), default=None,
                             show_default="--max-concurrency, else --max-num-seqs capped at 32",
                             help="transformers batch size."),
                click.option("--hf-dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
                             default="float32", show_default=True, help="transformers weight dtype."),
            ]
        opts.append(performance_md_option)
        for opt in reversed(opts):
            f = opt(f)
        return engine_options(f)
    return deco


def _context(kw: dict) -> BenchContext:
    """The scenario's context from the command's flags, every one checked before the
    model is loaded: the engine flags resolved against the model's config.json with the
    scenario's own adjustments (see :mod:`refengine.bench.scenarios`), the workload's
    longest request against the model's context and ``--max-model-len``, and the optional
    libraries ``--plot`` and ``--compare-transformers`` need.
    """
    args, engine_kw = engine_kwargs(kw)
    if kw["plot_path"] and not matplotlib_available():
        fail(MISSING_MATPLOTLIB, exit_code=1)
    if kw.get("compare_transformers") and not transformers_available():
        fail(MISSING_TRANSFORMERS, exit_code=1)
    ctx = BenchContext(engine_kwargs=engine_kw, num_prompts=kw["num_prompts"], input_len=kw["input_len"],
                       output_len=kw["output_len"], max_concurrency=kw["max_concurrency"],
                       seed=kw["seed"], json_path=kw["json_path"], plot_path=kw["plot_path"],
                       trace_path=kw["trace_path"], data_dir=kw["dataset_dir"], progress=not kw["disable_tqdm"],
                       compare_transformers=kw.get("compare_transformers", False),
                       hf_batch_size=kw.get("hf_batch_size"), hf_dtype=kw.get("hf_dtype", "float32"),
                       warmup=not kw["no_warmup"], breakdown=kw["breakdown"], performance_md=kw["performance_md"])
    _check_workload(ctx, args)
    return ctx


def _check_workload(ctx: BenchContext, args: EngineArgs) -> None:
    """Fail now, with the flags named, if the engine cannot be built or cannot run the
    workload's longest request (nothing big is loaded here: config.json is read and the
    engine config resolved)."""
    need = ctx.input_len[1] + ctx.output_len[1]
    lengths = f"--input-len up to {ctx.input_len[1]} + --output-len up to {ctx.output_len[1]} = {need} tokens"
    try:
        model_dir, model_config = args.model_config()
        context = model_config.max_position_embeddings
        max_model_len = args.max_model_len or min(ctx.needed_model_len(), context)
        resolved = llm_kwargs({**ctx.engine_kwargs, "max_model_len": max_model_len})
        EngineArgs(**resolved).create_engine_config(model_dir, model_config)  # the engine flags first
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except (RuntimeError, ImportError) as e:
        fail(str(e), exit_code=1)
    if need > context:
        fail(f"the longest request ({lengths}) does not fit the model's context of {context} tokens "
             f"(max_position_embeddings in {model_dir / 'config.json'})")
    if args.max_model_len is not None and need > args.max_model_len:
        fail(f"the longest request ({lengths}) does not fit --max-model-len={args.max_model_len}")


@click.group("bench")
@log_level_option
def bench():
    """Throughput and latency benchmarks (see `refengine bench SCENARIO --help`).

    The engine flags are those of `refengine generate`, with the same defaults; unset,
    --max-model-len is the workload's longest prompt plus longest output. Every command
    takes --performance-md FILE to write its table as a section of docs/PERFORMANCE.md.
    """


@bench.command("throughput")
@_options(num_prompts=64, input_len="16-512", output_len="16-256", max_concurrency=None, compare=True)
def throughput_cmd(**kw):
    """N requests of random lengths submitted at once: requests/s and tokens/s."""
    run_simple(_context(kw), "throughput", build_llm_or_fail)


@bench.command("chat")
@_options(num_prompts=32, input_len="32-128", output_len="32-128", max_concurrency=8, compare=False)
def chat_cmd(**kw):
    """Short prompts and answers at fixed concurrency: P50/P90/P99 TTFT and TPOT."""
    run_simple(_context(kw), "chat", build_llm_or_fail)


@bench.command("generation")
@_options(num_prompts=16, input_len="16-64", output_len="256", max_concurrency=None, compare=True)
def generation_cmd(**kw):
    """Short prompts, long outputs: decode throughput."""
    run_simple(_context(kw), "generation", build_llm_or_fail)


@bench.command("long-context")
@_options(num_prompts=8, input_len="1024", output_len="16", max_concurrency=4, compare=True)
def long_context_cmd(**kw):
    """Long prompts, short outputs, chunked prefill on vs off: TTFT and inter-token latency."""
    run_long_context(_context(kw), build_llm_or_fail)


@bench.command("sweep")
@_options(num_prompts=16, input_len="128", output_len="64", max_concurrency=16, compare=False)
@click.option("--latency-metric", type=click.Choice(["tpot", "ttft", "e2e", "itl"]), default="tpot",
              show_default=True, help="Latency whose climb marks the knee.")
@click.option("--min-gain", type=click.FloatRange(min=0, max=1), default=0.10, show_default=True,
              help="Relative throughput gain below which growth counts as stopped.")
def sweep_cmd(latency_metric, min_gain, **kw):
    """One workload at concurrency 1, 2, 4 .. N: throughput and latency curves, and the knee."""
    run_sweep(_context(kw), latency_metric, min_gain, build_llm_or_fail)


def _row_counts(ctx, param, rows: list[int]) -> list[int]:
    if not rows or min(rows) < 1:
        raise click.BadParameter(f"{','.join(map(str, rows))!r}: give at least one row count, each >= 1", ctx, param)
    return rows


@bench.command("forward")
@click.option("--rows", type=IntList(), default="1,2,4,8,16,32,256,512", show_default=True, callback=_row_counts,
              help="Comma-separated rows (tokens) per forward pass.")
@click.option("--context-len", type=click.IntRange(min=0), default=512, show_default=True,
              help="Tokens already cached per decode row.")
@click.option("--decode-max-rows", type=click.IntRange(min=1), default=64, show_default=True,
              help="Row counts up to this are decode steps (one token per sequence); above, one prefill chunk.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed passes per row count (the best is reported), after one warm-up pass.")
@click.option("--json", "json_path", default=None, callback=output_path, show_default="none",
              help="Write the table, the limits and the engine settings here.")
@performance_md_option
@engine_options
def forward_cmd(rows, context_len, decode_max_rows, repeats, json_path, performance_md, **kw):
    """One forward pass at each row count, its parts, against this machine's measured
    memory bandwidth and compute (the roofline): where the next gap is."""
    from refengine.bench.forward import forward_table, run_forward_bench
    from refengine.bench.report import describe_engine, environment, write_json, write_performance

    _, engine_kw = engine_kwargs(kw)
    longest = max([context_len + 1] + [r for r in rows if r > decode_max_rows])
    if engine_kw["max_model_len"] is None:
        engine_kw["max_model_len"] = longest
    elif engine_kw["max_model_len"] < longest:
        fail(f"--max-model-len={engine_kw['max_model_len']} is shorter than the longest pass "
             f"({longest} tokens: --context-len + 1 or the largest prefill row count)")
    engine_kw["max_num_batched_tokens"] = max(engine_kw["max_num_batched_tokens"] or 0, max(rows))
    engine_kw["max_num_seqs"] = max(engine_kw["max_num_seqs"], max([r for r in rows if r <= decode_max_rows] or [1]))
    llm = build_llm_or_fail(engine_kw)
    engine = llm.llm_engine
    click.echo(f"engine: {engine.config.summary()}")
    try:
        report = run_forward_bench(engine, rows, context_len, decode_max_rows, repeats, echo=click.echo)
    except ValueError as e:
        fail(str(e))
    if json_path:
        write_json(json_path, {"scenario": "forward", "engine_settings": engine_kw, "environment": environment(),
                               **report})
        click.echo(f"wrote {json_path}")
    write_performance(performance_md, "bench forward", [
        f"One forward pass per row count, decode rows at a context of {context_len} tokens, best of {repeats}; "
        f"engine: {describe_engine(engine.config.summary())}.", forward_table(report["passes"])],
        limits=(report["memory_bandwidth_bytes_per_s"], report["compute_flops_per_s"]), echo=click.echo)


for _command in (serve_bench, spec_cmd, prefix_cache_cmd, kernels_cmd, import_order_cmd, peers_cmd, invariance_cmd):
    bench.add_command(_command)
