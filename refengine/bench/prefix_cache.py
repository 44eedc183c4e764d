"""``refengine bench prefix-cache``: prefix caching on and off, side by side in one run.

Two workloads, each run on a fresh engine (the engine flags) with ``enable_prefix_caching``
on and off, greedy with EOS ignored so every run does the same work:

- **shared prefix**: ``--num-requests`` prompts made of one ``--prefix-len``-token
  "system prompt" and a distinct ``--suffix-len``-token question, ``--output-len`` tokens
  each, submitted together. Reported: median and mean TTFT (seconds from ``add_request``
  to the first token), twice: *cold* (the prefix has never been seen: the requests
  admitted in the first step all compute it) and *warm* (one earlier request with the same
  prefix has finished, as a server's system prompt would be).
- **no shared prefix**: ``--num-requests`` prompts of ``--distinct-len`` (64-384) tokens cut
  at seeded places of the benchmark text, ``--output-len`` tokens each. Reported: output and total tokens/s.
  Caching can only cost here (hashing and lookups); runs alternate off/on ``--repeats``
  times and the median is reported.

Prompts are windows of the bench corpus (:func:`refengine.bench.workload.sample_requests`);
the outputs must be the same with caching on and off, and the report says whether they were.
"""

from __future__ import annotations

import os
import statistics
import time

import click

from refengine.bench.options import LenRange, build_llm_or_fail, engine_kwargs, output_path, performance_md_option
from refengine.bench.report import environment, write_json, write_performance
from refengine.bench.workload import load_corpus, sample_requests
from refengine.cli_options import engine_options, fail


