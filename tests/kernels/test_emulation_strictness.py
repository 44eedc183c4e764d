"""The CPU emulator catches real kernel bugs.

Each test copies a kernel source, breaks it in one small way that a GPU would often let
slip (a missing barrier only matters when warps interleave just so; an off-by-one in the
block table only matters at a block edge), compiles the broken copy in emulation, and
shows that it FAILS against the reference, while the unbroken source passes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.helpers import BLOCK_SIZE, TOLERANCE, dense_reference, make_case

from refengine.attention.cuda import EmulatedCudaAttention
from refengine.kernels.build import KERNEL_SOURCES, cuda_source_dir


# The kernel of each broken file that the cases below launch (head dim 64, float32 storage;
# float16 for the tensor-core kernel; paged_decode's merge kernel is defined on the same line).
LAUNCHED = {"flash_prefill.cu": "flash_prefill_f32_hd64", "flash_prefill_mma.cu": "flash_prefill_mma_f16_hd64",
            "paged_decode.cu": "paged_decode_f32_hd64"}


def only_kernel(text: str, kernel: str) -> str:
    """A kernel source with ``kernel``'s definition line (``DEFINE_...(kernel, ...)``) its only one.

    A broken copy serves one test: g++ then builds the one kernel the test launches (the same
    code), not every dtype, head dim and KV cache kind of the file (up to 75 kernels).
    """
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith("DEFINE_") or f"({kernel}," in line]
    assert sum(line.startswith("DEFINE_") for line in kept) == 1, f"no definition line of {kernel}"
    return "".join(kept)


def broken_backend(tmp_path: Path, file: str, old: str, new: str, count: int = 1, **kwargs) -> EmulatedCudaAttention:
    """An emulated backend built from cuda/ with ``old`` replaced by ``new`` in ``file``, whose
    only kernel is the one the cases launch (:data:`LAUNCHED`)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    sources = []
    for name in KERNEL_SOURCES:
        text = (cuda_source_dir() / name).read_text()
        if name == file:
            assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in {file}"
            text = only_kernel(text.replace(old, new), LAUNCHED[file])
        path = tmp_path / name
        path.write_text(text)
        sources.append(path)
    return EmulatedCudaAttention(sources=sources, **kwargs)


def output_error(backend: EmulatedCudaAttention, case) -> float:
    """Largest |kernel - reference| (inf when the kernel produced NaN)."""
    backend.write_kv(case.k_cache, case.v_cache, case.k_new, case.v_new, case.meta)
    out = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale).astype(np.float64)
    err = np.abs(out - dense_reference(case))
    return float(np.inf) if np.isnan(err).any() else float(err.max())


