"""The GPU backend's compile step, run here without a GPU.

On a GPU, :class:`refengine.kernels.build.CupyKernels` hands every production kernel file
(:data:`~refengine.kernels.build.KERNEL_SOURCES`), as one translation unit, to NVRTC
through ``cupy.RawModule``; ``benchmarks/gpu_check.py`` compiles the layout self-tests
(:data:`~refengine.kernels.build.SELF_TEST_SOURCES`) as a module of their own. NVRTC is not nvcc: it has no host
headers, its own preprocessor defaults, and no ``cuda_fp16.h`` of its own, so the
``check_nvcc.sh`` step does not prove this one works. NVRTC itself needs no GPU, so this
test loads the library from the ``nvidia-cuda-nvrtc`` wheel (a test extra) with ctypes
and compiles :func:`nvrtc_program`'s source and options, plus the options CuPy adds on its
own (``cupy/cuda/compiler.py``: ``-arch=sm_<cc>`` to get a cubin,
``--device-as-default-execution-space``, ``-ftz=true``), for the H100/H200's sm_90. It
asserts, for each module, that it holds exactly the kernels the CPU emulator's build of the
same sources registers (so CI tests on the CPU the set the GPU gets), that ptxas spills no
registers in any of them, and that the compiler has no warning to give.

Compiling the production module takes minutes of CPU (NVVM and ptxas on ~180 fully unrolled
kernels; flash_prefill.cu's 60 are most of it), so the module's exact source goes only
through NVRTC's front end, and the code generation runs on shares of it
(:func:`kernel_share`: the same source with a quarter of the kernel definitions each), one
test item per share, which pytest-xdist's two workers split between them. Results are kept
on disk (:func:`compile_cached`), so a run over unchanged sources compiles nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest
from filelock import FileLock

from refengine.kernels.build import (KERNEL_SOURCES, SELF_TEST_SOURCES, build_emulation_library, cuda_source_dir,
                                     nvrtc_program)
from refengine.kernels.plans import SUPPORTED_HEAD_DIMS
from refengine.resources import build_cache_dir

ARCH = "sm_90"
CUPY_OPTIONS = (f"-arch={ARCH}", "--device-as-default-execution-space", "-ftz=true")


def _find_nvrtc() -> Path | None:
    """``libnvrtc.so.<major>`` from the ``nvidia-cuda-nvrtc`` wheel (``nvidia/cu<major>/lib``)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        hits = sorted(Path(base).glob("cu*/lib/libnvrtc.so.*"))
        if hits:
            return hits[-1]
    return None


class Nvrtc:
    """The handful of NVRTC C entry points a compile needs (nvrtc.h), through ctypes."""

    def __init__(self, path: Path) -> None:
        lib = self.lib = ctypes.CDLL(str(path))
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: str, options: tuple[str, ...]) -> tuple[bool, str, int]:
        """Compile ``source``; returns (succeeded, the program log, cubin bytes)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"refengine.cu", 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            cubin = ctypes.c_size_t()
            if status == 0:
                self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)), "nvrtcGetCUBINSize")
            return status == 0, log.value.decode(errors="replace"), cubin.value
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


MODULES = {"production": KERNEL_SOURCES, "self-test": SELF_TEST_SOURCES}
# The production module compiles in this many shares, each its own test item, so that the two
# pytest-xdist workers of `make test` split NVVM's and ptxas's minutes between them.
SHARES = {"production": 4, "self-test": 1}
UNITS = [(module, share) for module, count in SHARES.items() for share in range(count)]


def kernel_share(code: str, share: int, count: int) -> str:
    """``code`` with only every ``count``-th kernel definition line kept, from the ``share``-th on.

    Kernels are instantiated by macro calls at the start of a line (``DEFINE_FLASH_PREFILL(...)``).
    All else (templates, helpers, macros, headers) stays in every share, so each kernel is compiled
    in the same program as in the whole module: NVVM and ptxas compile every ``extern "C"``
    entry on its own, so its code and ptxas's report of it do not depend on which other kernels
    are in the program. Every line is in exactly one share of ``count``.
    """
    lines = code.splitlines(keepends=True)
    definitions = [i for i, line in enumerate(lines) if line.startswith("DEFINE_")]
    dropped = {i for k, i in enumerate(definitions) if k % count != share}
    return "".join(line for i, line in enumerate(lines) if i not in dropped)


class Compiled(NamedTuple):
    ok: bool
    log: str
    cubin_bytes: int


def _cache_key(nvrtc: Nvrtc, code: str, options: tuple[str, ...]) -> str:
    """What a compile's result depends on: the compiler, the headers, the source and the options."""
    key = hashlib.sha256(repr((nvrtc.version(), options)).encode())
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-runtime"):  # NVRTC's exact build, the CUDA headers
        try:
            key.update(importlib.metadata.version(dist).encode())
        except importlib.metadata.PackageNotFoundError:
            key.update(b"-")
    for header in sorted(cuda_source_dir().glob("*.cuh")):  # what the sources #include
        key.update(header.name.encode() + b"\0" + header.read_bytes())
    key.update(code.encode())
    return key.hexdigest()[:32]


