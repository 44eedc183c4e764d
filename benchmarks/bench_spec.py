"""Batch-1 decode speed with and without n-gram speculative decoding, in one run.

Two workloads, each generated greedily by two engines of the same settings, speculation
off and on, ``--runs`` times each, alternating (the median rate is reported, so a
moment of load on the machine hits both sides alike):

- ``grounded``: the model is asked to repeat a passage that is in its prompt, so the
  continuation copies the prompt and n-gram proposals are often right;
- ``free``: an open question, where proposals are rarely found or right.

Decode tokens/s = (output tokens - 1) / (time of the last token - time of the first),
as ``bench_single.py``; with speculation several tokens share one step's time stamp,
which this rate accounts for. The outputs must be token for token the same (greedy);
a difference is reported. Also printed: the acceptance rate and mean acceptance length,
and the time of one target forward pass that returns logits at 1, 2, 4, 6 and 8 rows
after a prompt-length context (a verify of k proposals is k + 1 rows): on a
memory-bound machine the extra rows should cost little.

    python benchmarks/bench_spec.py [--model DIR] [--max-tokens 128] [-k 4] [--runs 3] [--json FILE]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import click

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from refengine.bench.report import busy_warning, environment, format_table, write_json  # noqa: E402
from refengine.engine_args import resolve_model_dir  # noqa: E402

PASSAGE = ("The paged KV cache stores the keys and values of every sequence in fixed-size blocks. "
           "A block table maps each position of a sequence to the block that holds it, so memory is "
           "never fragmented and a sequence grows one block at a time. When the pool runs out, the "
           "scheduler preempts the newest sequence and recomputes it later.")
WORKLOADS = {
    "grounded": f"Repeat the following text exactly, word for word.\n\n{PASSAGE}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def build(model: str, spec: dict | None):
    """An engine for one side of the comparison, warmed up."""
    from refengine import LLM, SamplingParams

    llm = LLM(model=model, max_num_seqs=1, log_stats=False, speculative_config=spec)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return llm


def generate(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    """One greedy generation; its decode rate, tokens and acceptance."""
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


def forward_times(model: str, prompt_ids: list[int], rows: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median seconds of one target forward pass returning logits at ``n`` rows (a verify of
    n - 1 proposals) after a context of ``len(prompt_ids)`` tokens, for each ``n`` in ``rows``."""
    from refengine import LLM, SamplingParams
    from refengine.sequence import Sequence

    engine = LLM(model=model, max_num_seqs=1, log_stats=False).llm_engine
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


@click.command()
@click.option("--model", default=None, help="model directory (default: $REFENGINE_MODEL or the SmolLM2 checkout)")
@click.option("--max-tokens", default=128, show_default=True, help="tokens generated per run")
@click.option("-k", "--num-speculative-tokens", "k", default=4, show_default=True, help="proposals per step")
@click.option("--prompt-lookup-max", default=4, show_default=True)
@click.option("--prompt-lookup-min", default=2, show_default=True)
@click.option("--runs", default=3, show_default=True, help="generations per workload and side (median reported)")
@click.option("--repeats", default=10, show_default=True, help="timed repeats per forward-pass size")
@click.option("--json", "json_path", default=None, help="write every figure to this file")
def main(model, max_tokens, k, prompt_lookup_max, prompt_lookup_min, runs, repeats, json_path):
    from refengine.tokenizer import Tokenizer

    warning = busy_warning()
    if warning:
        click.echo(warning)
    model = str(resolve_model_dir(model))
    tok = Tokenizer.from_pretrained(model)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": prompt_lookup_max,
            "prompt_lookup_min": prompt_lookup_min}
    report = {"speculative_config": spec, "max_tokens": max_tokens, "environment": environment(), "workloads": {}}
    rows = []
    engines = {"off": build(model, None), "on": build(model, spec)}
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
    click.echo(format_table(["workload", "prompt", "tokens", "off tok/s", "n-gram tok/s", "speed-up",
                             "acceptance", "mean acc. len", "same output"], rows))
    del engines
    ids = tok.encode(WORKLOADS["grounded"])
    fwd = forward_times(model, ids, (1, 2, 4, 6, 8), repeats)
    report["forward_s_by_rows"] = fwd
    click.echo(f"\none forward pass after {len(ids)} context tokens (median of {repeats}):")
    click.echo(format_table(["rows", "ms", "x 1 row"], [[n, 1e3 * t, t / fwd[1]] for n, t in fwd.items()]))
    if json_path:
        write_json(json_path, report)
        click.echo(f"wrote {json_path}")


if __name__ == "__main__":
    main()
