"""``refengine eval``: the click group, and ``refengine eval perplexity``.

``perplexity`` takes the engine flags of ``refengine generate`` (same names, same
defaults: :func:`refengine.cli_options.engine_options`), so ``--quantization`` and
``--kv-cache-dtype`` come with them wherever :class:`refengine.engine_args.EngineArgs`
has those options. Errors end the command with one ``Error:`` line (exit status 2).
"""

from __future__ import annotations

import dataclasses
import json
import time

import click

from refengine.attention.kv_cache import cdiv
from refengine.cli_options import engine_from_args, engine_options, fail
from refengine.engine_args import EngineArgs
from refengine.eval.perplexity import compare, load_text, perplexity, tokenize

#: What ``--baseline`` alone changes in the run's engine options: float32, and the
#: quantization, KV-cache and activation options at their defaults (where EngineArgs has them).
BASELINE_RESET = ("quantization", "kv_cache_dtype", "activation_dtype")


def default_baseline() -> dict:
    """The overrides of the default baseline: ``dtype="float32"`` and every option of
    :data:`BASELINE_RESET` that :class:`EngineArgs` has, at its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    return {"dtype": "float32", **{name: defaults[name] for name in BASELINE_RESET if name in defaults}}


def parse_baseline(spec: str) -> dict:
    """``--baseline CONFIG`` -> engine options to override in the run's own.

    CONFIG is ``default`` (:func:`default_baseline`), a JSON object of ``EngineArgs``
    fields (``{"dtype": "float32", "model": "weights/other"}``), or ``key=value`` pairs
    separated by commas (``quantization=none,kv_cache_dtype=auto``; dashes in keys read as
    underscores). A value is kept as text when it is one of the option's choices, else
    ``none``/``null`` is None, ``true``/``false`` a bool, then an int, a float, or text.

    Raises:
        ValueError: not a JSON object, or a pair without ``=``.
    """
    spec = spec.strip()
    if spec in ("", "default"):
        return default_baseline()
    if spec.startswith("{"):
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--baseline {spec!r} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--baseline {spec!r} must be a JSON object of engine options")
        return value
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    out = {}
    for pair in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, text = pair.partition("=")
        if not eq:
            raise ValueError(f"--baseline: {pair!r} is not key=value (e.g. dtype=float32,kv_cache_dtype=auto)")
        key = key.strip().lstrip("-").replace("-", "_")
        out[key] = _value(fields.get(key), text.strip())
    return out


def _value(fld, text: str):
    choices = fld.metadata.get("choices") if fld is not None else None
    if choices and text in choices:
        return text
    if text.lower() in ("none", "null"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@click.group("eval")
def eval_group():
    """Measure the model's predictions through the engine (perplexity, KL divergence to a baseline)."""


@eval_group.command("perplexity")
@click.option("--ctx", type=click.IntRange(min=3), default=512, show_default=True,
              help="tokens per window; the second half of each window is scored (llama.cpp's -c)")
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False), default=None,
              show_default="the corpus shipped with refengine.bench", help="UTF-8 text to score")
@click.option("--baseline", "baseline_spec", is_flag=False, flag_value="default", default=None, metavar="[CONFIG]",
              show_default="none",
              help="also run a baseline engine and print dPPL, KL(baseline||model) and top-1 agreement. "
                   "Alone: these engine options with --dtype float32 and --quantization/--kv-cache-dtype at their "
                   "defaults; CONFIG: the options to change instead, key=value,key=value or a JSON object "
                   "(e.g. kv_cache_dtype=auto)")
@click.option("--max-windows", type=click.IntRange(min=1), default=None, show_default="all",
              help="score only the first N windows (llama.cpp's --chunks)")
@click.option("--json", "as_json", is_flag=True, show_default="off", help="print one JSON object instead of text")
@click.option("--disable-tqdm", is_flag=True, show_default="off",
              help="no progress bar (there is none anyway when stderr is not a terminal)")
@engine_options
def perplexity_cmd(ctx, path, baseline_spec, max_windows, as_json, disable_tqdm, **kw):
    """Perplexity of the model over a text, as llama.cpp's perplexity tool computes it.

    The text is cut into windows of --ctx tokens; each runs through the engine's prefill and
    the second half of each is scored. With --baseline, the same windows run through a
    second engine too. The KV pool holds one window unless --num-kv-blocks is given.
    See docs/evaluation.md.
    """
    try:
        args = EngineArgs.from_cli(kw)
        if args.num_kv_blocks is None:  # one sequence at a time: a pool of one window (two engines fit a GPU)
            args = dataclasses.replace(args, num_kv_blocks=cdiv(max(ctx, args.max_model_len or 0), args.block_size))
        overrides = parse_baseline(baseline_spec) if baseline_spec is not None else None
        base_args = (EngineArgs.from_kwargs(**{**dataclasses.asdict(args), **overrides})
                     if overrides is not None else None)
        text = load_text(path)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    engine = engine_from_args(args)
    baseline = engine_from_args(base_args) if base_args is not None else None
    try:
        ids = tokenize(engine, text)
        start = time.perf_counter()
        if baseline is None:
            result = perplexity(engine, ids, ctx, max_windows=max_windows, progress=not disable_tqdm)
        else:
            result = compare(engine, baseline, ids, ctx, max_windows=max_windows, progress=not disable_tqdm)
        elapsed = time.perf_counter() - start
    except ValueError as e:
        fail(str(e))
    model = result if baseline is None else result.model
    config = {"model": str(engine.model_dir), "text": path or "refengine/bench/data/*.txt",
              "num_text_tokens": len(ids), "ctx": ctx, "engine_args": dataclasses.asdict(args)}
    if baseline is not None:
        config.update(baseline_model=str(baseline.model_dir), baseline_overrides=overrides,
                      baseline_engine_args=dataclasses.asdict(base_args))
    if as_json:
        click.echo(json.dumps({"config": config, **result.to_dict()}))
    else:
        click.echo(f"model {config['model']}, ctx {ctx}: {model.num_windows} windows of the text's {len(ids)} tokens, "
                   f"{model.num_tokens} tokens scored (the second half of each window)")
        click.echo(f"PPL = {model.ppl:.4f} +/- {model.ppl_stderr:.4f}   (mean NLL {model.mean_nll:.5f} nats/token)")
        if baseline is not None:
            click.echo(report_lines(result, overrides))
    processed = model.num_windows * ctx * (1 if baseline is None else 2)
    click.echo(f"{elapsed:.1f} s ({processed / elapsed:.0f} window tokens/s through "
               f"{'the engine' if baseline is None else 'both engines'})", err=True)


def report_lines(result, overrides: dict) -> str:
    """The baseline comparison as text lines."""
    described = ",".join(f"{k}={v}" for k, v in overrides.items()) or "the same options"
    lines = [f"baseline ({described}): PPL = {result.baseline.ppl:.4f} +/- {result.baseline.ppl_stderr:.4f}",
             f"dPPL = {result.delta_ppl:+.4f} ({result.delta_ppl_pct:+.3f} %)",
             f"KLD(baseline || model), nats: mean {result.kld_mean:.6f}, median {result.kld_median:.6f}, "
             f"99th percentile {result.kld_p99:.6f}, max {result.kld_max:.6f}",
             "mean KLD by position (quarters of the scored half): " + ", ".join(
                 f"tokens {lo}-{hi}: {m:.6f}" for (lo, hi), m in zip(result.quarters(), result.kld_by_quarter)
                 if lo >= 0),
             f"top-1 agreement: {100 * result.top1_agreement:.2f} % of {result.model.num_tokens} positions"]
    return "\n".join(lines)
