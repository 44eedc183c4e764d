"""Where refengine's non-Python files are, in a source checkout and in an installed wheel alike.

A checkout (and an editable install, ``pip install -e .``) keeps the CUDA sources at the
top of the repository in ``cuda/``; a wheel carries the same files inside the package as
``refengine/cuda_src/`` (setup.py maps the one onto the other). The benchmark corpus is
package data in both: ``refengine/bench/data/``. Build outputs never go next to the
sources, since an installed package's directory may be read-only.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CACHE_DIR_ENV = "REFENGINE_CACHE_DIR"
# A file every copy of the CUDA sources has: tells a real source directory from a stray one.
_CUDA_MARKER = "cuda_emu.h"


def cuda_source_dir() -> Path:
    """The directory of the CUDA kernels (``*.cu``, ``*.cuh``) and the CPU emulator's sources
    (``cuda_emu.h``, ``emu_runtime.cpp``).

    Returns:
        ``refengine/cuda_src/`` of an installed wheel, else ``cuda/`` of the source
        checkout this package runs from (editable install or plain checkout).

    Raises:
        FileNotFoundError: neither holds the sources (a broken install).
    """
    candidates = (PACKAGE_DIR / "cuda_src", PACKAGE_DIR.parent / "cuda")
    for candidate in candidates:
        if (candidate / _CUDA_MARKER).is_file():
            return candidate
    raise FileNotFoundError(f"refengine's CUDA sources are missing: no {_CUDA_MARKER} in "
                            f"{' or '.join(str(c) for c in candidates)}; reinstall refengine")


def bench_data_dir() -> Path:
    """The directory of the benchmark corpus (``*.txt``, with its README): ``refengine/bench/data/``.

    Raises:
        FileNotFoundError: the directory is missing (a broken install).
    """
    path = PACKAGE_DIR / "bench" / "data"
    if not path.is_dir():
        raise FileNotFoundError(f"refengine's benchmark corpus is missing: {path} is not a directory; "
                                "reinstall refengine")
    return path


def build_cache_dir() -> Path:
    """Where build outputs go (the g++-built emulator library, compiled objects).

    Returns:
        ``$REFENGINE_CACHE_DIR`` if set and not empty, else ``~/.cache/refengine``, as an
        absolute path. It is not created here: whoever writes into it does.

    Raises:
        RuntimeError: the home directory cannot be determined and ``$REFENGINE_CACHE_DIR``
            is not set (from ``Path.expanduser``).
    """
    env = os.environ.get(CACHE_DIR_ENV)
    path = Path(env).expanduser() if env else Path("~/.cache/refengine").expanduser()
    return path.absolute()
