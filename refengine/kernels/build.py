"""Building and loading refengine's CUDA kernels (``cuda/*.cu``), on a GPU or the CPU emulator.

Two ways to run the *same* sources, each behind one small launcher object
(:class:`KernelModule`: ``launch(Launch)`` plus the array handling a launch needs):

* :class:`CupyKernels`: on an NVIDIA GPU. The sources are concatenated into one NVRTC
  program (:func:`nvrtc_program`) and compiled by ``cupy.RawModule`` at first use;
  :func:`cupy_kernels` keeps one module per device, so the attention backend and the
  layer operations share it.
* :class:`EmulatedKernels`: on the CPU. Every source is compiled by ``g++`` with
  ``cuda/cuda_emu.h`` force-included (:func:`build_emulation_library`, cached on disk
  and per process), and every block of every launch runs on a strict thread emulator
  (:func:`emulated_launch`: fibers scheduled adversarially, poisoned shared memory,
  checked warp collectives). This is how CI, which has no GPU, runs the kernels.

Production modules hold :data:`KERNEL_SOURCES`; the layout self-tests of
:data:`SELF_TEST_SOURCES` are built only by the tests and ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
from filelock import FileLock

from refengine.kernels.plans import Launch
from refengine.resources import build_cache_dir, cuda_source_dir


# The one place that says where the sources are and where emulation builds go (both read
# at call time, never at import).
def emulator_build_dir() -> Path:
    """Where emulation objects and libraries are cached: ``cuda-emulated/`` in
    :func:`refengine.resources.build_cache_dir` (never next to the sources, which may be read-only)."""
    return build_cache_dir() / "cuda-emulated"


KERNEL_SOURCES = ("reshape_and_cache.cu", "flash_prefill.cu", "flash_prefill_mma.cu", "paged_decode.cu", "layers.cu",
                  "quant_matmul.cu")
SELF_TEST_SOURCES = ("mma_check.cu",)  # mma / ldmatrix / cp.async layout checks
EMULATION_SUPPORT = ("cuda_emu.h", "common.cuh", "mma.cuh", "cp_async.cuh", "emu_runtime.cpp")

GXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-DREFENGINE_EMULATION")


class KernelModule(Protocol):
    """A loaded kernel module and the arrays its launches take (NumPy or CuPy)."""

    name: str
    xp: Any  # the array module (``cupy`` or ``numpy``) of the arrays it takes

    def launch(self, launch: Launch) -> None:
        """Run one launch (asynchronously on a GPU)."""

    def empty(self, shape: tuple, dtype: Any) -> Any:
        """An uninitialised array for a kernel to write (NaN-filled in emulation)."""

    def int32(self, host: np.ndarray) -> Any:
        """A host integer array as a C-contiguous int32 array the kernels can read."""

    def contiguous(self, x: Any) -> Any:
        """``x`` as a C-contiguous array of this module's kind (copied only if needed)."""

    def address(self, x: Any) -> int:
        """The address of ``x``'s first element."""


def nvrtc_program(cuda_include: os.PathLike | str | None,
                  sources: Sequence[str] = KERNEL_SOURCES) -> tuple[str, tuple[str, ...]]:
    """The one translation unit and the options :class:`CupyKernels` hands to NVRTC.

    The files of ``sources`` (names in :func:`cuda_source_dir`), concatenated (each includes
    ``common.cuh``, whose ``#pragma once`` keeps the helpers single). NVRTC has no
    ``cuda_fp16.h`` / ``cuda_bf16.h`` of its own: ``cuda_include`` is the CUDA include
    directory that holds them (CuPy's ``get_cuda_path()/include``; with pip wheels,
    ``nvidia/cu13/include`` from ``nvidia-cuda-runtime``). ``tests/kernels/test_nvrtc.py`` compiles
    exactly this for sm_90; CuPy adds ``-arch`` and its own flags (``cupy/cuda/compiler.py``).

    Args:
        cuda_include: see above, or ``None``.
        sources: :data:`KERNEL_SOURCES` (the production module, default) or
            :data:`SELF_TEST_SOURCES`.
    Returns:
        ``(source, options)``: the CUDA C++ text and the NVRTC command-line options.
    Raises:
        OSError: a source file cannot be read.
    """
    cuda_dir = cuda_source_dir()
    code = "\n".join((cuda_dir / name).read_text() for name in sources)
    options = ["--std=c++17", f"-I{cuda_dir}"]
    if cuda_include is not None:
        options.append(f"-I{cuda_include}")
    return code, tuple(options)