def compile_cached(nvrtc: Nvrtc, code: str, options: tuple[str, ...]) -> Compiled:
    """:meth:`Nvrtc.compile`, its results kept on disk (``nvrtc/`` in refengine's build cache).

    A result depends only on what :func:`_cache_key` hashes, so a run reuses what an earlier
    one compiled. Under a lock file per key (``filelock``), the two pytest-xdist workers
    never compile the same program twice: the second waits for the first's result.
    """
    path = build_cache_dir() / "nvrtc" / f"{_cache_key(nvrtc, code, options)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if path.exists():
            return Compiled(**json.loads(path.read_text()))
        result = Compiled(*nvrtc.compile(code, options))
        if result.ok:  # a failure is not kept: it is rare, and worth seeing again in full
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result._asdict()))
            tmp.replace(path)
        return result


@pytest.fixture(scope="module")
def nvrtc() -> tuple[Nvrtc, Path]:
    """NVRTC from its wheel and the CUDA include directory it compiles against."""
    path = _find_nvrtc()
    if path is None:
        pytest.skip("NVRTC not installed (pip install -e '.[test]' brings nvidia-cuda-nvrtc)")
    include = path.parents[1] / "include"  # nvidia-cuda-runtime's headers, as CuPy finds them
    if not (include / "cuda_bf16.h").exists():
        pytest.skip(f"no cuda_bf16.h under {include} (pip install nvidia-cuda-runtime)")
    return Nvrtc(path), include


def compile_unit(nvrtc: tuple[Nvrtc, Path], module: str, share: int) -> Compiled:
    """One share of ``module`` compiled for sm_90 as CuPy would compile the whole module."""
    lib, include = nvrtc
    code, options = nvrtc_program(include, MODULES[module])
    options += CUPY_OPTIONS + ("--ptxas-options=-v",)
    if SHARES[module] > 1:
        # A constant used only by kernels of other shares looks unreferenced here (warning 177);
        # the front-end check of the whole module below still sees every warning.
        options += ("--diag-suppress=177",)
    return compile_cached(lib, kernel_share(code, share, SHARES[module]), options)


def compile_module(nvrtc: tuple[Nvrtc, Path], module: str) -> dict[str, str]:
    """Every share of ``module`` compiled: ptxas's report of each kernel (see :func:`_entries`)."""
    entries: dict[str, str] = {}
    for share in range(SHARES[module]):
        compiled = compile_unit(nvrtc, module, share)
        assert compiled.ok, compiled.log
        share_entries = _entries(compiled.log)
        assert not share_entries.keys() & entries.keys(), "a kernel compiled in two shares"
        entries.update(share_entries)
    return entries


def _entries(log: str) -> dict[str, str]:
    """ptxas's report of each entry function: name -> its lines of the log."""
    parts = re.split(r"ptxas info\s*: Compiling entry function '([^']+)' for '[^']+'", log)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


