"""The ``refengine`` command line: generate, chat, convert-gguf, bench.

Engine flags carry vLLM's names (``--max-model-len``, ``--block-size``,
``--max-num-seqs``, ``--max-num-batched-tokens`` ...), sampling flags
``SamplingParams``' names.

Errors: a bad flag value, a bad model directory or a prompt that cannot run ends the
command with one line, ``Error: <message>`` on stderr, naming the flag as typed
(``--top-p``, not ``SamplingParams.top_p``), and exit status 2; no usage block, no
traceback. A missing optional dependency or device (CuPy, torch, matplotlib) exits with 1.

Text: command-line text (prompts, ``--stop``, ``--system``) and ``chat``'s input must be
UTF-8; bytes that are not are refused with the position of the first bad byte (not
replaced: a prompt silently changed would give answers to a question nobody asked). In
``chat`` such a line is refused and the session and its history go on.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import sys
import time

import click
from jinja2 import TemplateError

from refengine import __version__
from refengine.engine_args import EngineArgs
from refengine.sampling_params import SamplingParams
from refengine.text import check_unicode

LOG_LEVELS = ("debug", "info", "warning", "error")


class CliError(click.ClickException):
    """A user error: printed as one ``Error:`` line, exit status 2 (as click's usage errors)."""

    exit_code = 2


def fail(message: str, exit_code: int = 2):
    """End the command with ``Error: <message>`` (flag names for Python names) and ``exit_code``."""
    error = CliError(flag_names(message))
    error.exit_code = exit_code
    raise error


# --- Python names -> the flags the user typed ------------------------------------------------

def _flag_table() -> dict[str, str]:
    """Python option/field name -> flag, for every engine and sampling flag."""
    import dataclasses

    flags = {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineArgs)
             if f.metadata["cli"] and not f.metadata["flag"]}
    flags.update({name: "--" + name.replace("_", "-") for name in (*SAMPLING_KEYS, "stop", "stop_token_ids")})
    return flags


def flag_names(message: str) -> str:
    """``message`` with the Python names of options and fields written as the flags
    (``SamplingParams.top_p=1.5`` -> ``--top-p=1.5``, ``enable_chunked_prefill=False`` ->
    ``--no-enable-chunked-prefill``, ``raise kv_cache_memory`` -> ``raise --kv-cache-memory``).

    Names with an underscore are replaced wherever they stand as a word; one-word names
    (``device``, ``seed``) only as ``name=`` or ``SamplingParams.name``, where they cannot
    be plain English.
    """
    table = _flag_table()

    def replace(m: re.Match) -> str:
        name, value = m.group("name"), m.group("value")
        flag = table[name]
        if value in ("=True", "=False"):
            return flag if value == "=True" else "--no-" + flag[2:]
        return flag + (value or "")

    names = "|".join(sorted(map(re.escape, table), key=len, reverse=True))
    pattern = rf"(?<![\w.'/-])(?:SamplingParams\.)?(?P<name>{names})(?:(?P<value>=True\b|=False\b|=)|(?![\w'/-]))"

    def maybe(m: re.Match) -> str:
        whole = m.group(0)
        if "_" in m.group("name") or whole.startswith("SamplingParams.") or m.group("value"):
            return replace(m)
        return whole

    return re.sub(pattern, maybe, message)


# --- option types ----------------------------------------------------------------------------

class Utf8Text(click.ParamType):
    """Command-line text that must be valid UTF-8 (see the module docstring)."""

    name = "text"

    def convert(self, value, param, ctx):
        try:
            check_unicode(value, repr(value))
        except ValueError as e:
            self.fail(f"{e} (refengine reads command-line text as UTF-8)", param, ctx)
        return value


class IntList(click.ParamType):
    """Comma-separated integers (``"2,13"``) -> ``list[int]``."""

    name = "n,n,..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return [int(t) for t in value.split(",") if t.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)


class TokenIds(IntList):
    """Comma-separated token ids (``"2,13"``) -> ``list[int]``."""

    name = "ids"


TEXT = Utf8Text()


def _set_log_level(ctx, param, value):
    if value is not None:
        setup_logging(value)
    return value