# =======================================================================================
# GPU (CuPy)
# =======================================================================================

# Dynamic shared memory a launch may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_MAX_SHARED_BYTES = 48 * 1024


class CupyKernels:
    """A module compiled by NVRTC through ``cupy.RawModule`` (CuPy caches the binary on disk).

    A launch that asks for more than :data:`DEFAULT_MAX_SHARED_BYTES` of dynamic shared
    memory (``paged_decode`` at head_dim 256: 73.2 KiB) first raises its kernel's limit
    (``RawKernel.max_dynamic_shared_size_bytes``, i.e. ``cuFuncSetAttribute``; an H100/H200
    allows up to 227 KiB per block).

    Args:
        cupy: the ``cupy`` module.
        sources: file names in :func:`cuda_source_dir` (default the production kernels).
    """

    name = "cuda"

    def __init__(self, cupy: Any, sources: Sequence[str] = KERNEL_SOURCES) -> None:
        self._cp = cupy
        self.xp = cupy  # the array module of this module's arrays (placing quantized weights)
        cuda_path = cupy.cuda.get_cuda_path() if hasattr(cupy.cuda, "get_cuda_path") else None
        code, options = nvrtc_program(Path(cuda_path) / "include" if cuda_path else None, sources)
        self._module = cupy.RawModule(code=code, options=options)
        self._kernels: dict[str, Any] = {}
        self._shared_limit: dict[str, int] = {}  # per kernel: the limit set so far

    def compile(self) -> float:
        """Compile the module now rather than at its first launch (NVRTC, or CuPy's disk
        cache when it holds this source). Benchmarks call it so that no timed point pays
        for the compilation.

        Returns:
            The seconds it took (wall clock).
        Raises:
            cupy.cuda.compiler.CompileException: NVRTC rejects the source (its log in the message).
        """
        start = time.perf_counter()
        self._module.compile()
        return time.perf_counter() - start

    def launch(self, launch: Launch) -> None:
        kernel = self._kernels.get(launch.kernel)
        if kernel is None:
            kernel = self._kernels[launch.kernel] = self._module.get_function(launch.kernel)
        if launch.shared_bytes > self._shared_limit.get(launch.kernel, DEFAULT_MAX_SHARED_BYTES):
            kernel.max_dynamic_shared_size_bytes = launch.shared_bytes
            self._shared_limit[launch.kernel] = launch.shared_bytes
        kernel(launch.grid, launch.block, launch.args, shared_mem=launch.shared_bytes)

    def empty(self, shape: tuple, dtype: Any) -> Any:
        return self._cp.empty(shape, dtype=dtype)

    def int32(self, host: np.ndarray) -> Any:
        return self._cp.asarray(np.ascontiguousarray(host, dtype=np.int32))

    def contiguous(self, x: Any) -> Any:
        return self._cp.ascontiguousarray(x)

    def address(self, x: Any) -> int:
        return int(x.data.ptr)


_cupy_modules: dict[tuple, CupyKernels] = {}


def cupy_kernels(sources: Sequence[str] = KERNEL_SOURCES) -> CupyKernels:
    """The :class:`CupyKernels` of ``sources`` on the current device, compiled once per process.

    Raises:
        ImportError: CuPy is not installed (``pip install 'refengine[cuda]'``).
    """
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("attention_backend='cuda' needs CuPy with a CUDA device: "
                          "pip install 'refengine[cuda]' (cupy-cuda13x)") from exc
    # Keyed by the module object too, so a stand-in CuPy in the tests never gets a real one's module.
    key = (cupy, int(cupy.cuda.Device().id), tuple(sources))
    if key not in _cupy_modules:
        _cupy_modules[key] = CupyKernels(cupy, sources)
    return _cupy_modules[key]


