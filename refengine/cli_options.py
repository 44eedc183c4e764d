"""The flags every ``refengine`` command shares, and the engine they build.

Engine flags are generated from :class:`refengine.engine_args.EngineArgs` (vLLM's names),
sampling flags carry ``SamplingParams``' names. ``refengine generate``/``chat``
(:mod:`refengine.cli`), ``refengine bench`` (:mod:`refengine.bench.cli`) and ``refengine
serve`` (:mod:`refengine.server.cli`) all import them from here, so none of those imports
another. Errors end the command with one ``Error:`` line naming the flag as typed.
"""

from __future__ import annotations

import logging
import re
import sys

import click

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
    try:
        args = EngineArgs.from_cli(kw)
    except ValueError as e:
        fail(str(e))
    return engine_from_args(args)


def engine_from_args(args: EngineArgs):
    """The engine of ``args`` (:meth:`LLMEngine.from_engine_args` with the CPU runtime set
    up). A bad setting ends the command with its message and exit status 2; a missing
    device or library with 1."""
    from refengine.engine import LLMEngine

    try:  # on the CPU with the process-wide settings of refengine.runtime.setup_cpu_runtime
        return LLMEngine.from_engine_args(args, setup_runtime=True)
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