def run(llm, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts submitted together; TTFTs (seconds) and tokens/s of the batch."""
    from refengine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - start
    ttfts = [o.metrics.ttft for o in outs]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"ttft_median_s": statistics.median(ttfts), "ttft_mean_s": statistics.mean(ttfts),
            "elapsed_s": elapsed, "output_tok_per_s": out_tokens / elapsed,
            "total_tok_per_s": (out_tokens + sum(map(len, prompts))) / elapsed,
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def workloads(corpus_ids: list[int], prefix_len: int, suffix_len: int, num_requests: int,
              distinct_len: tuple[int, int], seed: int):
    """``(shared, warmup, distinct)`` prompts: ``num_requests`` of the shared prefix (the
    corpus's first ``prefix_len`` tokens) each with its own suffix; one more such prompt to
    warm the cache; ``num_requests`` prompts of ``distinct_len`` (lo, hi) tokens from elsewhere."""
    prefix = corpus_ids[:prefix_len]
    rest = corpus_ids[prefix_len:] or corpus_ids
    suffixes = sample_requests(rest, num_requests + 1, (suffix_len, suffix_len), (1, 1), seed, prefix="suffix")
    shared = [prefix + r.prompt_token_ids for r in suffixes]
    distinct = sample_requests(rest, num_requests, distinct_len, (1, 1), seed + 1, prefix="distinct")
    return shared[:num_requests], shared[-1], [r.prompt_token_ids for r in distinct]


def _check_fits(llm, shared_len: int, distinct_len: int, output_len: int) -> None:
    """End the command, naming the flags, when the longest request does not fit the engine's
    ``max_model_len`` (or the model has no tokenizer to cut prompts with)."""
    if llm.get_tokenizer() is None:
        fail(f"{llm.llm_engine.model_dir} has no tokenizer.json: bench prefix-cache cuts its prompts from text")
    limit = llm.llm_engine.config.max_model_len
    for what, n in (("--prefix-len + --suffix-len", shared_len), ("the longest --distinct-len", distinct_len)):
        if n + output_len > limit:
            fail(f"{what} ({n} tokens) + --output-len ({output_len}) does not fit max_model_len {limit}")


@click.command("prefix-cache")
@click.option("--prefix-len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Tokens of the prefix the shared-prefix requests have in common.")
@click.option("--suffix-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens of each request's own suffix.")
@click.option("--num-requests", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests per workload.")
@click.option("--output-len", type=click.IntRange(min=1), default=16, show_default=True,
              help="Output tokens per request (EOS ignored).")
@click.option("--distinct-len", type=LenRange(), default="64-384", show_default=True,
              help="Prompt lengths of the no-shared-prefix workload: N, or LO-HI (seeded).")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Off/on pairs of the no-shared-prefix workload (median reported).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Workload seed.")
@click.option("--json", "json_path", default=None, callback=output_path, show_default="none",
              help="Also write the figures to this file.")
@performance_md_option
@engine_options
def prefix_cache_cmd(prefix_len, suffix_len, num_requests, output_len, distinct_len, repeats, seed, json_path,
                     performance_md, **kw):
    """Prefix caching off and on: TTFT with a shared prefix (cold, warm), throughput without one.

    --enable-prefix-caching is ignored: the bench runs both.
    """
    _, engine_kw = engine_kwargs(kw)
    load = os.getloadavg()[0]
    results: dict = {"load_average_before": load, "engine_settings": engine_kw, "environment": environment(),
                     "shared_prefix": {}, "no_shared_prefix": {"on": [], "off": []}}
    corpus_ids = None
    shared = warmup = distinct = None
    for caching in (False, True):
        key = "on" if caching else "off"
        llm = build_llm_or_fail({**engine_kw, "enable_prefix_caching": caching})
        if corpus_ids is None:
            _check_fits(llm, prefix_len + suffix_len, distinct_len[1], output_len)
            corpus_ids = llm.get_tokenizer().encode(load_corpus())
            shared, warmup, distinct = workloads(corpus_ids, prefix_len, suffix_len, num_requests, distinct_len, seed)
        run(llm, [corpus_ids[:16]], 2)  # warm-up (allocations, BLAS threads)
        llm.reset_prefix_cache()
        cold = run(llm, shared, output_len)
        llm.reset_prefix_cache()
        run(llm, [warmup], 1)
        warm = run(llm, shared, output_len)
        results["shared_prefix"][key] = {"cold": cold, "warm": warm}
        del llm
    for _ in range(repeats):
        for caching in (False, True):
            llm = build_llm_or_fail({**engine_kw, "enable_prefix_caching": caching})
            run(llm, [corpus_ids[:16]], 2)
            results["no_shared_prefix"]["on" if caching else "off"].append(run(llm, distinct, output_len))
            del llm
    sp, ns = results["shared_prefix"], results["no_shared_prefix"]
    same = (sp["on"]["cold"]["token_ids"] == sp["off"]["cold"]["token_ids"] == sp["on"]["warm"]["token_ids"]
            and all(r["token_ids"] == ns["off"][0]["token_ids"] for r in ns["on"] + ns["off"]))
    results["identical_outputs"] = same

    click.echo(f"load average before: {load:.1f} on {os.cpu_count()} CPUs; identical outputs on/off: {same}")
    click.echo(f"\nshared prefix: {num_requests} requests, {prefix_len}-token prefix + {suffix_len}-token "
               f"suffix, {output_len} output tokens each")
    click.echo(f"{'':12}{'TTFT median':>14}{'TTFT mean':>12}{'elapsed':>10}")
    ttft_rows = []
    for phase in ("cold", "warm"):
        for key in ("off", "on"):
            r = sp[key][phase]
            click.echo(f"{phase + ' ' + key:12}{r['ttft_median_s']:13.2f}s{r['ttft_mean_s']:11.2f}s"
                       f"{r['elapsed_s']:9.1f}s")
        ratio = sp["off"][phase]["ttft_median_s"] / sp["on"][phase]["ttft_median_s"]
        click.echo(f"{phase} TTFT median off/on: x{ratio:.1f}")
        ttft_rows.append([phase, sp["off"][phase]["ttft_median_s"], sp["on"][phase]["ttft_median_s"], f"x{ratio:.1f}"])
    click.echo(f"\nno shared prefix: {num_requests} requests, prompts {distinct_len[0]}-{distinct_len[1]} tokens, "
               f"{output_len} output tokens; median of {repeats}")
    med = {k: statistics.median(r["total_tok_per_s"] for r in ns[k]) for k in ("off", "on")}
    out_med = {k: statistics.median(r["output_tok_per_s"] for r in ns[k]) for k in ("off", "on")}
    for key in ("off", "on"):
        runs = ", ".join(f"{r['total_tok_per_s']:.1f}" for r in ns[key])
        click.echo(f"caching {key:4} total {med[key]:7.1f} tok/s  output {out_med[key]:6.1f} tok/s  (runs: {runs})")
    change = f"{100 * (med['on'] / med['off'] - 1):+.1f}%"
    click.echo(f"on/off throughput: {change}")
    if json_path:
        for r in [sp[k][p] for k in sp for p in sp[k]] + ns["on"] + ns["off"]:
            r.pop("token_ids")
        write_json(json_path, results)
    write_performance(performance_md, "bench prefix-cache", [
        f"{num_requests} requests sharing a {prefix_len}-token prefix, each with its own {suffix_len}-token suffix, "
        f"{output_len} output tokens, submitted together; a fresh engine per side. TTFT median in seconds.",
        (["phase", "caching off", "caching on", "off / on"], ttft_rows),
        f"No shared prefix: {num_requests} prompts of {distinct_len[0]}-{distinct_len[1]} tokens, median of "
        f"{repeats} alternating runs. Identical outputs with caching on and off: {'yes' if same else 'NO'}.",
        (["caching", "total tok/s", "output tok/s"], [["off", med["off"], out_med["off"]],
                                                      ["on", med["on"], out_med["on"]]]),
        f"on / off throughput: {change}"], echo=click.echo)
