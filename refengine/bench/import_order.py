"""``refengine bench import-order``: the same workload in fresh processes that imported
different libraries before refengine.

Speed must not depend on what a process imported first (issue 20): a script that compares
against transformers imports torch before refengine, and a second OpenMP runtime, or a
BLAS whose thread settings were read when NumPy loaded, must not slow the engine down. So
each case runs the same workload in its own fresh subprocess (``sys.executable``), one
after the other, never two at once:

* ``fresh``: nothing imported before refengine;
* ``numpy first``: ``import numpy`` first;
* ``torch + transformers first``: ``import torch, transformers`` first (skipped, with a
  note, when either is not installed).

In each process the engine is built through :class:`refengine.LLM` (which calls
:func:`refengine.cpu.setup_cpu_runtime`) from the engine flags; two small warm-up
requests run (:func:`refengine.bench.driver.warm_up`), then the workload all at once
(closed loop, :func:`refengine.bench.driver.run_engine`): ``--num-prompts`` requests
with seeded prompt and output lengths cut from the bench corpus, greedy, EOS ignored.
The figure is output tokens/s; each case's ratio is to ``fresh`` (medians over
``--repeats`` rounds; a round runs every case once, in the order above, so slow drift of
the machine reaches every case alike).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import click

from refengine.bench.options import LenRange, engine_kwargs, output_path, performance_md_option
from refengine.bench.report import busy_warning, environment, format_table, write_json, write_performance
from refengine.cli_options import engine_options, fail

#: case id (``--cases``) -> (its name in tables, the statements its process runs before
#: importing refengine, the modules those need).
CASES = {
    "fresh": ("fresh", "", ()),
    "numpy": ("numpy first", "import numpy", ("numpy",)),
    "torch": ("torch + transformers first", "import torch, transformers", ("torch", "transformers")),
}
#: The marker before the child's one JSON line on stdout (anything else printed is ignored).
RESULT_MARK = "IMPORT-ORDER-RESULT "
#: The child: the case's imports first, then refengine; argv[1] is the job as JSON.
CHILD = """{preamble}
import json, sys
from refengine.bench.import_order import child_main
print({mark!r} + json.dumps(child_main(json.loads(sys.argv[1]))), flush=True)
"""


def child_main(job: dict) -> dict:
    """The timed part of one case, in its own process: build ``LLM(**job["engine_kwargs"])``,
    warm up, run the seeded workload; return output tokens/s and what the process had loaded."""
    from refengine import LLM
    from refengine.bench.driver import run_engine, warm_up
    from refengine.bench.workload import load_corpus, sample_requests
    from refengine.cpu.threads import numba_threading_layer

    loaded_first = [m for m in ("torch", "transformers") if m in sys.modules]
    llm = LLM(**job["engine_kwargs"])
    engine = llm.llm_engine
    corpus_ids = llm.get_tokenizer().encode(load_corpus(job["data_dir"]))
    requests = sample_requests(corpus_ids, job["num_prompts"], tuple(job["input_len"]), tuple(job["output_len"]),
                               job["seed"])
    warm_up(engine, corpus_ids)
    run = run_engine(engine, requests, label=job["case"], progress=False)
    try:
        from threadpoolctl import threadpool_info

        pools = [{k: lib.get(k) for k in ("internal_api", "num_threads", "filepath")} for lib in threadpool_info()]
        for pool in pools:
            pool["filepath"] = os.path.basename(pool["filepath"] or "")
    except Exception:  # noqa: BLE001 - a probe must never fail the benchmark
        pools = None
    return {"case": job["case"], "output_throughput": run.output_throughput,
            "total_token_throughput": run.total_token_throughput, "elapsed_s": run.elapsed_s,
            "total_output_tokens": run.total_output_tokens, "loaded_before_refengine": loaded_first,
            "numba_threading_layer": numba_threading_layer() if "numba" in sys.modules else None,
            "thread_pools": pools}


def run_case(case: str, job: dict, timeout_s: float) -> dict:
    """One case in a fresh subprocess; its result dict.

    Raises:
        click.ClickException: the process failed or timed out (its stderr's end in the message).
    """
    _, preamble, _ = CASES[case]
    code = CHILD.format(preamble=preamble, mark=RESULT_MARK)
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parent.parent.parent)  # this refengine, not another
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    try:
        res = subprocess.run([sys.executable, "-c", code, json.dumps({**job, "case": case})], capture_output=True,
                             text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"the {CASES[case][0]!r} process ran past {timeout_s:.0f} s") from None
    lines = [line for line in res.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if res.returncode != 0 or not lines:
        raise click.ClickException(f"the {CASES[case][0]!r} process failed (exit {res.returncode}): "
                                   f"{res.stderr.strip()[-2000:]}")
    return json.loads(lines[-1][len(RESULT_MARK):])


def available_cases(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """``(cases to run, {skipped case: why})``: a case whose libraries are not installed is skipped."""
    run, skipped = [], {}
    for name in names:
        missing = [m for m in CASES[name][2] if importlib.util.find_spec(m) is None]
        if missing:
            skipped[name] = f"skipped: {' and '.join(missing)} not installed"
        else:
            run.append(name)
    return run, skipped


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    """Per case: median output tokens/s over its rounds, every round's figure, the ratio to ``fresh``."""
    medians = {case: statistics.median(r["output_throughput"] for r in rs) for case, rs in results.items()}
    base = medians.get("fresh")
    return [{"case": case, "output_throughput": medians[case],
             "output_throughput_all": [r["output_throughput"] for r in rs],
             "ratio_to_fresh": medians[case] / base if base else None} for case, rs in results.items()]


def _cases(ctx, param, value: str) -> list[str]:
    names = [c.strip() for c in value.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        raise click.BadParameter(f"{value!r}: give one or more of {', '.join(CASES)}", ctx, param)
    return names


@click.command("import-order")
@click.option("--num-prompts", type=click.IntRange(min=1), default=32, show_default=True, help="Number of requests.")
@click.option("--input-len", type=LenRange(), default="16-256", show_default=True,
              help="Prompt length in tokens: N, or LO-HI for seeded uniform lengths.")
@click.option("--output-len", type=LenRange(), default="16-96", show_default=True,
              help="Output length in tokens: N, or LO-HI (EOS ignored).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Workload seed.")
@click.option("--dataset-dir", type=click.Path(exists=True, file_okay=False), default=None,
              show_default="the corpus shipped with refengine.bench", help="Directory of .txt files to cut prompts from.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rounds; each runs every case once, in turn (medians reported).")
@click.option("--cases", default=",".join(CASES), show_default=True, callback=_cases,
              help="Comma-separated cases to run, in this order: fresh (nothing imported first), numpy "
                   "(import numpy first), torch (import torch, transformers first).")
@click.option("--case-timeout", type=click.FloatRange(min=1), default=1800.0, show_default=True,
              help="Seconds one case's process may take.")
@click.option("--json", "json_path", default=None, callback=output_path, show_default="none",
              help="Write every figure and each process's thread pools here.")
@performance_md_option
@engine_options
def import_order_cmd(num_prompts, input_len, output_len, seed, dataset_dir, repeats, cases, case_timeout, json_path,
                     performance_md, **kw):
    """The same workload in fresh processes that imported nothing, NumPy, or torch and
    transformers before refengine: output tokens/s and the ratio to the fresh process."""
    _, engine_kw = engine_kwargs(kw)
    if engine_kw["max_model_len"] is None:  # as the other scenarios: the workload's longest request
        need = input_len[1] + output_len[1]
        engine_kw["max_model_len"] = -(-need // engine_kw["block_size"]) * engine_kw["block_size"]
    warning = busy_warning()
    if warning:
        click.echo(warning)
    to_run, skipped = available_cases(cases)
    if "fresh" not in to_run:
        fail("--cases must include 'fresh': every ratio is to it")
    job = {"engine_kwargs": engine_kw, "num_prompts": num_prompts, "input_len": list(input_len),
           "output_len": list(output_len), "seed": seed, "data_dir": dataset_dir}
    results: dict[str, list[dict]] = {case: [] for case in to_run}
    for i in range(repeats):
        for case in to_run:
            r = run_case(case, job, case_timeout)
            results[case].append(r)
            click.echo(f"round {i + 1}/{repeats}, {CASES[case][0]}: {r['output_throughput']:.2f} output tok/s")
    summary = summarize(results)
    rows = [[CASES[s["case"]][0], CASES[s["case"]][1] or "-", s["output_throughput"],
             "-" if s["ratio_to_fresh"] is None else f"x{s['ratio_to_fresh']:.2f}",
             ", ".join(f"{x:.1f}" for x in s["output_throughput_all"])] for s in summary]
    rows += [[CASES[case][0], CASES[case][1], None, "-", why] for case, why in skipped.items()]
    table = (["case", "imported first", "output tok/s", "vs fresh", "rounds"], rows)
    click.echo(format_table(*table))
    for case, why in skipped.items():
        click.echo(f"{CASES[case][0]}: {why}")
    if json_path:
        write_json(json_path, {"scenario": "import-order", "workload": job, "repeats": repeats, "cases": summary,
                               "skipped": skipped, "runs": results, "environment": environment()})
        click.echo(f"wrote {json_path}")

    def span(lo_hi):
        return str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}-{lo_hi[1]}"

    write_performance(performance_md, "bench import-order", [
        f"{num_prompts} requests, prompts of {span(input_len)} tokens, outputs of {span(output_len)} tokens "
        f"(greedy, EOS ignored, seed {seed}), all at once after a warm-up, each case in its own fresh process, "
        f"one after the other; median of {repeats} round(s). Speed must not depend on what was imported first.",
        table], echo=click.echo)