# First in the file: the compiles themselves, one test item per share (pytest-xdist hands them
# out one by one); the tests after them read the shares' results from the cache.
@pytest.mark.parametrize("module,share", UNITS, ids=[f"{m}-{s + 1}of{SHARES[m]}" for m, s in UNITS])
def test_nvrtc_build_spills_no_registers(nvrtc, module, share):
    """Each share compiles for sm_90 without a warning, and ptxas spills no register in any of its kernels."""
    compiled = compile_unit(nvrtc, module, share)
    assert compiled.ok, f"NVRTC {nvrtc[0].version()} failed:\n{compiled.log}"
    assert compiled.cubin_bytes > 0
    assert "warning" not in compiled.log.lower(), compiled.log
    entries = _entries(compiled.log)
    assert entries, "no kernel in this share"
    spilled = {}
    for name, report in entries.items():
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert m, f"no spill line for {name}"
        if int(m.group(1)) or int(m.group(2)):
            spilled[name] = m.group(0)
    assert not spilled, spilled


@pytest.mark.parametrize("module", list(MODULES))
def test_nvrtc_compiles_the_module_as_one_program(nvrtc, module):
    """The exact source and options CuPy hands to NVRTC pass its front end without a warning:
    the files concatenated are one valid program (no helper defined twice), as the shares are."""
    lib, include = nvrtc
    code, options = nvrtc_program(include, MODULES[module])
    compiled = compile_cached(lib, code, options + CUPY_OPTIONS + ("-fdevice-syntax-only",))
    assert compiled.ok, f"NVRTC {lib.version()} failed:\n{compiled.log}"
    assert "warning" not in compiled.log.lower(), compiled.log


@pytest.mark.parametrize("module", list(MODULES))
def test_nvrtc_compiles_every_kernel_for_sm90(nvrtc, module):
    """The shares together hold exactly the kernels the CPU emulator's build of the same sources
    registers, each once."""
    sources = MODULES[module]
    entries = compile_module(nvrtc, module)
    lib = build_emulation_library([cuda_source_dir() / name for name in sources])
    emulated = lib.refengine_emu_list_kernels().decode().split()
    # production: reshape_and_cache (3) + layers (4 x 3 dtypes) + per head dim 3 SIMT prefill,
    # 2 tensor-core prefill, 3 decode and 3 merge kernels; quantized KV caches (int8, fp8e4m3,
    # fp8e5m2 x 3 dtypes): 9 reshape_and_cache + per head dim 9 SIMT prefill and 9 decode kernels;
    # quantized weights (quant_matmul.cu): int8 and int4 GEMV and GEMM x 3 activation dtypes (12)
    expected = {KERNEL_SOURCES: 15 + 11 * len(SUPPORTED_HEAD_DIMS) + 9 + 18 * len(SUPPORTED_HEAD_DIMS) + 12,
                SELF_TEST_SOURCES: 3}[sources]
    assert len(emulated) == expected
    assert sorted(entries) == sorted(emulated)


def test_nvrtc_builds_every_attention_kernel_at_every_head_dim(nvrtc):
    """Every attention kernel at every head dim of :data:`SUPPORTED_HEAD_DIMS` (96 and 256
    included) is in the GPU module, so the spill check covers each of them."""
    entries = compile_module(nvrtc, "production")
    missing = [f"{family}_{tag}_hd{d}" for d in SUPPORTED_HEAD_DIMS
               for family, tags in (("flash_prefill", ("f32", "f16", "bf16")), ("flash_prefill_mma", ("f16", "bf16")),
                                    ("paged_decode", ("f32", "f16", "bf16")),
                                    ("paged_decode_reduce", ("f32", "f16", "bf16")),
                                    *((family, tuple(f"{dt}_{kv}" for dt in ("f32", "f16", "bf16")))
                                      for family in ("flash_prefill", "paged_decode")
                                      for kv in ("int8", "fp8e4m3", "fp8e5m2")))
               for tag in tags if f"{family}_{tag}_hd{d}" not in entries]
    assert not missing, missing
