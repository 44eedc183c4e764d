"""The ``refengine`` command line: generate, chat, convert-gguf, bench.

Engine flags carry vLLM's names (``--max-model-len``, ``--block-size``,
``--max-num-seqs``, ``--max-num-batched-tokens`` ...), sampling flags
``SamplingParams``' names.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import click

from refengine.engine_args import EngineArgs
from refengine.sampling_params import SamplingParams


def engine_options(f):
    """Decorate a command with the engine flags, generated from :class:`EngineArgs`'s fields."""
    return EngineArgs.cli_options(f)


def sampling_options(f):
    options = [
        click.option("--max-tokens", type=int, default=256, show_default=True),
        click.option("--min-tokens", type=int, default=0, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="0 is greedy (the CLI's default, so runs are reproducible)"),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 or -1: off"),
        click.option("--min-p", type=float, default=0.0, show_default=True),
        click.option("--seed", type=int, default=None),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
        click.option("--stop", multiple=True, help="stop string (repeatable)"),
        click.option("--stop-token-ids", default="", help="comma-separated token ids"),
        click.option("--ignore-eos", is_flag=True),
        click.option("--include-stop-str-in-output", is_flag=True),
        click.option("--logprobs", type=int, default=None),
    ]
    for option in reversed(options):
        f = option(f)
    return f


SAMPLING_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "include_stop_str_in_output", "logprobs")


def build_engine(kw: dict):
    """The engine of a command's flags (engine flags are taken out of ``kw``).

    Raises:
        ValueError: an invalid value or combination; FileNotFoundError: no model.
    """
    from refengine.engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs.from_cli(kw))


def build_params(kw: dict) -> SamplingParams:
    try:
        ids = [int(t) for t in kw["stop_token_ids"].split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--stop-token-ids {kw['stop_token_ids']!r} must be comma-separated integers") from None
    return SamplingParams(stop=list(kw["stop"]) or None, stop_token_ids=ids, **{k: kw[k] for k in SAMPLING_KEYS})


def setup(kw: dict):
    """(engine, params) from the command's flags; bad values end the command with the message."""
    try:
        params = build_params(kw)
        return build_engine(kw), params
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        fail(str(e))


def require_tokenizer(engine):
    if engine.tokenizer is None:
        fail(f"{engine.model_dir} has no tokenizer.json: text prompts need one")
    return engine.tokenizer


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def fail(message: str):
    raise click.ClickException(message)


@click.group()
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Python logging level (stderr)")
def main(log_level: str):
    """refengine: a readable LLM inference engine (NumPy on the CPU, CuPy + CUDA on NVIDIA GPUs)."""
    setup_logging(log_level)


@main.command()
@click.argument("prompts", nargs=-1, required=True)
@click.option("--chat", is_flag=True, help="wrap each prompt in the model's chat template as a user message")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per prompt instead of streaming")
@engine_options
@sampling_options
def generate(prompts, chat, as_json, **kw):
    """Generate text for PROMPTS (one prompt streams; several run as one batch)."""
    engine, params = setup(kw)
    tok = require_tokenizer(engine)
    # a chat prompt is tokenized as rendered: the template writes its own special tokens
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True) if chat else p
             for p in prompts]
    try:
        for i, text in enumerate(texts):
            engine.add_request(str(i), text, params)
    except ValueError as e:
        fail(str(e))
    stream = len(texts) == 1 and not as_json
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
    for i in range(len(texts)):
        out = finished[str(i)]
        c = out.outputs[0]
        m = out.metrics
        if as_json:
            click.echo(json.dumps({
                "prompt": prompts[i], "text": c.text, "prompt_token_ids": out.prompt_token_ids,
                "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "metrics": m.summary(), "logprobs": c.logprobs,
            }))
        elif not stream:
            click.echo(f"--- [{i}] {prompts[i]!r}\n{c.text}")
    m = finished["0"].metrics
    total_out = sum(len(o.outputs[0].token_ids) for o in finished.values())
    decode_tps = (m.num_output_tokens - 1) / m.decode_time if m.decode_time else float("nan")
    click.echo(f"prompt tokens: {sum(len(o.prompt_token_ids) for o in finished.values())}, "
               f"output tokens: {total_out}, TTFT: {m.ttft * 1e3:.1f} ms, "
               f"decode: {decode_tps:.1f} tokens/s, total: {elapsed:.2f} s", err=True)


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
@click.option("--system", default=None, help="system prompt (default: the template's own)")
@engine_options
@sampling_options
def chat(system, **kw):
    """Chat with the model: streaming answers, history kept; /reset clears it, /exit leaves.

    Ctrl-C stops the current answer without leaving.
    """
    engine, params = setup(kw)
    tok = require_tokenizer(engine)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    click.echo("refengine chat: /reset clears the history, /exit leaves, Ctrl-C stops an answer.", err=True)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
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

        try:
            chat_turn(engine, tok, history, rid, params, on_delta=show)
        except ValueError as e:
            history.pop()
            click.echo(f"error: {e}", err=True)
            continue
        except KeyboardInterrupt:
            engine.abort(rid)
            click.echo(" [stopped]", nl=False)
        click.echo()
        history.append({"role": "assistant", "content": "".join(answer)})


@main.command("convert-gguf")
@click.argument("gguf_file", type=click.Path(dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def convert_gguf_cmd(gguf_file, out_dir):
    """Convert a llama GGUF file into a Hugging Face model directory (float32 safetensors)."""
    from refengine.convert_gguf import convert_gguf

    try:
        path = convert_gguf(gguf_file, out_dir)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    click.echo(f"wrote {path}")


def _register_bench() -> None:
    from refengine.bench import bench

    main.add_command(bench)


_register_bench()

if __name__ == "__main__":
    main()
