"""``refengine bench``: the click group and one command per scenario."""

from __future__ import annotations

import os

import click

from refengine.bench.driver import EngineOptions
from refengine.bench.scenarios import BenchContext, run_long_context, run_simple, run_sweep
from refengine.bench.workload import DEFAULT_MODEL, default_model_dir, parse_len_range

def _len_type(value):
    try:
        return parse_len_range(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _options(*, num_prompts: int, input_len: str, output_len: str, max_concurrency: int | None,
             max_num_seqs: int, max_num_batched_tokens: int, compare: bool):
    """The flags every scenario shares, with that scenario's defaults."""
    def deco(f):
        opts = [
            click.option("--model", default=default_model_dir, show_default="$REFENGINE_MODEL or " + DEFAULT_MODEL,
                         help="Model directory (HF layout)."),
            click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
            click.option("--num-prompts", type=int, default=num_prompts, show_default=True,
                         help="Number of requests."),
            click.option("--input-len", default=input_len, show_default=True,
                         help="Prompt length in tokens: N, or LO-HI for seeded uniform lengths."),
            click.option("--output-len", default=output_len, show_default=True,
                         help="Output length in tokens: N, or LO-HI (EOS ignored)."),
            click.option("--max-concurrency", type=int, default=max_concurrency, show_default=True,
                         help="Most requests in flight (unset: all submitted at once)."),
            click.option("--seed", type=int, default=0, show_default=True, help="Workload seed."),
            click.option("--max-num-seqs", type=int, default=max_num_seqs, show_default=True,
                         help="Engine: most sequences per step (raised to --max-concurrency if lower)."),
            click.option("--max-num-batched-tokens", type=int, default=max_num_batched_tokens, show_default=True,
                         help="Engine: token budget per step."),
            click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=True, show_default=True,
                         help="Engine: split long prompts across steps."),
            click.option("--block-size", type=int, default=16, show_default=True, help="Engine: KV block size."),
            click.option("--max-model-len", type=int, default=None,
                         help="Engine: context limit (default: longest prompt + longest output)."),
            click.option("--num-kv-blocks", type=int, default=None, help="Engine: KV blocks (default: engine's choice)."),
            click.option("--dataset-dir", default=None, help="Directory of .txt files to cut prompts from "
                         "(default: benchmarks/data)."),
            click.option("--json", "json_path", default=None, help="Write every figure and the engine settings here."),
            click.option("--plot", "plot_path", default=None, help="Write a PNG of the results here."),
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
        return f
    return deco


def _context(kw: dict) -> BenchContext:
    options = EngineOptions(model=kw["model"], device=kw["device"], block_size=kw["block_size"],
                            max_num_seqs=kw["max_num_seqs"], max_num_batched_tokens=kw["max_num_batched_tokens"],
                            enable_chunked_prefill=kw["enable_chunked_prefill"],
                            max_model_len=kw["max_model_len"], num_kv_blocks=kw["num_kv_blocks"])
    return BenchContext(options=options, num_prompts=kw["num_prompts"], input_len=_len_type(kw["input_len"]),
                        output_len=_len_type(kw["output_len"]), max_concurrency=kw["max_concurrency"],
                        seed=kw["seed"], json_path=kw["json_path"], plot_path=kw["plot_path"],
                        trace_path=kw["trace_path"], data_dir=kw["dataset_dir"], progress=not kw["disable_tqdm"],
                        compare_transformers=kw.get("compare_transformers", False),
                        hf_batch_size=kw.get("hf_batch_size"), hf_dtype=kw.get("hf_dtype", "float32"),
                        warmup=not kw["no_warmup"])


def _check_model(path: str) -> None:
    if not os.path.isdir(path):
        raise click.UsageError(f"model directory {path!r} not found (set --model or $REFENGINE_MODEL)")


@click.group("bench")
def bench():
    """Throughput and latency benchmarks (see `refengine bench SCENARIO --help`)."""


@bench.command("throughput")
@_options(num_prompts=64, input_len="16-512", output_len="16-256", max_concurrency=None,
          max_num_seqs=256, max_num_batched_tokens=2048, compare=True)  # the engine's own defaults
def throughput_cmd(**kw):
    """N requests of random lengths submitted at once: requests/s and tokens/s."""
    _check_model(kw["model"])
    run_simple(_context(kw), "throughput")


@bench.command("chat")
@_options(num_prompts=32, input_len="32-128", output_len="32-128", max_concurrency=8,
          max_num_seqs=8, max_num_batched_tokens=512, compare=False)
def chat_cmd(**kw):
    """Short prompts and answers at fixed concurrency: P50/P90/P99 TTFT and TPOT."""
    _check_model(kw["model"])
    run_simple(_context(kw), "chat")


@bench.command("generation")
@_options(num_prompts=16, input_len="16-64", output_len="256", max_concurrency=None,
          max_num_seqs=16, max_num_batched_tokens=512, compare=True)
def generation_cmd(**kw):
    """Short prompts, long outputs: decode throughput."""
    _check_model(kw["model"])
    run_simple(_context(kw), "generation")


@bench.command("long-context")
@_options(num_prompts=8, input_len="1024", output_len="16", max_concurrency=4,
          max_num_seqs=4, max_num_batched_tokens=512, compare=True)
def long_context_cmd(**kw):
    """Long prompts, short outputs, chunked prefill on vs off: TTFT and inter-token latency."""
    _check_model(kw["model"])
    run_long_context(_context(kw))


@bench.command("sweep")
@_options(num_prompts=16, input_len="128", output_len="64", max_concurrency=16,
          max_num_seqs=16, max_num_batched_tokens=512, compare=False)
@click.option("--latency-metric", type=click.Choice(["tpot", "ttft", "e2e", "itl"]), default="tpot",
              show_default=True, help="Latency whose climb marks the knee.")
@click.option("--min-gain", type=float, default=0.10, show_default=True,
              help="Relative throughput gain below which growth counts as stopped.")
def sweep_cmd(latency_metric, min_gain, **kw):
    """One workload at concurrency 1, 2, 4 .. N: throughput and latency curves, and the knee."""
    _check_model(kw["model"])
    run_sweep(_context(kw), latency_metric, min_gain)
