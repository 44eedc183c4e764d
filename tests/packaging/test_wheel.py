"""The wheel is whole: besides the Python files it carries the CUDA kernel and emulator
sources and the benchmark corpus, and refengine installed from it (not editable) runs
from outside the checkout, the emulated CUDA kernels included.

The wheel (conftest's ``refengine_wheel``, the one test_readme.py installs too) is built from
a copy of the checkout's files (tracked and untracked-but-not-ignored, as a fresh clone would
have them), so a stale ``build/`` cannot leak into it.

This takes minutes, and must: building and installing a wheel, and an installed package
compiles its numba kernels afresh (numba's cache is keyed by the source files' paths, so the
checkout's compiled kernels do not carry over; that the installed copy runs is the point).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from refengine import LLM, SamplingParams, resources
from refengine.bench.workload import load_corpus
from refengine.kernels.build import EMULATION_SUPPORT, KERNEL_SOURCES, SELF_TEST_SOURCES
from tests.packaging.installs import pip

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(3, 40)), [5, 9, 17]]  # 37 and 3 tokens: block edges at 8
# chunked prefill mixed with decodes; one numba thread and a context of 64 tokens (the
# longest sequence is 45), so an installed copy's first engine compiles only the serial
# kernels its warm-up and these steps use: that it compiles, says so and caches, is the point,
# not how many (the tokens do not depend on the thread count: batch invariance)
ENGINE_KW = dict(block_size=8, max_num_batched_tokens=24, max_model_len=64, num_threads=1, log_stats=False)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def site_dir(refengine_wheel, tmp_path_factory) -> Path:
    """The wheel installed (not editable) into a directory of its own."""
    site = tmp_path_factory.mktemp("site")
    pip("install", "--no-deps", "--no-index", "--target", str(site), str(refengine_wheel))
    return site


def test_wheel_has_kernel_emulator_and_corpus_files(refengine_wheel):
    names = set(zipfile.ZipFile(refengine_wheel).namelist())
    cuda = [p.name for p in sorted((ROOT / "cuda").iterdir())
            if p.suffix in (".cu", ".cuh") or p.name in ("cuda_emu.h", "emu_runtime.cpp", "README.md")]
    # the checkout's files and every file the CUDA backend reads
    for name in {*cuda, *KERNEL_SOURCES, *SELF_TEST_SOURCES, *EMULATION_SUPPORT}:
        assert f"refengine/cuda_src/{name}" in names, name
    assert len(cuda) >= 12 and {"flash_prefill.cu", "paged_decode.cu", "emu_runtime.cpp"} <= set(cuda)
    corpus = [p.name for p in sorted((ROOT / "refengine" / "bench" / "data").glob("*.txt"))]
    assert corpus == ["alice_opening.txt", "stdlib_docs.txt"]
    for name in [*corpus, "README.md"]:
        assert f"refengine/bench/data/{name}" in names, name
    for init in (ROOT / "refengine").rglob("__init__.py"):  # every package
        assert init.relative_to(ROOT).as_posix() in names, init
    assert not [n for n in names if "/build/" in n or n.endswith((".so", ".o", ".pyc"))]


def test_resources_in_the_checkout(monkeypatch, tmp_path):
    assert resources.cuda_source_dir() == ROOT / "cuda"
    assert resources.bench_data_dir() == ROOT / "refengine" / "bench" / "data"
    monkeypatch.setenv("REFENGINE_CACHE_DIR", str(tmp_path / "c"))
    assert resources.build_cache_dir() == tmp_path / "c"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("REFENGINE_CACHE_DIR", "")  # empty counts as unset
    assert resources.build_cache_dir() == tmp_path / ".cache" / "refengine"
    monkeypatch.delenv("REFENGINE_CACHE_DIR")
    assert resources.build_cache_dir() == tmp_path / ".cache" / "refengine"


def run_installed(site_dir: Path, model: Path, backend: str | None, cwd: Path) -> dict:
    """Greedy generation and resource lookups in a fresh interpreter that sees only the
    installed copy of refengine (cwd outside the checkout, a cache directory of its own)."""
    script = """
