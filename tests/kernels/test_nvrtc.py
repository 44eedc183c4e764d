"""The GPU backend's compile step, run here without a GPU.

On a GPU, :class:`refengine.kernels.build.CupyKernels` hands every production kernel file
(:data:`~refengine.kernels.build.KERNEL_SOURCES`), as one translation unit, to NVRTC
through ``cupy.RawModule``; ``benchmarks/gpu_check.py`` compiles the layout self-tests
(:data:`~refengine.kernels.build.SELF_TEST_SOURCES`) as a module of their own. NVRTC is not nvcc: it has no host
headers, its own preprocessor defaults, and no ``cuda_fp16.h`` of its own, so the
``check_nvcc.sh`` step does not prove this one works. NVRTC itself needs no GPU, so this
test loads the library from the ``nvidia-cuda-nvrtc`` wheel (a test extra) with ctypes
and compiles exactly :func:`nvrtc_program`'s source and options, plus the options CuPy
adds on its own (``cupy/cuda/compiler.py``: ``-arch=sm_<cc>`` to get a cubin,
``--device-as-default-execution-space``, ``-ftz=true``), for the H100/H200's sm_90. It
asserts, for each module, that it holds exactly the kernels the CPU emulator's build of the
same sources registers (so CI tests on the CPU the set the GPU gets), that ptxas spills no
registers in any of them, and that the compiler has no warning to give.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

import pytest

from refengine.kernels.build import (KERNEL_SOURCES, SELF_TEST_SOURCES, build_emulation_library, cuda_source_dir,
                                     nvrtc_program)
from refengine.kernels.plans import SUPPORTED_HEAD_DIMS

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


@pytest.fixture(scope="module", params=list(MODULES))
def compiled(request):
    """``(sources, NVRTC version, succeeded, log, cubin bytes)`` of one module."""
    path = _find_nvrtc()
    if path is None:
        pytest.skip("NVRTC not installed (pip install -e '.[test]' brings nvidia-cuda-nvrtc)")
    include = path.parents[1] / "include"  # nvidia-cuda-runtime's headers, as CuPy finds them
    if not (include / "cuda_bf16.h").exists():
        pytest.skip(f"no cuda_bf16.h under {include} (pip install nvidia-cuda-runtime)")
    nvrtc = Nvrtc(path)
    sources = MODULES[request.param]
    code, options = nvrtc_program(include, sources)
    ok, log, cubin_bytes = nvrtc.compile(code, options + CUPY_OPTIONS + ("--ptxas-options=-v",))
    return sources, nvrtc.version(), ok, log, cubin_bytes


def _entries(log: str) -> dict[str, str]:
    """ptxas's report of each entry function: name -> its lines of the log."""
    parts = re.split(r"ptxas info\s*: Compiling entry function '([^']+)' for '[^']+'", log)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_nvrtc_compiles_every_kernel_for_sm90(compiled):
    sources, version, ok, log, cubin_bytes = compiled
    assert ok, f"NVRTC {version} failed:\n{log}"
    assert cubin_bytes > 0
    assert "warning" not in log.lower(), log
    lib = build_emulation_library([cuda_source_dir() / name for name in sources])
    emulated = lib.refengine_emu_list_kernels().decode().split()
    # production: reshape_and_cache (3) + layers (4 x 3 dtypes) + per head dim 3 SIMT prefill,
    # 2 tensor-core prefill, 3 decode and 3 merge kernels; quantized KV caches (int8, fp8e4m3,
    # fp8e5m2 x 3 dtypes): 9 reshape_and_cache + per head dim 9 SIMT prefill and 9 decode kernels;
    # quantized weights (quant_matmul.cu): int8 and int4 GEMV and GEMM x 3 activation dtypes (12)
    expected = {KERNEL_SOURCES: 15 + 11 * len(SUPPORTED_HEAD_DIMS) + 9 + 18 * len(SUPPORTED_HEAD_DIMS) + 12,
                SELF_TEST_SOURCES: 3}[sources]
    assert len(emulated) == expected
    assert sorted(_entries(log)) == sorted(emulated)


def test_nvrtc_builds_every_attention_kernel_at_every_head_dim(compiled):
    """Every attention kernel at every head dim of :data:`SUPPORTED_HEAD_DIMS` (96 and 256
    included) is in the GPU module, so the spill check below covers each of them."""
    sources, _, ok, log, _ = compiled
    assert ok, log
    if sources != KERNEL_SOURCES:
        pytest.skip("the self-test module has no attention kernels")
    entries = _entries(log)
    missing = [f"{family}_{tag}_hd{d}" for d in SUPPORTED_HEAD_DIMS
               for family, tags in (("flash_prefill", ("f32", "f16", "bf16")), ("flash_prefill_mma", ("f16", "bf16")),
                                    ("paged_decode", ("f32", "f16", "bf16")),
                                    ("paged_decode_reduce", ("f32", "f16", "bf16")),
                                    *((family, tuple(f"{dt}_{kv}" for dt in ("f32", "f16", "bf16")))
                                      for family in ("flash_prefill", "paged_decode")
                                      for kv in ("int8", "fp8e4m3", "fp8e5m2")))
               for tag in tags if f"{family}_{tag}_hd{d}" not in entries]
    assert not missing, missing


def test_nvrtc_build_spills_no_registers(compiled):
    _, _, ok, log, _ = compiled
    assert ok, log
    entries = _entries(log)
    spilled = {}
    for name, report in entries.items():
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert m, f"no spill line for {name}"
        if int(m.group(1)) or int(m.group(2)):
            spilled[name] = m.group(0)
    assert not spilled, spilled