log_level_option = click.option(
    "--log-level", type=click.Choice(LOG_LEVELS), default=None, expose_value=False, is_eager=True,
    callback=_set_log_level, show_default="warning",
    help="Python logging level on stderr (also accepted before the command)")


def engine_options(f):
    """Decorate a command with the engine flags, generated from :class:`EngineArgs`'s fields,
    and ``--log-level`` (so it works after the command name too)."""
    return log_level_option(EngineArgs.cli_options(f))


def sampling_options(f):
    options = [
        click.option("--max-tokens", type=int, default=256, show_default=True,
                     help="most tokens to generate per answer (also capped by --max-model-len)"),
        click.option("--min-tokens", type=int, default=0, show_default=True,
                     help="generate at least this many tokens: EOS and --stop-token-ids are ignored until then"),
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="softmax temperature, >= 0; 0 is greedy (the CLI's default, so runs are reproducible)"),
        click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="sample from the smallest set of tokens whose probabilities sum to this, in (0, 1]"),
        click.option("--top-k", type=int, default=0, show_default=True,
                     help="sample from the k most likely tokens (0 or -1: off)"),
        click.option("--min-p", type=float, default=0.0, show_default=True,
                     help="drop tokens less likely than this times the most likely one, in [0, 1]"),
        click.option("--seed", type=int, default=None, show_default="fresh entropy",
                     help="seed of the sampler's random generator, in [0, 2**64 - 1]"),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     help="subtracted from the logit of every token already generated, in [-2, 2]"),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     help="subtracted per earlier occurrence of a token in the output, in [-2, 2]"),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                     help="divides the logits of tokens in the prompt or output, > 0 (1 is off)"),
        click.option("--stop", type=TEXT, multiple=True, show_default="none",
                     help="a string that ends the answer (repeatable)"),
        click.option("--stop-token-ids", type=TokenIds(), default="", show_default="none",
                     help="comma-separated token ids that end the answer"),
        click.option("--ignore-eos", is_flag=True, show_default="off", help="keep generating past EOS"),
        click.option("--include-stop-str-in-output", is_flag=True, show_default="off",
                     help="keep the matched stop string at the end of the answer"),
        click.option("--logprobs", type=int, default=None, show_default="none",
                     help="with generate --json: the log-probabilities of this many most likely tokens per "
                          "generated token (at most --max-logprobs)"),
    ]
    for option in reversed(options):
        f = option(f)
    return f


SAMPLING_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "include_stop_str_in_output", "logprobs")


def build_engine(kw: dict):
    """The engine of a command's engine flags (taken out of ``kw``). A bad value ends the
    command with its message and exit status 2; a missing device or library with 1."""
    from refengine.engine import LLMEngine

    try:
        args = EngineArgs.from_cli(kw)
    except ValueError as e:
        fail(str(e))
    try:
        return LLMEngine.from_engine_args(args)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except (RuntimeError, ImportError) as e:
        fail(str(e), exit_code=1)


def build_params(kw: dict) -> SamplingParams:
    """The command's sampling flags as ``SamplingParams``.

    Raises:
        ValueError: an invalid value (the message names the field).
    """
    return SamplingParams(stop=list(kw["stop"]) or None, stop_token_ids=kw["stop_token_ids"],
                          **{k: kw[k] for k in SAMPLING_KEYS})


def setup(kw: dict):
    """(engine, params, the --max-model-len given or None) from the command's flags; every
    flag is checked before the model is loaded, and a bad one ends the command."""
    try:
        params = build_params(kw)
    except ValueError as e:
        fail(str(e))
    max_model_len = kw["cli_max_model_len"]
    engine = build_engine(kw)
    try:
        engine.check_sampling_params(params)  # what only the loaded engine knows (vocabulary, limits)
    except ValueError as e:
        fail(str(e))
    return engine, params, max_model_len


def require_tokenizer(engine):
    if engine.tokenizer is None:
        fail(f"{engine.model_dir} has no tokenizer.json: text prompts need one")
    return engine.tokenizer


def setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger().setLevel(getattr(logging, level.upper()))


