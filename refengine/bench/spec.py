"""``refengine bench spec``: batch-1 decode speed with and without n-gram speculative decoding.

Two workloads, each generated greedily by two engines of the same settings (the engine
flags), speculation off and on, ``--runs`` times each, alternating (the median rate is
reported, so a moment of load on the machine hits both sides alike):

- ``grounded``: the model is asked to repeat a passage that is in its prompt, so the
  continuation copies the prompt and n-gram proposals are often right;
- ``free``: an open question, where proposals are rarely found or right.

Decode tokens/s = (output tokens - 1) / (time of the last token - time of the first), as
``benchmarks/bench_single.py``; with speculation several tokens share one step's time
stamp, which this rate accounts for. The outputs must be token for token the same
(greedy); a difference is reported. Also printed: the acceptance rate and mean acceptance
length, and the time of one target forward pass that returns logits at 1, 2, 4, 6 and 8
rows after a prompt-length context (a verify of k proposals is k + 1 rows): on a
memory-bound machine the extra rows should cost little.
"""

from __future__ import annotations

import statistics
import time

import click

from refengine.bench.options import build_llm_or_fail, engine_kwargs, output_path, performance_md_option
from refengine.bench.report import busy_warning, environment, format_table, write_json, write_performance
from refengine.cli_options import engine_options, fail

PASSAGE = ("The paged KV cache stores the keys and values of every sequence in fixed-size blocks. "
           "A block table maps each position of a sequence to the block that holds it, so memory is "
           "never fragmented and a sequence grows one block at a time. When the pool runs out, the "
           "scheduler preempts the newest sequence and recomputes it later.")
