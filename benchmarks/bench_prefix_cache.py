"""Prefix caching on and off, side by side in one run (not a timed test).

Two workloads, each run on a fresh engine with ``enable_prefix_caching`` on and off
(block size 16, engine defaults otherwise), greedy with EOS ignored so every run does the
same work:

- **shared prefix**: ``--num-requests`` prompts made of one ``--prefix-len``-token
  "system prompt" and a distinct ``--suffix-len``-token question, ``--output-len`` tokens
  each, submitted together. Reported: median and mean TTFT (seconds from ``add_request``
  to the first token), twice: *cold* (the prefix has never been seen: the requests
  admitted in the first step all compute it) and *warm* (one earlier request with the same
  prefix has finished, as a server's system prompt would be).
- **no shared prefix**: ``--num-requests`` prompts of 64-384 tokens cut from different
  places of the benchmark text, ``--output-len`` tokens each. Reported: output and total
  tokens/s. Caching can only cost here (hashing and lookups); runs alternate on/off
  ``--repeats`` times and the median is reported.

    python benchmarks/bench_prefix_cache.py [--model DIR] [--prefix-len 1024] [--json FILE]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def corpus_ids(tokenizer) -> list[int]:
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "benchmarks" / "data").glob("*.txt")))
    return tokenizer.encode(text)


def make_llm(model: str, caching: bool):
    from refengine import LLM

    return LLM(model=model, device="cpu", block_size=16, log_stats=False, enable_prefix_caching=caching)


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


@click.command()
@click.option("--model", default=str(ROOT / "weights" / "SmolLM2-135M-Instruct"), show_default=True)
@click.option("--prefix-len", default=1024, show_default=True)
@click.option("--suffix-len", default=32, show_default=True)
@click.option("--num-requests", default=16, show_default=True)
@click.option("--output-len", default=16, show_default=True)
@click.option("--repeats", default=2, show_default=True, help="on/off pairs of the no-shared-prefix workload")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", default=None, help="also write the figures to this file")
def main(model, prefix_len, suffix_len, num_requests, output_len, repeats, seed, json_path):
    from refengine.tokenizer import Tokenizer

    load = os.getloadavg()[0]
    ids = corpus_ids(Tokenizer.from_pretrained(model))
    rng = random.Random(seed)
    prefix = ids[:prefix_len]
    starts = rng.sample(range(prefix_len, len(ids) - 400), 2 * num_requests + 1)
    shared = [prefix + ids[s:s + suffix_len] for s in starts[:num_requests]]
    warmup = prefix + ids[starts[-1]:starts[-1] + suffix_len]
    lengths = [rng.randint(64, 384) for _ in range(num_requests)]
    distinct = [ids[s:s + n] for s, n in zip(starts[num_requests:2 * num_requests], lengths)]

    results: dict = {"load_average_before": load, "shared_prefix": {}, "no_shared_prefix": {"on": [], "off": []}}
    for caching in (False, True):
        key = "on" if caching else "off"
        llm = make_llm(model, caching)
        run(llm, [ids[:16]], 2)  # warm-up (allocations, BLAS threads)
        llm.reset_prefix_cache()
        cold = run(llm, shared, output_len)
        llm.reset_prefix_cache()
        run(llm, [warmup], 1)
        warm = run(llm, shared, output_len)
        results["shared_prefix"][key] = {"cold": cold, "warm": warm}
        del llm
    for _ in range(repeats):
        for caching in (False, True):
            llm = make_llm(model, caching)
            run(llm, [ids[:16]], 2)
            results["no_shared_prefix"]["on" if caching else "off"].append(run(llm, distinct, output_len))
            del llm
    sp, ns = results["shared_prefix"], results["no_shared_prefix"]
    same = (sp["on"]["cold"]["token_ids"] == sp["off"]["cold"]["token_ids"] == sp["on"]["warm"]["token_ids"]
            and all(r["token_ids"] == ns["off"][0]["token_ids"] for r in ns["on"] + ns["off"]))

    click.echo(f"load average before: {load:.1f} on {os.cpu_count()} CPUs; identical outputs on/off: {same}")
    click.echo(f"\nshared prefix: {num_requests} requests, {prefix_len}-token prefix + {suffix_len}-token "
               f"suffix, {output_len} output tokens each")
    click.echo(f"{'':12}{'TTFT median':>14}{'TTFT mean':>12}{'elapsed':>10}")
    for phase in ("cold", "warm"):
        for key in ("off", "on"):
            r = sp[key][phase]
            click.echo(f"{phase + ' ' + key:12}{r['ttft_median_s']:13.2f}s{r['ttft_mean_s']:11.2f}s"
                       f"{r['elapsed_s']:9.1f}s")
        ratio = sp["off"][phase]["ttft_median_s"] / sp["on"][phase]["ttft_median_s"]
        click.echo(f"{phase} TTFT median off/on: x{ratio:.1f}")
    click.echo(f"\nno shared prefix: {num_requests} requests, prompts 64-384 tokens, {output_len} output tokens; "
               f"median of {repeats}")
    med = {k: statistics.median(r["total_tok_per_s"] for r in ns[k]) for k in ("off", "on")}
    out_med = {k: statistics.median(r["output_tok_per_s"] for r in ns[k]) for k in ("off", "on")}
    for key in ("off", "on"):
        runs = ", ".join(f"{r['total_tok_per_s']:.1f}" for r in ns[key])
        click.echo(f"caching {key:4} total {med[key]:7.1f} tok/s  output {out_med[key]:6.1f} tok/s  (runs: {runs})")
    click.echo(f"on/off throughput: {100 * (med['on'] / med['off'] - 1):+.1f}%")
    if json_path:
        for r in [sp[k][p] for k in sp for p in sp[k]] + ns["on"] + ns["off"]:
            r.pop("token_ids")
        Path(json_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
