"""The README's commands, in the README's order, in a fresh environment.

A new virtual environment gets refengine installed from this checkout the way a user's
``pip install`` would (a wheel, not editable, with the ``plot`` and ``serve`` extras that
``make run`` installs, and without the test extras: no torch). Then every command of the
README's Quick start block runs as written, except that ``.venv/bin/`` is the fresh
environment's and the placeholder GGUF file is the default model's. The one command that
needs an extra the environment lacks (``--compare-transformers`` needs torch) must end with
a one-line error naming the extra. Finally the README's Python example runs from another
directory.

The wheel is conftest's ``refengine_wheel``, the one test_wheel.py checks. The commands run
as a returning user's do, with numba's kernels compiled: the fresh install gets the
checkout's compiled kernels (numba's cache is filed by the source files' paths but checked
against their contents, which are the same; ``installs.share_numba_cache``), and the kernels
the commands compile go back to the checkout. A new user's first run, which compiles them in
the installed copy, says so once and leaves them for the next process, is test_wheel.py's
``test_installed_wheel_runs_outside_the_checkout``; compiling each kernel again here (the
GGUF Q4_1 products alone take minutes of CPU) would check nothing more.

Each command runs on one core (:func:`one_core`), as a returning user's on a one-core
machine would: the same outputs, without the parallel kernels' warm-up in every process.

This takes minutes, and must: a new environment with its dependencies, and eight commands
and the example, each a new process that loads the model and warms its engine up (the
perplexity command runs two engines over four 512-token windows).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.installs import share_numba_cache

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def quick_start_commands() -> list[str]:
    """The lines of the README's first ``sh`` block after "Then, with the virtual environment's"."""
    after = README.split("Then, with the virtual environment's", 1)[1]
    block = re.search(r"```sh\n(.*?)```", after, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def python_example() -> str:
    return re.search(r"```python\n(.*?)```", README, re.S).group(1)


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory, refengine_wheel) -> Path:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]  # as `make run`
    # not from the checkout: `python -m` puts the working directory first on sys.path
    subprocess.run(pip + [f"{refengine_wheel}[plot,serve]"], check=True, cwd=tmp_path_factory.getbasetemp())
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                          capture_output=True, text=True).stdout.strip()
    installed = Path(site) / "refengine"
    share_numba_cache(ROOT / "refengine", installed)
    yield venv
    share_numba_cache(installed, ROOT / "refengine")


@contextlib.contextmanager
def one_core():
    """Child processes started inside the block run on one of this process's cores: its
    engines then see one usable core and warm up only the serial kernels; the commands and
    their outputs are the same (the bits do not depend on the thread count: batch
    invariance), and the suite's other worker keeps the other core.

    Linux's affinity (``sched_setaffinity(0, ...)``) is the calling thread's, and a child
    inherits its parent thread's: only this thread is pinned meanwhile, and no Python runs
    between fork and exec (as ``preexec_fn`` would, unsafe with other threads alive)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def test_readme_commands_in_order(fresh_env, smollm2_dir, gguf_path, tmp_path):
    env = {**os.environ, "REFENGINE_MODEL": str(smollm2_dir), "REFENGINE_CACHE_DIR": str(tmp_path / "cache")}
    commands = quick_start_commands()
    assert [c.split()[1] for c in commands] == ["generate", "generate", "generate", "chat", "bench", "generate",
                                                "eval", "convert-gguf"]
    for command in commands:
        command = command.replace("weights/SmolLM2-135M-Instruct.Q4_1.gguf", str(gguf_path))
        argv = shlex.split(command.replace(".venv/bin/", f"{fresh_env}/bin/"))
        if argv[1] == "convert-gguf":
            argv[2:4] = [str(gguf_path), str(tmp_path / "converted")]
        stdin = "Hi\n/exit\n" if argv[1] == "chat" else None
        with one_core():
            res = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=tmp_path, env=env,
                                 timeout=600)
        out = res.stdout + res.stderr
        assert "Traceback" not in out, (command, out)
        if "--compare-transformers" in argv:  # torch is a test extra: the one-line message names it
            errors = [line for line in out.splitlines() if line.startswith("Error:")]
            assert res.returncode != 0 and len(errors) == 1 and "refengine[compare]" in errors[0], (command, out)
        else:
            assert res.returncode == 0, (command, out)
    assert (tmp_path / "converted" / "model.safetensors").is_file()


def test_readme_python_example_from_another_directory(fresh_env, smollm2_dir, tmp_path):
    env = {**os.environ, "REFENGINE_MODEL": str(smollm2_dir), "REFENGINE_CACHE_DIR": str(tmp_path / "cache")}
    with one_core():
        res = subprocess.run([str(fresh_env / "bin" / "python"), "-c", python_example()], capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
