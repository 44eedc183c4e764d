"""The click pieces every ``refengine bench`` command shares: length ranges, output files,
``--performance-md``, and the engine built from the engine flags with their errors as one line.

Kept apart from :mod:`refengine.bench.cli`, which registers the commands, so that a
command's own module (``serve``, ``spec``, ``prefix-cache``, ``kernels``, ``import-order``)
and ``benchmarks/bench_single.py`` can use them without importing the group.
"""

from __future__ import annotations

import dataclasses
import os

import click

from refengine.bench.driver import build_llm
from refengine.bench.workload import parse_len_range
from refengine.cli_options import fail
from refengine.engine_args import EngineArgs, resolve_model_dir


class LenRange(click.ParamType):
    """A length flag: ``N`` or ``LO-HI`` (see :func:`parse_len_range`) -> ``(lo, hi)``."""

    name = "N|LO-HI"

    def convert(self, value, param, ctx):
        try:
            return parse_len_range(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def output_path(ctx, param, value):
    """An output file's directory must exist, so a run is not lost at its very end."""
    if value is not None:
        parent = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(parent):
            raise click.BadParameter(f"the directory {parent!r} does not exist", ctx, param)
    return value


#: ``--performance-md PATH``: the run's table as one section of a Markdown file
#: (:func:`refengine.bench.report.write_performance`); off unless given.
performance_md_option = click.option(
    "--performance-md", "performance_md", default=None, callback=output_path, metavar="PATH", show_default="off",
    help="Write this run's table, with the date, commit, CPU and its measured bandwidth and FLOP/s, as a "
         "section of this Markdown file (docs/PERFORMANCE.md); a section of the same title is replaced.")


def engine_kwargs(kw: dict) -> tuple[EngineArgs, dict]:
    """The engine flags (taken out of ``kw``) as ``EngineArgs`` and as ``LLMEngine`` keyword
    arguments (model directory resolved); a bad value ends the command with its message."""
    try:
        args = EngineArgs.from_cli(kw)
    except ValueError as e:
        fail(str(e))
    engine_kw = dataclasses.asdict(args)
    try:
        engine_kw["model"] = str(resolve_model_dir(engine_kw["model"], engine_kw.pop("gguf_file")))
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    return args, engine_kw


def build_llm_or_fail(engine_kw: dict):
    """:func:`build_llm`, with bad engine settings ending the command with their message (as ``generate``)."""
    try:
        return build_llm(engine_kw)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except (RuntimeError, ImportError) as e:
        fail(str(e), exit_code=1)
