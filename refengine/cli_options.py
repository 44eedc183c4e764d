"""The flags every ``refengine`` command shares, and the engine they build.

Engine flags are generated from :class:`refengine.engine_args.EngineArgs` (vLLM's names),
sampling flags from the declaration of each :class:`refengine.sampling_params.SamplingParams`
field that has one (its ``Flag``). ``refengine generate``/``chat``
(:mod:`refengine.cli`), ``refengine bench`` (:mod:`refengine.bench.cli`) and ``refengine
serve`` (:mod:`refengine.server.cli`) all import them from here, so none of those imports
another. Errors end the command with one ``Error:`` line naming the flag as typed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys

import click

from refengine.engine_args import EngineArgs
from refengine.sampling_params import FIELD_DEFAULT, SamplingParams
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
    engine_flags = [f for f in dataclasses.fields(EngineArgs) if f.metadata["cli"] and not f.metadata["flag"]]
    return {f.name: "--" + f.name.replace("_", "-") for f in engine_flags + flag_fields()}


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


#: A sampling field's annotation -> (the click type of its flag, whether the flag repeats).
_FLAG_TYPES = {"int": (int, False), "int | None": (int, False), "float": (float, False),
               "list[int] | None": (TokenIds(), False), "list[str] | str | None": (TEXT, True)}


def flag_fields(params_class: type = SamplingParams) -> list[dataclasses.Field]:
    """The fields of ``params_class`` that declare a command-line flag
    (:class:`refengine.sampling_params.Flag`), in declaration order."""
    return [f for f in dataclasses.fields(params_class) if f.metadata.get("flag")]


def sampling_options(f, params_class: type = SamplingParams):
    """Decorate a command with one flag per sampling parameter that declares one: ``--top-p``
    for ``top_p``, with the declaration's help and default; the command receives them as
    keyword arguments named as the fields, which :func:`build_params` takes back.

    Raises:
        KeyError: a field whose annotation (text, as ``from __future__ import annotations``
            leaves it) has no flag type in :data:`_FLAG_TYPES`.
    """
    for fld in reversed(flag_fields(params_class)):
        flag = fld.metadata["flag"]
        name = "--" + fld.name.replace("_", "-")
        default = fld.default if flag.default == FIELD_DEFAULT else flag.default
        if fld.type == "bool" and not default:  # a switch: on when given
            option = click.option(name, fld.name, is_flag=True, show_default=flag.show_default or "off",
                                  help=flag.help)
        elif fld.type == "bool":  # on by default: --no-... turns it off
            option = click.option(f"{name}/--no-{name[2:]}", fld.name, default=True, show_default=True,
                                  help=flag.help)
        else:
            type_, multiple = _FLAG_TYPES[fld.type]
            option = click.option(name, fld.name, type=type_, multiple=multiple, default=default,
                                  show_default=flag.show_default or ("none" if default is None else True),
                                  help=flag.help)
        f = option(f)
    return f


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
    from refengine.core.engine import LLMEngine

    try:  # on the CPU with the process-wide settings of refengine.cpu.setup_cpu_runtime
        return LLMEngine.from_engine_args(args, setup_runtime=True)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except (RuntimeError, ImportError) as e:
        fail(str(e), exit_code=1)


def build_params(kw: dict, params_class: type = SamplingParams) -> SamplingParams:
    """The command's sampling flags (:func:`sampling_options`) as ``SamplingParams``; a
    repeatable flag given no times is None.

    Raises:
        ValueError: an invalid value (the message names the field).
    """
    values = {f.name: kw[f.name] for f in flag_fields(params_class)}
    return params_class(**{k: (list(v) or None) if isinstance(v, tuple) else v for k, v in values.items()})


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
