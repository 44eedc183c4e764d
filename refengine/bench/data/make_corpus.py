"""Write ``stdlib_docs.txt``: English prose for benchmark prompts, from Python's own stdlib.

Sources, all under the Python Software Foundation License (the text ships with every
CPython): the Zen of Python (``this``, stored ROT13-encoded in the module and decoded
here) and the docstrings of a fixed list of standard-library modules, their public
classes and functions. Only docstrings of at least 200 characters are kept (short ones
are mostly signatures). The output is deterministic for a given Python version; the
committed file was made with CPython 3.11.

    python refengine/bench/data/make_corpus.py     # rewrites refengine/bench/data/stdlib_docs.txt
"""

from __future__ import annotations

import codecs
import importlib
import inspect
import pathlib
import sys

MODULES = [
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum",
    "fractions", "functools", "heapq", "hashlib", "html", "http", "inspect", "io",
    "itertools", "json", "logging", "math", "operator", "os", "pathlib", "pickle",
    "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string",
    "subprocess", "tempfile", "textwrap", "threading", "time", "timeit", "typing",
    "unittest", "urllib", "uuid", "warnings", "weakref", "zipfile",
]
MIN_CHARS = 200
TARGET_BYTES = 40_000


def zen_of_python() -> str:
    """The Zen of Python, decoded from the ROT13 string stored in the ``this`` module."""
    import io
    import contextlib

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13")


def docstrings(module_name: str):
    """Yield the module's docstring, then those of its public classes and functions, in name order."""
    mod = importlib.import_module(module_name)
    if mod.__doc__:
        yield mod.__doc__
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = getattr(mod, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == module_name:
            if obj.__doc__:
                yield obj.__doc__


def build() -> str:
    parts = [zen_of_python().strip()]
    size = len(parts[0])
    for module_name in MODULES:
        for doc in docstrings(module_name):
            doc = inspect.cleandoc(doc)
            if len(doc) < MIN_CHARS:
                continue
            parts.append(doc)
            size += len(doc) + 2
            if size >= TARGET_BYTES:
                return "\n\n".join(parts) + "\n"
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("stdlib_docs.txt")
    text = build()
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.encode())} bytes) with Python {sys.version.split()[0]}", file=sys.stderr)