# =======================================================================================
# CPU emulation
# =======================================================================================

_build_lock = threading.Lock()
_launch_lock = threading.Lock()  # the emulator keeps its scheduler state in globals
_libraries: dict[Path, ctypes.CDLL] = {}


def build_emulation_library(sources: Sequence[os.PathLike | str] | None = None, *,
                            build_dir: os.PathLike | str | None = None,
                            extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile kernel sources for the CPU emulator (once) and load the library.

    Every translation unit (each ``.cu`` file, and ``emu_runtime.cpp``) becomes an object
    file named after a hash of its text, the shared headers (``cuda_emu.h``,
    ``common.cuh``, ``mma.cuh``) and the flags; the library is named after its objects.
    So an edited source rebuilds only itself, an unchanged tree is reused across
    processes, and the objects compile in parallel. Every file is written under a
    temporary name and moved into place, so concurrent builders (pytest-xdist workers)
    never see half a file, and each under a lock file, so they never compile the same
    file twice.

    Args:
        sources: ``.cu`` files; default: :data:`KERNEL_SOURCES` in :func:`cuda_source_dir`.
            ``#include "common.cuh"`` resolves to :func:`cuda_source_dir` even for a copy elsewhere.
        build_dir: where objects and libraries are kept (default :func:`emulator_build_dir`).
        extra_flags: additional g++ flags.
    Returns:
        The loaded ``ctypes.CDLL`` with ``refengine_emu_*`` functions typed.
    Raises:
        RuntimeError: g++ is missing or compilation failed (its output included).
    """
    cuda_dir = cuda_source_dir()
    source_paths = [Path(s) for s in (sources or [cuda_dir / name for name in KERNEL_SOURCES])]
    flags = [*GXX_FLAGS, *extra_flags, f"-I{cuda_dir}"]
    shared = hashlib.sha256(" ".join(flags).encode())
    for name in EMULATION_SUPPORT:
        shared.update(name.encode() + b"\0" + (cuda_dir / name).read_bytes() + b"\0")
    out_dir = Path(build_dir) if build_dir is not None else emulator_build_dir()

    def object_path(source: Path) -> Path:
        digest = hashlib.sha256(shared.digest() + source.read_bytes()).hexdigest()[:16]
        return out_dir / f"{source.stem}_{digest}.o"

    units = [(cuda_dir / "emu_runtime.cpp", ["-x", "c++"])] + [
        (path, ["-include", str(cuda_dir / "cuda_emu.h"), "-x", "c++"]) for path in source_paths]
    objects = [object_path(path) for path, _ in units]
    target = out_dir / ("refengine_emu_" + hashlib.sha256("".join(o.name for o in objects).encode()).hexdigest()[:16]
                        + ".so")

    with _build_lock:
        if target in _libraries:
            return _libraries[target]
        if not target.exists():
            compiler = shutil.which(os.environ.get("CXX", "g++"))
            if compiler is None:
                raise RuntimeError("the cuda-emulated attention backend needs g++ (set CXX to another C++17 compiler)")
            out_dir.mkdir(parents=True, exist_ok=True)
            jobs = [([compiler, *flags, *lang, "-c", str(path)], obj) for (path, lang), obj in zip(units, objects)]
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                list(pool.map(lambda job: _build_once(*job), jobs))
            _build_once([compiler, *flags, *map(str, objects)], target)
        lib = ctypes.CDLL(str(target))
        lib.refengine_emu_launch.restype = ctypes.c_int
        lib.refengine_emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [
            ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.refengine_emu_last_error.restype = ctypes.c_char_p
        lib.refengine_emu_list_kernels.restype = ctypes.c_char_p
        lib.refengine_emu_set_schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        _libraries[target] = lib
        return lib


def _build_once(cmd: list[str], output: Path) -> None:
    """Run ``cmd -o <temporary>`` and move the result to ``output`` atomically, unless
    ``output`` exists.

    Under a lock file beside ``output`` (``filelock``): processes that need the same file
    at the same time (pytest-xdist workers starting on a cold cache) build it once; the
    others wait for it instead of compiling it again.
    """
    with FileLock(f"{output}.lock"):
        if output.exists():
            return
        fd, tmp = tempfile.mkstemp(prefix=output.stem + ".", suffix=".tmp" + output.suffix, dir=output.parent)
        os.close(fd)
        result = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"emulation build failed:\n$ {' '.join(cmd)}\n{result.stderr}")
        os.replace(tmp, output)


SCHEDULES = {"reverse": 0, "forward": 1, "shuffle": 2}


def emulated_launch(lib: ctypes.CDLL, launch: Launch, schedule: str = "reverse", seed: int = 0) -> None:
    """Run one :class:`Launch` on the CPU emulator.

    Args:
        lib: from :func:`build_emulation_library`.
        launch: arrays in ``args`` must be C-contiguous NumPy arrays (passed by pointer).
        schedule: thread order between barriers: ``"reverse"`` (default), ``"forward"`` or
            ``"shuffle"`` (seeded by ``seed``).
    Raises:
        RuntimeError: the kernel broke an emulation rule (divergent barrier, divergent warp
            collective, too little shared memory) or the kernel/arity is unknown.
    """
    holders = []
    argv = (ctypes.c_void_p * len(launch.args))()
    for i, arg in enumerate(launch.args):
        if isinstance(arg, np.ndarray):
            if not arg.flags.c_contiguous:
                raise ValueError(f"argument {i} of {launch.kernel} is not C-contiguous")
            holder = ctypes.c_void_p(arg.ctypes.data)
        elif isinstance(arg, np.int32):
            holder = ctypes.c_int32(int(arg))
        elif isinstance(arg, np.float32):
            holder = ctypes.c_float(float(arg))
        else:
            raise TypeError(f"argument {i} of {launch.kernel}: {type(arg).__name__} "
                            "(want ndarray, np.int32 or np.float32)")
        holders.append(holder)
        argv[i] = ctypes.cast(ctypes.pointer(holder), ctypes.c_void_p)
    with _launch_lock:
        lib.refengine_emu_set_schedule(SCHEDULES[schedule], seed)
        rc = lib.refengine_emu_launch(launch.kernel.encode(), *launch.grid, *launch.block, launch.shared_bytes,
                                      argv, len(launch.args))
        if rc != 0:
            raise RuntimeError(f"{launch.kernel}: {lib.refengine_emu_last_error().decode()}")


class EmulatedKernels:
    """Kernels run on the CPU emulator: NumPy arrays in and out.

    Outputs from :meth:`empty` are NaN-filled, so an element a kernel forgets to write
    shows up. Slow (every CUDA thread is a fiber): meant for tests and small models.

    Args:
        sources: ``.cu`` files to build (default :data:`KERNEL_SOURCES`; the strictness
            tests pass deliberately broken copies).
        schedule: thread order between barriers, see :func:`emulated_launch`.
        seed: seed of the ``"shuffle"`` schedule.
    Raises:
        ValueError: unknown schedule. RuntimeError: the build failed.
    """

    name = "cuda-emulated"
    xp = np  # the array module of this module's arrays

    def __init__(self, sources: Sequence[os.PathLike | str] | None = None, schedule: str = "reverse",
                 seed: int = 0) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}")
        self.schedule = schedule
        self.seed = seed
        self.lib = build_emulation_library(sources)

    def launch(self, launch: Launch) -> None:
        emulated_launch(self.lib, launch, self.schedule, self.seed)

    def empty(self, shape: tuple, dtype: Any) -> np.ndarray:
        return np.full(shape, np.nan, dtype=dtype)

    def int32(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=np.int32)

    def contiguous(self, x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"the CUDA emulator takes NumPy arrays, got {type(x).__name__}")
        return np.ascontiguousarray(x)

    def address(self, x: np.ndarray) -> int:
        return int(x.ctypes.data)