WORKLOADS = {
    "grounded": f"Repeat the following text exactly, word for word.\n\n{PASSAGE}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
#: Rows of the verify-cost passes (a verify of k proposals is k + 1 rows).
VERIFY_ROWS = (1, 2, 4, 6, 8)


def build(engine_kw: dict, spec: dict | None):
    """An engine for one side of the comparison (``engine_kw`` with ``speculative_config=spec``), warmed up."""
    from refengine import SamplingParams

    llm = build_llm_or_fail({**engine_kw, "speculative_config": spec})
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return llm


def generate(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    """One greedy generation; its decode rate (tokens/s), tokens and acceptance."""
    from refengine import SamplingParams

    before = dict(llm.llm_engine.metrics.spec_totals)
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
    times = out.metrics.token_times
    totals = llm.llm_engine.metrics.spec_totals
    drafts = totals["num_drafts"] - before["num_drafts"]
    drafted = totals["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = totals["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {"decode_tok_per_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
            "num_tokens": len(out.outputs[0].token_ids), "token_ids": list(out.outputs[0].token_ids),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode rate, with every run's rate beside it."""
    ordered = sorted(runs, key=lambda r: r["decode_tok_per_s"])
    return {**ordered[len(ordered) // 2], "decode_tok_per_s_all": [r["decode_tok_per_s"] for r in runs]}


def forward_times(engine_kw: dict, prompt_ids: list[int], rows: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median seconds of one target forward pass returning logits at ``n`` rows (a verify of
    n - 1 proposals) after a context of ``len(prompt_ids)`` tokens, for each ``n`` in ``rows``."""
    from refengine import SamplingParams
    from refengine.core.sequence import Sequence

    engine = build_llm_or_fail({**engine_kw, "speculative_config": None}).llm_engine
    context, most = len(prompt_ids), max(rows)
    tokens = (prompt_ids * 2)[:context + most]
    seq = Sequence("fwd", None, tokens, SamplingParams(max_tokens=1))
    engine.block_manager.allocate(seq, len(tokens))
    engine.runner.execute([(seq, context)])  # the context's K/V, once
    seq.num_computed_tokens = context
    out = {}
    for n in rows:
        seq.prompt_token_ids = tokens[:context + n]  # n new rows; they rewrite the same slots each time
        engine.runner.execute([(seq, n)], all_logits=True)  # warm-up
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.runner.execute([(seq, n)], all_logits=True)
            samples.append(time.perf_counter() - t0)
        out[n] = statistics.median(samples)
    engine.block_manager.free(seq)
    return out


@click.command("spec")
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="Tokens generated per run.")
@click.option("-k", "--num-speculative-tokens", "k", type=click.IntRange(min=1), default=4, show_default=True,
              help="n-gram proposals per step.")
@click.option("--prompt-lookup-max", type=click.IntRange(min=1), default=4, show_default=True,
              help="Longest n-gram looked up in the context.")
@click.option("--prompt-lookup-min", type=click.IntRange(min=1), default=2, show_default=True,
              help="Shortest n-gram looked up in the context.")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="Generations per workload and side (median reported).")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="Timed repeats per forward-pass size.")
@click.option("--json", "json_path", default=None, callback=output_path, show_default="none",
              help="Write every figure to this file.")
@performance_md_option
@engine_options
def spec_cmd(max_tokens, k, prompt_lookup_max, prompt_lookup_min, runs, repeats, json_path, performance_md, **kw):
    """Batch-1 decode with n-gram speculation off and on: tokens/s, acceptance, same output."""
    _, engine_kw = engine_kwargs(kw)
    if engine_kw["speculative_config"] is not None:
        fail("bench spec runs speculation off and on itself, n-gram from -k, --prompt-lookup-max and "
             "--prompt-lookup-min: leave out --speculative-config")
    warning = busy_warning()
    if warning:
        click.echo(warning)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": prompt_lookup_max,
            "prompt_lookup_min": prompt_lookup_min}
    report = {"speculative_config": spec, "max_tokens": max_tokens, "engine_settings": engine_kw,
              "environment": environment(), "workloads": {}}
    rows = []
    engines = {"off": build(engine_kw, None), "on": build(engine_kw, spec)}
    tok = engines["off"].get_tokenizer()
    if tok is None:
        fail(f"{engine_kw['model']} has no tokenizer.json: bench spec's prompts are chat text")
    for name, text in WORKLOADS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
        sides = {"off": [], "on": []}
        for _ in range(runs):
            for side, llm in engines.items():
                sides[side].append(generate(llm, ids, max_tokens))
        off, on = median_run(sides["off"]), median_run(sides["on"])
        same = all(r["token_ids"] == off["token_ids"] for r in sides["off"] + sides["on"])
        report["workloads"][name] = {"prompt_tokens": len(ids), "off": off, "on": on, "identical_outputs": same}
        rows.append([name, len(ids), off["num_tokens"], off["decode_tok_per_s"], on["decode_tok_per_s"],
                     on["decode_tok_per_s"] / off["decode_tok_per_s"], on["acceptance_rate"],
                     on["mean_acceptance_length"], same])
    speed = (["workload", "prompt", "tokens", "off tok/s", "n-gram tok/s", "speed-up", "acceptance",
              "mean acc. len", "same output"], rows)
    click.echo(format_table(*speed))
    del engines
    ids = tok.encode(WORKLOADS["grounded"])
    fwd = forward_times(engine_kw, ids, VERIFY_ROWS, repeats)
    report["forward_s_by_rows"] = fwd
    verify = (["rows", "ms", "x 1 row"], [[n, 1e3 * t, t / fwd[1]] for n, t in fwd.items()])
    click.echo(f"\none forward pass after {len(ids)} context tokens (median of {repeats}):")
    click.echo(format_table(*verify))
    if json_path:
        write_json(json_path, report)
        click.echo(f"wrote {json_path}")
    write_performance(performance_md, "bench spec", [
        f"Batch 1, greedy, n-gram speculation off and on (k = {k}, prompt_lookup_max {prompt_lookup_max}, "
        f"prompt_lookup_min {prompt_lookup_min}), {max_tokens} tokens per run, median of {runs} alternating runs.",
        speed, f"One target forward pass returning logits at n rows after {len(ids)} context tokens "
               f"(a verify of k proposals is k + 1 rows), median of {repeats}.", verify], echo=click.echo)
