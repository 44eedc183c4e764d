"""The ``refengine`` command line: generate, chat, convert-gguf, bench, serve, eval, compare.

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
import statistics
import sys
import time

import click
from jinja2 import TemplateError

from refengine import __version__
from refengine.bench.cli import bench
from refengine.cli_options import (LOG_LEVELS, TEXT, engine_options, fail, flag_names, log_level_option,
                                   require_tokenizer, sampling_options, setup, setup_logging)
from refengine.compare import compare_cmd
from refengine.eval.cli import eval_group
from refengine.sampling_params import SamplingParams
from refengine.server.cli import serve
from refengine.text import check_unicode

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
    """The top-level group: every error ends in one ``Error:`` line (see the module docstring)."""

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
    """refengine: a readable LLM inference engine (numba kernels on the CPU, CuPy + CUDA on NVIDIA GPUs)."""
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
    from refengine.formats.convert_gguf import convert_gguf

    try:
        path = convert_gguf(gguf_file, out_dir)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    click.echo(f"wrote {path}")


main.add_command(bench)
main.add_command(serve)
main.add_command(eval_group)
main.add_command(compare_cmd)

if __name__ == "__main__":
    main()
