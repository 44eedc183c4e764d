"""``refengine bench invariance``: what batch-invariant logits cost, measured side by side.

The same model twice in one run, ``batch_invariant=True`` (the CPU default: the numba dot
kernels and the flash attention kernel for every row) and ``False`` (BLAS products for
long chunks and large batches, the paged decode kernel), alternating round by round so a
change in the machine's load hits both alike. Per round and mode, on a fresh engine with
the prefix cache off:

* **prefill**: the wall time of one ``--prompt-len``-token prompt with ``max_tokens=1``;
* **decode b1**: tokens per second after the first of one request of ``--output-len`` tokens
  (from the request's metrics, ``finished_time - first_token_time``);
* **throughput**: ``--num-prompts`` requests of ``--input-len`` prompt tokens and
  ``--output-len`` output tokens submitted at once; generated tokens per second of wall time.

Prompts are cut from the bench corpus (:func:`refengine.bench.workload.load_corpus`).
Medians over ``--repeats`` rounds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

from refengine.bench.options import engine_kwargs, performance_md_option
from refengine.bench.report import busy_warning, format_table, write_performance
from refengine.cli_options import engine_options, fail

MODES = (("invariant", True), ("not invariant", False))


def _measure(engine_kw: dict, ids: list[int], prompt_len: int, num_prompts: int, input_len: int,
             output_len: int) -> dict:
    """One round of one mode: ``{"prefill_s", "decode_tok_s", "throughput_tok_s"}``."""
    from refengine import LLM, SamplingParams

    llm = LLM(**engine_kw)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([ids[:64]], greedy, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([ids[:prompt_len]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    prefill = time.perf_counter() - t0
    req = llm.generate([ids[:input_len]], SamplingParams(max_tokens=output_len + 1, temperature=0.0,
                                                         ignore_eos=True), use_tqdm=False)[0]
    decode = req.metrics.finished_time - req.metrics.first_token_time
    prompts = [ids[i * 7:i * 7 + input_len] for i in range(num_prompts)]  # distinct, overlapping cuts
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prefill_s": prefill, "decode_tok_s": output_len / max(decode, 1e-9),
            "throughput_tok_s": generated / wall}


@click.command("invariance")
@click.option("--prompt-len", type=click.IntRange(min=2), default=512, show_default=True,
              help="Prompt tokens of the prefill measurement.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests of the throughput measurement.")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt tokens per request (throughput and decode b1).")
@click.option("--output-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="Output tokens per request (EOS ignored).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Rounds (medians reported).")
@performance_md_option
@engine_options
def invariance_cmd(prompt_len, num_prompts, input_len, output_len, repeats, performance_md, **kw):
    """Batch-invariant logits against the faster non-invariant kernels: prefill, decode and throughput."""
    from refengine.bench.workload import load_corpus
    from refengine.core.engine import load_tokenizer

    args, engine_kw = engine_kwargs(kw)
    if args.batch_invariant is not None:
        fail("bench invariance sets batch_invariant itself (both ways); drop --batch-invariant/--no-batch-invariant")
    engine_kw["enable_prefix_caching"] = False  # every timed prompt is computed
    try:
        model_dir, model_config = args.model_config()
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    tokenizer = load_tokenizer(model_dir, model_config.vocab_size)
    if tokenizer is None:
        fail(f"{model_dir} has no tokenizer: bench invariance cuts its prompts from the bench corpus's text")
    ids = tokenizer.encode(load_corpus())
    need = max(prompt_len, input_len + 7 * (num_prompts - 1))
    if len(ids) < need:
        fail(f"the bench corpus has {len(ids)} tokens, fewer than the {need} this workload cuts from it")
    results = {name: [] for name, _ in MODES}
    for r in range(repeats):
        for name, flag in MODES:
            warn = busy_warning()
            if warn:
                click.echo(warn)
            res = _measure(dict(engine_kw, batch_invariant=flag), ids, prompt_len, num_prompts, input_len,
                           output_len)
            results[name].append(res)
            click.echo(f"round {r + 1}/{repeats} {name}: prefill {res['prefill_s']:.3f} s, decode b1 "
                       f"{res['decode_tok_s']:.1f} tok/s, throughput {res['throughput_tok_s']:.1f} tok/s")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in results.items()}
    base = med["not invariant"]
    rows = []
    for name, _ in MODES:
        m = med[name]
        rows.append([name, f"{m['prefill_s']:.3f}", f"{m['decode_tok_s']:.1f}", f"{m['throughput_tok_s']:.1f}",
                     f"{m['prefill_s'] / base['prefill_s']:.2f}x", f"{m['throughput_tok_s'] / base['throughput_tok_s']:.2f}x"])
    headers = ["mode", f"prefill {prompt_len} (s)", "decode b1 (tok/s)", "throughput (tok/s)",
               "prefill time vs not", "throughput vs not"]
    click.echo(format_table(headers, rows))
    model = engine_kw["model"]
    body = [f"`batch_invariant` on and off, alternating in one run, medians of {repeats} rounds, prefix cache off. "
            f"Prefill: one {prompt_len}-token prompt; decode b1: {output_len} tokens after a {input_len}-token "
            f"prompt; throughput: {num_prompts} requests of {input_len} + {output_len} tokens at once. "
            f"Model: `{Path(model).name}`.", (headers, rows)]
    name = Path(model).name
    title = "bench invariance" if args.model is None else f"bench invariance: {name}"
    write_performance(performance_md, title, body, echo=click.echo)