def prefill_case(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return make_case(rng, [(70, 70), (50, 20), (17, 1)], 4, 2, 64, BLOCK_SIZE, dtype)


def decode_case(seed=0):
    rng = np.random.default_rng(seed)
    return make_case(rng, [(70, 1), (33, 1), (16, 1), (5, 1)], 4, 2, 64, BLOCK_SIZE, np.float32)


TOL = TOLERANCE[np.dtype(np.float32)]


def test_unbroken_kernels_pass():
    backend = EmulatedCudaAttention(decode_partition_size=32)
    assert output_error(backend, prefill_case()) < TOL
    assert output_error(backend, decode_case()) < TOL


def test_missing_barrier_after_tile_load_fails(tmp_path):
    """Without the barrier, the last warp reads the K tile before the others stored it."""
    backend = broken_backend(tmp_path, "flash_prefill.cu",
                             "__syncthreads();  // the tile is complete before anyone reads it", "")
    assert output_error(backend, prefill_case()) > 1e-2


def test_missing_barrier_before_tile_reuse_fails(tmp_path):
    """Without the end-of-tile barrier, a fast warp overwrites K/V while others still use it."""
    backend = broken_backend(tmp_path, "flash_prefill.cu",
                             "__syncthreads();  // everyone is done with this tile before the next one overwrites it",
                             "")
    assert output_error(backend, prefill_case()) > 1e-2


@pytest.mark.parametrize("old", [
    "__syncthreads();     // ... everyone's has, and nobody still reads V(i-1)",
    "cp_async_wait<0>();  // V(i) has landed (this thread's part) ...",
    "__syncthreads();     // ... everyone's has, and nobody still reads K(i)",
], ids=["no-barrier-after-wait", "no-cp-async-wait", "no-barrier-before-reuse"])
def test_broken_pipeline_in_tensor_core_kernel_fails(tmp_path, old):
    """The tensor-core kernel's cp.async pipeline (float16 storage, emulated MMA, ldmatrix
    and cp.async): reading a tile before the other threads' copies are known to have landed,
    reading it before one's own wait, or overwriting K while slower warps still multiply by
    it, each give wrong numbers."""
    backend = broken_backend(tmp_path, "flash_prefill_mma.cu", old, "")
    case = prefill_case(dtype=np.float16)
    assert output_error(EmulatedCudaAttention(), prefill_case(dtype=np.float16)) < TOLERANCE[np.dtype(np.float16)]
    assert output_error(backend, case) > 1e-1


@pytest.mark.parametrize("file,case", [("flash_prefill.cu", prefill_case), ("paged_decode.cu", decode_case)])
def test_block_table_off_by_one_fails(tmp_path, file, case):
    """Reading key p from block (p + 1) / block_size: wrong only at each block's last slot."""
    backend = broken_backend(tmp_path, file, "block_table[pos / block_size]", "block_table[(pos + 1) / block_size]",
                             decode_partition_size=32)
    assert output_error(backend, case()) > 1e-2


SUM_BY_SHUFFLE = """            const float tile_sum = warp_sum(p);
            p_s[g * kKeyTile + lane] = p;"""
SUM_FROM_SHARED = """            p_s[g * kKeyTile + lane] = p;{sync}
            float tile_sum = 0.0f;  // lane 0 reads what the other lanes just stored
            for (int k = 0; k < kKeyTile; ++k) tile_sum += p_s[g * kKeyTile + k];"""


def test_warp_synchronous_assumption_fails_in_forward_order(tmp_path):
    """Summing the warp's probabilities through shared memory without __syncwarp relies on
    the lanes running in lockstep, which Volta+ GPUs do not promise. The reverse schedule
    happens to run lane 0 last (and passes); the forward schedule runs it first, so it
    reads the other lanes' slots before they are written, and fails. With __syncwarp()
    it passes in every order."""
    racy = SUM_FROM_SHARED.format(sync="")
    fixed = SUM_FROM_SHARED.format(sync="\n            __syncwarp();")
    lucky = broken_backend(tmp_path / "a", "paged_decode.cu", SUM_BY_SHUFFLE, racy, schedule="reverse")
    assert output_error(lucky, decode_case()) < TOL
    exposed = broken_backend(tmp_path / "b", "paged_decode.cu", SUM_BY_SHUFFLE, racy, schedule="forward")
    assert output_error(exposed, decode_case()) > 1e-2
    for schedule in ("forward", "shuffle"):
        correct = broken_backend(tmp_path / schedule, "paged_decode.cu", SUM_BY_SHUFFLE, fixed, schedule=schedule)
        assert output_error(correct, decode_case()) < TOL


def test_divergent_barrier_is_an_error(tmp_path):
    """Threads that return early while the rest wait at __syncthreads: a launch error."""
    backend = broken_backend(tmp_path, "flash_prefill.cu", "    if (!row_valid) return;\n",
                             "    if (!row_valid) return;\n    __syncthreads();\n")
    with pytest.raises(RuntimeError, match="__syncthreads reached by"):
        output_error(backend, prefill_case())


def test_divergent_shuffle_is_an_error(tmp_path):
    """A shuffle inside a branch that only some lanes take: a launch error."""
    backend = broken_backend(tmp_path, "flash_prefill.cu",
                             "partial += __shfl_xor_sync(REFENGINE_FULL_MASK, partial, 2);",
                             "if (row_valid) partial += __shfl_xor_sync(REFENGINE_FULL_MASK, partial, 2);")
    with pytest.raises(RuntimeError, match="divergent warp collective"):
        output_error(backend, prefill_case())
