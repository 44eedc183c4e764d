"""Helpers of the tests that install refengine: a clone-like copy of the checkout, pip, and
numba's compiled kernels shared between two copies of the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_checkout(dest: Path) -> None:
    """The checkout's files as a clone has them: git's tracked and untracked-not-ignored files
    (symlinks, such as linked weights, left out); without git, a copy minus build outputs."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "weights", "*.so", "*.o"))
        return
    for name in out.decode().split("\0"):
        src = ROOT / name
        if not name or src.is_symlink() or not src.is_file():  # deleted but not yet staged, or a link
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)


def pip(*args: str, python: str = sys.executable) -> None:
    """``python -m pip ARGS``, offline and quiet; fails the test with pip's output."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    r = subprocess.run([python, "-m", "pip", *args, "-q"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"pip {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


def share_numba_cache(src: Path, dst: Path) -> int:
    """Copy numba's compiled kernels from one copy of the ``refengine`` package folder to
    another: every index (``__pycache__/NAME.nbi``) that ``dst`` lacks, with its data files
    (``NAME.N.nbc``). Returns how many indexes were copied.

    numba files a kernel under its source file's folder (``__pycache__`` beside it), so an
    installed copy never finds the checkout's kernels by itself; but each index holds a hash
    of the source file's contents, and numba ignores an index whose hash is not the file's,
    so a kernel compiled from one copy is the same kernel for the other. Data files go first
    and each file lands whole (written beside, then renamed), so a process reading ``dst``
    meanwhile sees either no index or a complete one.
    """
    copied = 0
    for index in sorted(src.rglob("__pycache__/*.nbi")):
        target = dst / index.relative_to(src)
        if target.exists() or not target.parent.parent.is_dir():  # dst has its own, or not that package
            continue
        target.parent.mkdir(exist_ok=True)
        for f in [*sorted(index.parent.glob(index.name[:-len("nbi")] + "*.nbc")), index]:
            tmp = target.parent / (f.name + f".tmp.{os.getpid()}")
            shutil.copyfile(f, tmp)
            os.replace(tmp, target.parent / f.name)
        copied += 1
    return copied