import json, sys
import refengine
from refengine import LLM, SamplingParams
from refengine.bench.workload import load_corpus
from refengine.resources import bench_data_dir, build_cache_dir, cuda_source_dir

backend = sys.argv[2] or None
llm = LLM(sys.argv[1], attention_backend=backend, **json.loads(sys.argv[3]))
params = SamplingParams(max_tokens=int(sys.argv[5]), temperature=0.0, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[4]), params, use_tqdm=False)
from refengine.cpu import numba_support
print(json.dumps({"file": refengine.__file__, "cuda_dir": str(cuda_source_dir()), "data_dir": str(bench_data_dir()),
                  "cache_dir": str(build_cache_dir()), "corpus": load_corpus(),
                  "tokens": [o.outputs[0].token_ids for o in outs],
                  "kernels_compiled": numba_support.kernel_cache_misses(), "kernel_cache": numba_support.kernel_cache_dirs()}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REFENGINE_CACHE_DIR", "NUMBA_CACHE_DIR")}
    env.update(PYTHONPATH=str(site_dir), REFENGINE_CACHE_DIR=str(cwd / "cache"))
    r = subprocess.run([sys.executable, "-c", script, str(model), backend or "", json.dumps(ENGINE_KW),
                        json.dumps(PROMPTS), str(MAX_TOKENS)], capture_output=True, text=True, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    got["stderr"] = r.stderr
    return got


@pytest.fixture(scope="module")
def checkout_tokens(tiny_llama_dir) -> list[list[int]]:
    """The same generation through the checkout's refengine (NumPy attention), in this process."""
    llm = LLM(tiny_llama_dir, attention_backend="numpy", **ENGINE_KW)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_installed_wheel_runs_outside_the_checkout(site_dir, tiny_llama_dir, checkout_tokens, tmp_path):
    got = run_installed(site_dir, tiny_llama_dir, None, tmp_path)
    assert Path(got["file"]).is_relative_to(site_dir)
    assert Path(got["cuda_dir"]) == site_dir / "refengine" / "cuda_src"
    assert Path(got["data_dir"]) == site_dir / "refengine" / "bench" / "data"
    assert Path(got["cache_dir"]) == tmp_path / "cache"
    assert got["corpus"] == load_corpus() and len(got["corpus"]) > 20_000
    assert got["tokens"] == checkout_tokens and [len(t) for t in got["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    # the numba kernels: compiled at the first engine's start, said once, cached beside the installed package...
    assert got["kernels_compiled"] > 0 and "numba CPU kernels in" in got["stderr"]
    assert all(Path(d).is_relative_to(site_dir) for d in got["kernel_cache"].split(", "))
    # ... and loaded from there by the next process, silently
    again = run_installed(site_dir, tiny_llama_dir, None, tmp_path)
    assert again["kernels_compiled"] == 0 and "numba CPU kernels in" not in again["stderr"]
    assert again["tokens"] == checkout_tokens


def test_installed_wheel_runs_the_emulated_kernels(site_dir, tiny_llama_dir, checkout_tokens, tmp_path):
    """Emulated CUDA kernels agree token for token with the default backend (both must equal the
    checkout's NumPy run); the emulator is built from the wheel's sources into
    $REFENGINE_CACHE_DIR, never next to them."""
    got = run_installed(site_dir, tiny_llama_dir, "cuda-emulated", tmp_path)
    assert Path(got["file"]).is_relative_to(site_dir)
    assert got["tokens"] == checkout_tokens
    assert list((tmp_path / "cache").rglob("*.so")), "no emulator library in the cache directory"
    assert not [p for p in (site_dir / "refengine").rglob("*") if p.suffix in (".so", ".o")]
