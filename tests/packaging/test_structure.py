"""The package's shape: no import cycles, and no process-wide change at import.

The import graph counts every ``import`` statement in ``refengine/``, those inside functions
too: a cycle hidden behind a lazy import is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "refengine"


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module of refengine it imports: line}. ``from pkg import name`` counts as
    an import of ``pkg.name`` when that is a module, else of ``pkg``."""
    modules = package_modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "refengine.runtime.threads" in graph["refengine.model_runner"]
    cycle = find_cycle(graph)
    where = [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle:\n" + "\n".join(where)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) is None


def test_the_leaves_import_nothing_above_them():
    """``refengine.runtime`` is the bottom layer: the kernels and the engine import it, never
    the other way round. The command modules import their shared flags from
    ``refengine.cli_options``, which imports none of them; ``config`` imports nothing."""
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("refengine.runtime"):
            assert all(m.startswith("refengine.runtime") for m in imports), (module, imports)
    commands = ("refengine.cli", "refengine.bench", "refengine.server")  # the command modules share cli_options
    assert not [m for m in graph["refengine.cli_options"] if m.startswith(commands)], graph["refengine.cli_options"]
    assert graph["refengine.config"] == {}, graph["refengine.config"]  # plain data


IMPORT_EVERYTHING = """
import json, os, sys
before = dict(os.environ)
import refengine
from refengine import LLM, LLMEngine, SamplingParams
import refengine.cli, refengine.engine, refengine.ops.numba_ops, refengine.attention.numba_cpu
import refengine.attention.selector, refengine.server.cli, refengine.bench.cli, refengine.metrics
from refengine.runtime import is_set_up, malloc, threads
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
par = sys.modules.get("numba.np.ufunc.parallel")
print(json.dumps({"changed": changed, "set_up": is_set_up(), "malloc": malloc._applied,
                  "numba_started": bool(par and par._is_initialized)}))
"""


def test_importing_refengine_changes_nothing_process_wide():
    """No environment variable, no thread pool started, no allocator setting: importing any
    module (the kernels included) leaves the process as it was; only the explicit
    ``setup_cpu_runtime`` makes those settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS", "GOMP", "OMP_"))}
    res = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"changed": [], "set_up": False, "malloc": False, "numba_started": False}, got


BUILD_ENGINES = """
import json, os, sys
import threadpoolctl  # sets KMP_DUPLICATE_LIB_OK as it loads (its guard for two Intel OpenMP runtimes): not ours
before = dict(os.environ)
from refengine import LLMEngine
from refengine.runtime import is_set_up, malloc
engine = LLMEngine(sys.argv[1], max_model_len=64, log_stats=False)  # the numba backend, the CPU default
after_engine = {"changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)),
                "set_up": is_set_up(), "malloc": malloc._applied}
from refengine import LLM
LLM(sys.argv[1], max_model_len=64, log_stats=False)
print(json.dumps({"engine": after_engine, "llm": {"set_up": is_set_up(), "malloc": malloc._applied,
                  "env_restored": dict(os.environ) == before}}))
"""


def test_an_engine_is_built_without_the_process_wide_set_up(tiny_llama_dir):
    """``LLMEngine(...)`` leaves the environment and the allocator alone (only its thread
    counts are set); ``LLM(...)`` makes the explicit set-up, which leaves no variable set.
    (threadpoolctl, which sizes the BLAS pool, sets one variable of its own as it is first
    imported; the test imports it before looking.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS", "GOMP", "OMP_", "MALLOC_"))}
    res = subprocess.run([sys.executable, "-c", BUILD_ENGINES, str(tiny_llama_dir)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    glibc = __import__("platform").libc_ver()[0] == "glibc"
    assert got == {"engine": {"changed": [], "set_up": False, "malloc": False},
                   "llm": {"set_up": True, "malloc": glibc, "env_restored": True}}, got
