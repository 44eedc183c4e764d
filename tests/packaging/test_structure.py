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
    assert len(graph) > 50 and "refengine.core.executor" in graph["refengine.core.engine"]  # a lazy import counts
    cycle = find_cycle(graph)
    where = [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle:\n" + "\n".join(where)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) is None


def test_the_leaves_import_nothing_above_them():
    """The CPU runtime (``refengine.cpu``'s threads, blas, malloc, numba_support) is the bottom
    layer: the kernels import it, never the other way round. The command modules import their
    shared flags from ``refengine.cli_options``, which imports none of them; ``config`` imports nothing."""
    graph = import_graph()
    runtime = {f"refengine.cpu.{m}" for m in ("threads", "blas", "malloc", "numba_support")}
    for module in runtime:
        assert set(graph[module]) <= runtime, (module, graph[module])
    commands = ("refengine.cli", "refengine.bench", "refengine.server")  # the command modules share cli_options
    assert not [m for m in graph["refengine.cli_options"] if m.startswith(commands)], graph["refengine.cli_options"]
    assert graph["refengine.config"] == {}, graph["refengine.config"]  # plain data


def package_of(module: str) -> str:
    """The node of a module in the package graph: ``refengine.x`` for every module under
    ``refengine/x/``; a top-level module (``refengine.engine_args``) is its own node."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """Package -> {package it imports: one ``module -> module (line)`` that does}, from the
    module graph (lazy imports included); a package's imports of itself are left out."""
    packages: dict[str, dict[str, str]] = {package_of(m): {} for m in graph}
    for module, imports in graph.items():
        for target, line in imports.items():
            a, b = package_of(module), package_of(target)
            if a != b and not module.startswith(target + "."):  # a package's __init__ is imported with it
                packages[a].setdefault(b, f"{module} -> {target} (line {line})")
    return packages


def test_no_import_loop_between_packages():
    """No package imports a package that imports it back, directly or around a loop: the layers
    (core loop -> models -> ops / attention -> CPU wing -> quant) read top to bottom."""
    packages = package_graph(import_graph())
    assert {"refengine.core", "refengine.cpu", "refengine.ops", "refengine.attention"} <= set(packages)
    cycle = find_cycle(packages)
    where = [packages[a][b] for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import loop between packages:\n" + "\n".join(where)


def test_the_package_check_finds_a_loop():
    """The package graph joins modules into their packages, so a loop only visible at that level is found."""
    modules = {"refengine.core.engine": {"refengine.models.llama": 3}, "refengine.models.llama": {"refengine.ops": 5},
               "refengine.ops": {}, "refengine.ops.numba_decode": {"refengine.core.model_runner": 7},
               "refengine.core.model_runner": {}}
    assert find_cycle(modules) is None  # no loop between modules
    packages = package_graph(modules)
    assert find_cycle(packages) == ["refengine.core", "refengine.models", "refengine.ops", "refengine.core"]
    del modules["refengine.ops.numba_decode"]
    assert find_cycle(package_graph(modules)) is None


CORE = "refengine.core"
CPU_WING = ("refengine.cpu", "numba", "llvmlite")


def imports_of(path: Path) -> set[str]:
    """Every module name an ``import`` statement of ``path`` names (inside functions too),
    absolute: ``from a.b import c`` gives ``a.b`` and ``a.b.c``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def core_reaches_cpu_wing(modules: dict[str, Path], graph: dict[str, dict[str, int]], core: str = CORE) -> list[str]:
    """``core module -> [module it imports ->] CPU wing module`` for each import of the CPU wing
    (``refengine.cpu``, numba, llvmlite) by a core loop module or by a module it imports directly."""
    def wing(names):
        return sorted(n for n in names if n.startswith(tuple(w + "." for w in CPU_WING)) or n in CPU_WING)

    found = []
    for module in sorted(m for m in modules if m == core or m.startswith(core + ".")):
        found += [f"{module} -> {w}" for w in wing(imports_of(modules[module]))]
        for step in sorted(graph[module]):
            found += [f"{module} -> {step} -> {w}" for w in wing(imports_of(modules[step]))]
    return found


def test_the_core_loop_imports_no_cpu_wing():
    """The core loop (engine, scheduler, block manager, sequence, model runner, executor) reaches
    the CPU wing only through ``LayerOps`` and ``AttentionBackend``: neither it nor a module it
    imports directly imports ``refengine.cpu`` or numba."""
    modules = package_modules()
    assert {"refengine.core.engine", "refengine.core.model_runner", "refengine.core.scheduler"} <= set(modules)
    found = core_reaches_cpu_wing(modules, import_graph())
    assert not found, "the core loop reaches the CPU wing:\n" + "\n".join(found)


def test_the_core_check_finds_an_import(tmp_path):
    """The check sees an import of the CPU wing by a core module and by a module one step away."""
    files = {"refengine.core.engine": "from refengine.ops import get_layer_ops\n",
             "refengine.ops": "def f():\n    from refengine.cpu.layer_ops import NumbaOps\n"}
    modules = {}
    for name, text in files.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    graph = {"refengine.core.engine": {"refengine.ops": 1}, "refengine.ops": {}}
    assert core_reaches_cpu_wing(modules, graph) == ["refengine.core.engine -> refengine.ops -> refengine.cpu.layer_ops",
                                                     "refengine.core.engine -> refengine.ops -> refengine.cpu.layer_ops.NumbaOps"]
    modules["refengine.ops"].write_text("import numpy\n")
    assert core_reaches_cpu_wing(modules, graph) == []


IMPORT_EVERYTHING = """
import json, os, sys
before = dict(os.environ)
import refengine
from refengine import LLM, LLMEngine, SamplingParams
import refengine.cli, refengine.core.engine, refengine.cpu.layer_ops, refengine.cpu.attention
import refengine.attention.selector, refengine.server.cli, refengine.bench.cli, refengine.metrics
from refengine.cpu import is_set_up, malloc, threads
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
from refengine.cpu import is_set_up, malloc
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