def length_note(engine, max_model_len_flag: int | None, params: SamplingParams, completion,
                num_prompt_tokens: int) -> str | None:
    """Why a completion was cut, naming the limit as a flag (None if it was not cut).

    ``finish_reason="length"`` is either ``--max-tokens`` or ``max_model_len`` (prompt plus
    output); the latter is the model's context, the user's ``--max-model-len``, or what the
    KV pool holds.
    """
    if completion.finish_reason != "length":
        return None
    if params.max_tokens is not None and len(completion.token_ids) >= params.max_tokens:
        return f"finish_reason=length: the answer reached --max-tokens={params.max_tokens}"
    limit = engine.config.max_model_len
    if max_model_len_flag is not None:
        which = "set by --max-model-len"
    elif limit < engine.model_config.max_position_embeddings:
        which = "what the KV pool holds: raise --kv-cache-memory or --num-kv-blocks"
    else:
        which = "the model's context"
    return (f"finish_reason=length: prompt ({num_prompt_tokens}) + answer ({len(completion.token_ids)}) "
            f"tokens reached max_model_len={limit} ({which})")


def summary_line(outputs: list, elapsed: float) -> str:
    """Totals over every request, and the per-request medians of TTFT and TPOT."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def median_ms(values) -> str:
        values = [v for v in values if v is not None]
        return f"{statistics.median(values) * 1e3:.1f} ms" if values else "n/a"

    return (f"{len(outputs)} request(s): {prompt} prompt + {generated} output tokens in {elapsed:.2f} s "
            f"({generated / elapsed if elapsed > 0 else float('nan'):.1f} output tokens/s); per request, median "
            f"TTFT {median_ms(o.metrics.ttft for o in outputs)}, median TPOT {median_ms(o.metrics.tpot for o in outputs)}")


class _Main(click.Group):
    """The top-level group.

    ``bench`` is imported when it is asked for: its commands are built with this module's
    :func:`engine_options`, so importing it at load time would be circular. Every error
    ends in one ``Error:`` line (see the module docstring).
    """

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), "bench"})

    def get_command(self, ctx, name):
        if name == "bench" and name not in self.commands:
            from refengine.bench import bench

            self.add_command(bench)
        return super().get_command(ctx, name)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:  # click's usage errors too, without their usage block
            message = " ".join(e.format_message().split())
            click.echo(f"Error: {message}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="refengine", message="%(prog)s %(version)s")
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(LOG_LEVELS),
              help="Python logging level on stderr (also accepted after the command)")
def main(log_level: str):
    """refengine: a readable LLM inference engine (NumPy on the CPU, CuPy + CUDA on NVIDIA GPUs)."""
    setup_logging(log_level)


@main.command()
@click.argument("prompts", nargs=-1, required=True, type=TEXT)
@click.option("--chat", is_flag=True, show_default="off",
              help="wrap each prompt in the model's chat template as a user message")
@click.option("--json", "as_json", is_flag=True, show_default="off",
              help="print one JSON object per prompt instead of streaming")
@engine_options
@sampling_options
def generate(prompts, chat, as_json, **kw):
    """Generate text for PROMPTS (one prompt streams; several run as one batch).

    A summary goes to stderr; so does the reason when an answer was cut by a length limit.
    """
    if kw["logprobs"] is not None and not as_json:
        fail("--logprobs needs --json: log-probabilities are printed only in the JSON output")
    engine, params, max_model_len_flag = setup(kw)
    tok = require_tokenizer(engine)
    for i, prompt in enumerate(prompts):
        try:
            # a chat prompt is tokenized as rendered: the template writes its own special tokens
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True) if chat else prompt
            engine.add_request(str(i), text, params)
        except (ValueError, TemplateError) as e:  # a prompt that cannot run, or a template that refuses it
            fail(f"prompt {i + 1}: {e}" if len(prompts) > 1 else str(e))
    stream = len(prompts) == 1 and not as_json
    start = time.monotonic()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream:
                click.echo(out.outputs[0].delta_text, nl=False)
            if out.finished:
                finished[out.request_id] = out
    if stream:
        click.echo()
    elapsed = time.monotonic() - start
    for i in range(len(prompts)):
        out = finished[str(i)]
        c = out.outputs[0]
        if as_json:
            click.echo(json.dumps({
                "prompt": prompts[i], "text": c.text, "prompt_token_ids": out.prompt_token_ids,
                "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "metrics": out.metrics.summary(), "logprobs": c.logprobs,
            }))
        elif not stream:
            click.echo(f"--- [{i}] {prompts[i]!r}\n{c.text}")
        note = length_note(engine, max_model_len_flag, params, c, len(out.prompt_token_ids))
        if note and not as_json:
            click.echo(f"[{note}]" if stream else f"[{i}: {note}]", err=True)
    click.echo(summary_line([finished[str(i)] for i in range(len(prompts))], elapsed), err=True)


def chat_turn(engine, tokenizer, history: list[dict], request_id: str, params: SamplingParams,
              on_delta=None):
    """One turn of ``refengine chat``: the whole conversation so far, rendered with the chat
    template, is the prompt; the answer streams through ``on_delta(text)``.

    With prefix caching the engine computes only what the previous turn did not: the
    rendered history starts with the previous turn's prompt and answer, whose full KV
    blocks are still cached (``RequestOutput.num_cached_tokens`` says how many tokens).

    Args:
        history: ``[{"role": ..., "content": ...}]`` ending with the user's new message.
    Returns:
        The request's final ``RequestOutput``.
    Raises:
        ValueError: the rendered prompt is refused (e.g. longer than ``max_model_len``).
    """
    engine.add_request(request_id, tokenizer.apply_chat_template(history, tokenize=True), params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if on_delta is not None:
                on_delta(out.outputs[0].delta_text)
            if out.request_id == request_id:
                final = out
    logging.getLogger("refengine").info("%s: %d prompt tokens, %s from the prefix cache", request_id,
                                        len(final.prompt_token_ids), final.num_cached_tokens)
    return final


@main.command()
@click.option("--system", type=TEXT, default=None, show_default="the template's own",
              help="system prompt")
@engine_options
@sampling_options
def chat(system, **kw):
    """Chat with the model: streaming answers, history kept; /reset clears it, /exit leaves.

    Ctrl-C stops the current answer without leaving. Input must be UTF-8: a line that is
    not is refused, and the history is kept.
    """
    if kw["logprobs"] is not None:
        fail("--logprobs is not shown by chat: use `refengine generate --json --logprobs N`")
    engine, params, max_model_len_flag = setup(kw)
    tok = require_tokenizer(engine)
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes reach us as lone surrogates, not an exception
        sys.stdin.reconfigure(errors="surrogateescape")
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    click.echo("refengine chat: /reset clears the history, /exit leaves, Ctrl-C stops an answer.", err=True)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        try:
            check_unicode(line, "this line")
        except ValueError as e:
            click.echo(f"error: {e}; it was not sent (the history is kept)", err=True)
            continue
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
            click.echo("(history cleared)", err=True)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        rid = f"chat-{turn}"
        turn += 1
        answer = []

        def show(delta: str) -> None:
            answer.append(delta)
            click.echo(delta, nl=False)

        last = None
        try:
            last = chat_turn(engine, tok, history, rid, params, on_delta=show)
        except (ValueError, TemplateError) as e:  # too long for max_model_len, or refused by the template
            history.pop()
            hint = " (/reset clears the history)" if "max_model_len" in str(e) else ""
            click.echo(f"error: {flag_names(str(e))}{hint}", err=True)
            continue
        except KeyboardInterrupt:
            engine.abort(rid)
            click.echo(" [stopped]", nl=False)
        click.echo()
        history.append({"role": "assistant", "content": "".join(answer)})
        if last is not None and last.finished:
            note = length_note(engine, max_model_len_flag, params, last.outputs[0], len(last.prompt_token_ids))
            if note and "max_model_len" in note:
                note += "; the next turn will not fit: /reset clears the history"
            if note:
                click.echo(f"[{note}]", err=True)


@main.command("convert-gguf")
@click.argument("gguf_file", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@log_level_option
def convert_gguf_cmd(gguf_file, out_dir):
    """Convert a llama GGUF file into a Hugging Face model directory (float32 safetensors)."""
    from refengine.convert_gguf import convert_gguf

    try:
        path = convert_gguf(gguf_file, out_dir)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    click.echo(f"wrote {path}")


def _register_serve() -> None:
    from refengine.server.cli import make_serve_command

    main.add_command(make_serve_command(engine_options, build_engine))


_register_serve()

if __name__ == "__main__":
    main()
