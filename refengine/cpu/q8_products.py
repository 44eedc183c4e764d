"""Products ``x [T, in] @ w.T`` with GGUF block types, activations rounded to Q8_0 (Q8_K), in integers.

llama.cpp's scheme for its CPU dot products, ``activation_dtype="q8_0"``. ``w [out, in]``
in Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 (:data:`Q8_TYPES`: activations in Q8_0 blocks), or a
K-quant, Q4_K, Q5_K or Q6_K (activations in Q8_K blocks, below); ``x`` float32 ``[T, in]``;
the result float32 ``[T, out]``. Entry points: :func:`linear` (any block type: F16, BF16
and F32 fall back to :func:`refengine.cpu.gguf_products.linear`) and :class:`RowProduct`
(one row, bound once). Two steps:

1. :func:`quantize_q8_0` rounds each row of ``x`` to Q8_0 blocks, exactly as ggml's
   reference ``quantize_row_q8_0_ref`` (``ggml-quants.c``) and gguf-py's
   ``gguf.quants.quantize(x, Q8_0)`` do: per block of 32, ``d = max|x| / 127`` (stored as
   f16), ``q = roundf(x / d)`` (half away from zero; ``x * (1 / d)`` with the float32
   ``d``), ``q`` in ``[-127, 127]``. The value it stands for is ``x̂ = f16(d) * q``.
2. The kernels multiply the weights' quants with the activation quants and sum them in
   integers, exactly, then scale each block's sum once in float32. So every output is, up
   to float32 rounding, ``dequantize(quantize_q8_0(x)) @ dequantize(w).T`` (tested against
   gguf-py's own quantizer and dequantizer, in float64).

**Sixteen weight rows in the lanes.** A row-major kernel dots one weight row with the
activation row in vector lanes and must add its lanes together at the end of every row.
Here the lanes are sixteen *output rows* instead (the idea of ggml's "repack" layouts,
``ggml-cpu/repack.cpp``, which use 4 or 8 rows). A weight is re-laid once, at its first
product (:func:`interleave`): for each group of sixteen rows and each block, the rows'
quant bytes go in 64-byte slices, four bytes of each row per slice, so that one
``vpdpbusd`` (AVX512-VNNI) multiplies four quants of each of the sixteen rows with the same
four activation quants (a 32-bit broadcast, folded into the instruction) and adds them into
that row's int32 lane. A block of sixteen rows is 4 slices (4- and 5-bit types: each
slice's low and high nibbles are two operands; Q5's fifth bits come from two 64-bit masks
per slice) or 8 (Q8_0): 8 ``vpdpbusd``, one conversion and one or two FMAs, and no
horizontal sums. Without AVX512-VNNI the same int32 sums come from AVX-VNNI's 256-bit
``vpdpbusd``, or AVX2's ``vpmaddubsw`` and ``vpmaddwd`` (the 4- and 5-bit quants, whose
pair sums cannot saturate int16), or generic LLVM IR; numba's LLVM does not form these
instructions itself, so :func:`q16_dpbusd` calls them by name.

The quants enter as unsigned bytes: Q4_1/Q5_1's as stored; Q4_0/Q5_0's ``n`` stand for
``n - 8`` / ``n - 16`` and Q8_0's ``q`` is stored as ``q + 128``, so a block's sum is
corrected by ``8``, ``16`` or ``128`` times the activation block's quant sum, in integers:
the signed products' exact sum.

**Numerics**, per output ``out[t, j]`` (one lane): ``acc = fma(float(isum_b), d_w[j, b] *
d_x[t, b], acc)`` over the blocks ``b`` in order and, Q4_1/Q5_1, ``acc_m = fma(m_w[j, b],
d_x[t, b] * sum(q_x[t, b]), acc_m)`` in order, then ``acc + acc_m`` (the K-quants' chain
below). One activation row or many (four rows at a time share each loaded slice), one
thread or several, any CPU: each output is this chain, so the bits do not depend on the
batch (this path serves every row count; it has no BLAS twin). F16, BF16 and F32 weights
keep their float32 products (:func:`linear` falls back to
:func:`refengine.cpu.gguf_products.linear`).

**The K-quants** (:data:`~refengine.quant.gguf_blocks.Q8_K_TYPES`), as llama.cpp's
``ggml_vec_dot_q4_K_q8_K`` ... ``_q6_K_q8_K`` (``ggml-cpu/arch/x86/quants.c``):

1. :func:`quantize_q8_k` rounds each row to ggml's Q8_K blocks of 256, bit for bit ggml's
   ``quantize_row_q8_K_ref`` (which x86 runs; gguf-py has no Q8_K): the first value of
   largest magnitude ``top`` sets ``iscale = -127 / top`` (signed), ``q = nearest_int(iscale
   * x)`` (half to even), ``d = 1 / iscale`` kept in float32, and ``bsums``, the quants'
   sums in groups of 16.
2. Per superblock and output row, in integers: ``isum = sum_s sc_s * dot(q_w, q_x)_s`` over
   the eight sub-blocks of 32 (6-bit scales), and Q4_K/Q5_K's minimums, which meet only the
   activations' sums, ``msum = sum_s m_s * (bsums[2s] + bsums[2s + 1])``; Q6_K's sixteen
   groups of 16 (int8 scales) with quants ``q - 32``, the ``- 32`` as ``-32 sum_g sc_g *
   bsums[g]``. Then ``acc = acc + float(isum) * (d_w * d_x)`` and ``acc_m = acc_m +
   float(msum) * (dmin_w * -d_x)`` over the superblocks in order, a multiply and an add
   each (not an FMA: the order ggml's scalar code and the NumPy twin
   :func:`refengine.quant.gguf_blocks.reference_q8_k_linear` use, bit for bit), then
   ``acc + acc_m``. ``isum`` can pass ``2**24``; its conversion rounds, as ggml's does.

They use the same sixteen-row groups: a group's superblock is 32 slices of ``qs`` (Q6_K:
``ql``) bytes, each slice's low nibbles one sub-block's quants and its high nibbles
another's; Q5_K's fifth bits are 64-bit masks as Q5_0's, Q6_K's top two bits a slice of
``qh`` bytes beside each pair of ``ql`` slices; the scales (and Q4_K/Q5_K's mins, decoded
from their 6-bit packing to a byte each) sixteen rows to a vector, multiplied into the
int32 lanes. A superblock of sixteen rows is 64 ``vpdpbusd`` and a few lane multiplies.

What it costs and saves: the activations carry ggml's Q8_0 rounding error (each value
within half a step, ``max|x| / 254`` of its block; Q8_K's block is 256 values); ``refengine eval perplexity
--activation-dtype q8_0`` measures what that does to a model. A weight's interleaved copy
is built at its first product, beside its planes; an engine with ``activation_dtype="q8_0"``
builds them all at load over the planes' own buffers and keeps that copy alone
(:func:`interleave_model`).

A decode step makes over a hundred products of one row each, so the Python around each
kernel call is kept small: each kernel quantizes a one-row input itself, before its
parallel loop (:func:`_prepare_input`), and :class:`RowProduct` binds everything but the
row once, for the layer operations and the captured decode step to call.
"""

from __future__ import annotations

import sys
import threading
from functools import partial

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from refengine.cpu import gguf_products
from refengine.cpu.gguf_products import BLOCKS32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
from refengine.cpu.numba_support import get_num_threads, parallel_kernel, register_kernels, x_block_rows
from refengine.cpu.simd import (F8, I8, I16L, I32, is_c_array, ir_splat, vector_ptr, vector_type, f16_to_f32,
                                f32_to_f16, i32x16, q16_add, q16_load_bytes, q16_mul, q16_mul_int, q16_to_f, v16_add,
                                v16_fma, v16_load_f16, v16_mul, v16_splat, v16_store, v16_zero)
from refengine.quant.gguf_blocks import Q8_K_TYPES, k_pack_scales_mins, k_scales_mins

#: Block types whose products take Q8_0 activations here.
Q8_TYPES = BLOCKS32
#: Every block type with an integer product here: :data:`Q8_TYPES` and the K-quants
#: (:data:`~refengine.quant.gguf_blocks.Q8_K_TYPES`: Q4_K, Q5_K, Q6_K, with Q8_K activations).
#: The other types (F16, BF16, F32) stay float32.
INTEGER_TYPES = Q8_TYPES + Q8_K_TYPES
#: Type codes of the K-quant kernels, after the 32-weight types' (``gguf_products``' 0-4).
Q4_K, Q5_K, Q6_K = 5, 6, 7
#: From this many rows :func:`quantize_q8_0` and :func:`quantize_q8_k` run their rows in parallel.
QUANTIZE_PARALLEL_MIN_ROWS = 64
#: Output rows interleaved per group (the int32 lanes of one AVX-512 register).
GROUP = 16
#: Quant bytes of one group's block, per type: sixteen rows of 16 (4-, 5-bit) or 32 (8-bit)
#: bytes a block of 32, or of 128 a K-quant superblock of 256 (Q6_K: its low four bits; the
#: top two are a plane of their own, 1024 bytes).
GROUP_BLOCK_BYTES = {"Q8_0": 512, "Q4_0": 256, "Q4_1": 256, "Q5_0": 256, "Q5_1": 256,
                     "Q4_K": 2048, "Q5_K": 2048, "Q6_K": 2048}

_U = np.uintp
_B32 = ir.VectorType(ir.IntType(8), 32)
_B64 = ir.VectorType(ir.IntType(8), 64)
_W16 = ir.VectorType(ir.IntType(16), 16)
_LOCK = threading.Lock()

#: Sixty-four int8 lanes (LLVM ``<64 x i8>``, one AVX-512 ``zmm`` register, two ``ymm`` where
#: LLVM splits it): one slice, four quant bytes of each of sixteen rows.
i8x64 = vector_type("i8x64", _B64)


def _features(context) -> list[str]:
    """The CPU features the code is compiled for (numba targets the host CPU; its cache is
    keyed by them)."""
    return str(getattr(context.codegen(), "_tm_features", "")).split(",")


def _has_avx2(context) -> bool:
    """Whether the code is compiled for a CPU with AVX2."""
    return "+avx2" in _features(context)


def _has_vnni(context) -> bool:
    """Whether the code is compiled for a CPU with a 256-bit ``vpdpbusd``: AVX-VNNI, or
    AVX512-VNNI with AVX512-VL."""
    features = _features(context)
    return "+avxvnni" in features or ("+avx512vnni" in features and "+avx512vl" in features)


def _has_avx512_vnni(context) -> bool:
    """Whether the code is compiled for a CPU with the 512-bit ``vpdpbusd`` (AVX512-VNNI)."""
    return "+avx512vnni" in _features(context)


def _mask(lanes) -> ir.Constant:
    """A shuffle mask: the lane numbers ``lanes``."""
    return ir.Constant(ir.VectorType(I32, len(lanes)), [I32(i) for i in lanes])


def _call(builder, name, ret, *vals):
    """A call of the LLVM intrinsic ``name`` returning ``ret``."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [v.type for v in vals]), name)
    return builder.call(fn, vals)


def _pairs(builder, v, out):
    """Adjacent lanes of ``v`` added, as ``out`` (``<2n x iK>`` -> ``<n x iM>``, ``M >= K``,
    sign-extended where ``M > K``)."""
    n = out.count

    def lanes(first):
        half = builder.shuffle_vector(v, v, _mask(range(first, 2 * n, 2)))
        return half if out.element.width == v.type.element.width else builder.sext(half, out)

    return builder.add(lanes(0), lanes(1))


# ---------------------------------------------------------------------------------------
# The activations: ggml's Q8_0 blocks.


@njit(inline="always")
def f16_round(v):  # pragma: no cover - compiled
    """The float32 ``v >= 0`` rounded to the nearest float16 value (ties to even; at or above
    65520, infinity), returned as float32: the value NumPy's ``astype(float16)`` stores
    (:func:`refengine.cpu.simd.f32_to_f16`, read back exactly)."""
    return f16_to_f32(f32_to_f16(v))


def _block_f8(context, builder, sig, args):
    """The four :data:`f32x8` of the 32 float32 at flat element ``args[1]`` of the array ``args[0]``."""
    ptr = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], F8)
    return [builder.load(builder.gep(ptr, [I32(i)]), align=4) for i in range(4)]


@intrinsic
def _block_amax(typingctx, x, xo):
    """``max |x[xo : xo + 32]|`` (flat float32 array; finite values), in vector registers."""
    if not (is_c_array(x, types.float32) and isinstance(xo, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = [_call(builder, "llvm.fabs.v8f32", F8, a) for a in _block_f8(context, builder, sig, args)]
        m = _call(builder, "llvm.maxnum.v8f32", F8, _call(builder, "llvm.maxnum.v8f32", F8, v[0], v[1]),
                  _call(builder, "llvm.maxnum.v8f32", F8, v[2], v[3]))
        for half in (4, 2, 1):  # max is exact: any order gives the same value
            top = builder.shuffle_vector(m, m, _mask([i + half if i < half else i for i in range(8)]))
            m = _call(builder, "llvm.maxnum.v8f32", F8, m, top)
        return builder.extract_element(m, I32(0))

    return types.float32(x, xo), codegen


#: ggml's ``nearest_int`` adds this, 1.5 * 2**23: the float32 sum's last bit is worth 1, so the
#: addition rounds to the nearest integer (ties to even), and subtracting it back is exact.
_ROUND_EVEN = 12582912.0


def _round_intrinsic(lanes: int, ties_to_even: bool):
    """An intrinsic ``(x, xo, scale, q, qo) -> int32``: ``q[qo + i] = round(x[xo + i] * scale)``
    for ``i < lanes`` (16 or 32; flat float32 ``x``, int8 ``q``), returning the sum of the
    quants. The rounding: ``roundf`` (half away from zero) as gguf-py's ``np_roundf``,
    ``floor(a) + floor(2 * (a - floor(a)))`` of ``a = |v|`` with ``v``'s sign (ggml's Q8_0);
    or, ``ties_to_even``, ggml's ``nearest_int`` (Q8_K): ``(v + 1.5 * 2**23) - 1.5 * 2**23``.
    Both exact for ``|v| < 2**22``; the quants must fit int8."""
    parts_type = ir.VectorType(ir.IntType(8), 8)

    @intrinsic
    def block_round(typingctx, x, xo, scale, q, qo):
        if not (is_c_array(x, types.float32) and is_c_array(q, types.int8) and isinstance(scale, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            mul = ir_splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), F8)
            ptr = vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], F8)
            two, magic = ir.Constant(F8, [2.0] * 8), ir.Constant(F8, [_ROUND_EVEN] * 8)
            total, parts = None, []
            for i in range(lanes // 8):
                v = builder.fmul(builder.load(builder.gep(ptr, [I32(i)]), align=4), mul)
                if ties_to_even:
                    r = builder.fsub(builder.fadd(v, magic), magic)
                else:
                    a = _call(builder, "llvm.fabs.v8f32", F8, v)
                    fl = _call(builder, "llvm.floor.v8f32", F8, a)
                    r = builder.fadd(fl, _call(builder, "llvm.floor.v8f32", F8, builder.fmul(two, builder.fsub(a, fl))))
                    r = _call(builder, "llvm.copysign.v8f32", F8, r, v)
                qi = builder.fptosi(r, I8)
                total = qi if total is None else builder.add(total, qi)
                parts.append(builder.trunc(qi, parts_type))
            while len(parts) > 1:  # concatenated pairwise: 8 + 8, then 16 + 16
                width = 2 * parts[0].type.count
                parts = [builder.shuffle_vector(a, b, _mask(range(width))) for a, b in zip(parts[::2], parts[1::2])]
            out_type = ir.VectorType(ir.IntType(8), lanes)
            builder.store(parts[0], vector_ptr(context, builder, sig.args[3], args[3], sig.args[4], args[4], out_type),
                          align=1)
            for half in (4, 2, 1):
                turned = builder.shuffle_vector(total, total, _mask([(i + half) % 8 for i in range(8)]))
                total = builder.add(total, turned)
            return builder.extract_element(total, I32(0))

        return types.int32(x, xo, scale, q, qo), codegen

    return block_round


#: 32 values rounded half away from zero (Q8_0).
_block_round = _round_intrinsic(32, ties_to_even=False)
#: 16 values rounded half to even (Q8_K: a group of its ``bsums``).
_round16_even = _round_intrinsic(16, ties_to_even=True)


@njit(cache=True)
def _quantize_task(x, xq, dx, xsq, t0, t1):  # pragma: no cover - compiled
    """Rows ``t0 .. t1 - 1`` of ``x`` into ``xq``, ``dx`` (the f16 scales' values) and ``xsq``
    (``dx * sum(q)``), block by block (:func:`quantize_q8_0`)."""
    nb = _U(dx.shape[1])
    xf, qf = x.reshape(-1), xq.reshape(-1)
    for t in range(_U(t0), _U(t1)):
        for b in range(nb):
            c = (t * nb + b) * _U(32)
            d = _block_amax(xf, c) / np.float32(127.0)
            inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
            total = _block_round(xf, c, inv, qf, c)
            dv = f16_round(d)
            dx[t, b] = dv
            xsq[t, b] = dv * np.float32(total)


@parallel_kernel()
def _quantize_rows(x, xq, dx, xsq, block):  # pragma: no cover - compiled
    """:func:`_quantize_task` over every row of ``x``, in tasks of ``block`` rows."""
    rows = x.shape[0]
    for blk in prange((rows + block - 1) // block):
        _quantize_task(x, xq, dx, xsq, blk * block, min(blk * block + block, rows))


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x [T, K]`` (float32, ``K`` a multiple of 32) as ggml's Q8_0 blocks (the module docstring):
    ``(q, d, qsum)`` with ``q`` int8 ``[T, K]`` (values in ``[-127, 127]``), ``d`` float32
    ``[T, K/32]`` (the f16 scale of each block, as float32) and ``qsum`` float32 ``[T, K/32]``
    (``d * sum(q)`` of each block, the sum of its dequantized values). Bitwise
    ``gguf.quants.quantize(x, Q8_0)`` (its ``d`` and ``qs``), for finite ``x``.

    Raises:
        ValueError: ``x`` not 2-D, or ``K`` not a multiple of 32.
    """
    return _quantize_activations(x, 32, 32, np.float32, _quantize_rows, _quantize_task)


def _quantize_activations(x: np.ndarray, block: int, group: int, sums_dtype, rows_kernel, task):
    """The driver of :func:`quantize_q8_0` and :func:`quantize_q8_k`: ``x [T, K]`` checked,
    the outputs allocated (int8 quants ``[T, K]``, float32 scales ``[T, K/block]``, sums
    ``[T, K/group]`` of ``sums_dtype``), the rows quantized by ``task`` on this thread or by
    ``rows_kernel`` (a :class:`ParallelKernel` over tasks of rows) on numba's threads.

    Raises:
        ValueError: ``x`` not 2-D, or ``K`` not a multiple of ``block``.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"x must be [T, K] with K a multiple of {block}, got {x.shape}")
    rows, k = x.shape
    xq = np.empty((rows, k), dtype=np.int8)
    dx = np.empty((rows, k // block), dtype=np.float32)
    sums = np.empty((rows, k // group), dtype=sums_dtype)
    threads = get_num_threads()
    if threads > 1 and rows >= QUANTIZE_PARALLEL_MIN_ROWS:
        rows_kernel.parallel(x, xq, dx, sums, -(-rows // (4 * threads)))
    elif rows:
        task(x, xq, dx, sums, 0, rows)
    return xq, dx, sums


# ---------------------------------------------------------------------------------------
# The K-quants' activations: ggml's Q8_K blocks.


@njit(cache=True)
def _quantize_k_task(x, xq, dx, bs, t0, t1):  # pragma: no cover - compiled
    """Rows ``t0 .. t1 - 1`` of ``x`` into ggml's Q8_K blocks (:func:`quantize_q8_k`): the
    quants ``xq``, the scales ``dx`` (float32 ``[T, K/256]``) and the quant sums of each 16,
    ``bs`` (int32 ``[T, K/16]``)."""
    nb = _U(dx.shape[1])
    xf, qf, bf = x.reshape(-1), xq.reshape(-1), bs.reshape(-1)
    for t in range(_U(t0), _U(t1)):
        for b in range(nb):
            c, o = (t * nb + b) * _U(256), (t * nb + b) * _U(16)
            amax = _block_amax(xf, c)
            for i in range(_U(32), _U(256), _U(32)):
                amax = max(amax, _block_amax(xf, c + i))
            if amax == np.float32(0.0):
                for i in range(_U(256)):
                    qf[c + i] = 0
                for g in range(_U(16)):
                    bf[o + g] = 0
                dx[t, b] = np.float32(0.0)
                continue
            top = amax
            for i in range(_U(256)):  # the first value of that magnitude, with its sign (ggml's scan)
                if abs(xf[c + i]) == amax:
                    top = xf[c + i]
                    break
            iscale = np.float32(-127.0) / top  # |iscale * x| <= 127 (1 + 2**-23): never rounds past 127
            for g in range(_U(0), _U(256), _U(16)):
                bf[o + g // _U(16)] = _round16_even(xf, c + g, iscale, qf, c + g)
            dx[t, b] = np.float32(1.0) / iscale


@parallel_kernel()
def _quantize_k_rows(x, xq, dx, bs, block):  # pragma: no cover - compiled
    """:func:`_quantize_k_task` over every row of ``x``, in tasks of ``block`` rows."""
    rows = x.shape[0]
    for blk in prange((rows + block - 1) // block):
        _quantize_k_task(x, xq, dx, bs, blk * block, min(blk * block + block, rows))


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x [T, K]`` (float32, ``K`` a multiple of 256) as ggml's Q8_K blocks, the K-quants'
    activations: ``(q, d, bsums)`` with ``q`` int8 ``[T, K]`` (in ``[-127, 127]``), ``d``
    float32 ``[T, K/256]`` (``q`` stands for ``d * q``) and ``bsums`` int32 ``[T, K/16]``
    (the quants' sums in groups of 16). Bitwise ggml's ``quantize_row_q8_K_ref``
    (``ggml-quants.c``; x86's ``quantize_row_q8_K`` calls it) and its NumPy twin
    :func:`refengine.quant.gguf_blocks.reference_quantize_q8_k`, for finite ``x``: per block
    of 256, ``top`` the first value of largest magnitude, ``iscale = -127 / top``,
    ``q = nearest_int(iscale * x)`` (half to even), ``d = 1 / iscale``.

    Raises:
        ValueError: ``x`` not 2-D, or ``K`` not a multiple of 256.
    """
    return _quantize_activations(x, 256, 16, np.int32, _quantize_k_rows, _quantize_k_task)


# ---------------------------------------------------------------------------------------
# Vector operations on the interleaved slices.


@intrinsic
def b64_load(typingctx, arr, idx):
    """Elements ``idx .. idx + 63`` (flat) of a C-contiguous int8 or uint8 array, as :data:`i8x64`. Not bounds-checked."""
    if not (is_c_array(arr, types.uint8, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _B64), align=1)

    return i8x64(arr, idx), codegen


@intrinsic
def b64_bcast4(typingctx, arr, idx):
    """Bytes ``idx .. idx + 3`` (flat) of a C-contiguous int8 array in each of the sixteen
    32-bit lanes of an :data:`i8x64`: four activation quants for every row. Not bounds-checked."""
    if not (is_c_array(arr, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        one = ir.VectorType(I32, 1)
        word = builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], one), align=1)
        return builder.bitcast(ir_splat(builder, builder.extract_element(word, I32(0)), I16L), _B64)

    return i8x64(arr, idx), codegen


@intrinsic
def b64_low_nibbles(typingctx, v):
    """``v & 15`` lane-wise: the low nibble of each byte."""
    if v != i8x64:
        return None

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], ir.Constant(_B64, [15] * 64))

    return i8x64(v), codegen


@intrinsic
def b64_high_nibbles(typingctx, v):
    """``v >> 4`` lane-wise (logical): the high nibble of each byte."""
    if v != i8x64:
        return None

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], ir.Constant(_B64, [4] * 64))

    return i8x64(v), codegen


@intrinsic
def b64_fifth_bits(typingctx, v, arr, idx):
    """``v`` with 16 added to byte ``i`` where bit ``i`` of the little-endian 64-bit word at
    bytes ``idx .. idx + 7`` of the C-contiguous uint8 array is set: Q5's fifth bits (a mask
    register and a masked add or blend on AVX-512). Not bounds-checked."""
    if not (v == i8x64 and is_c_array(arr, types.uint8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        one = ir.VectorType(ir.IntType(64), 1)
        word = builder.load(vector_ptr(context, builder, sig.args[1], args[1], sig.args[2], args[2], one), align=1)
        bits = builder.bitcast(builder.extract_element(word, I32(0)), ir.VectorType(ir.IntType(1), 64))
        return builder.or_(args[0], builder.select(bits, ir.Constant(_B64, [16] * 64), ir.Constant(_B64, [0] * 64)))

    return i8x64(v, arr, idx), codegen


@intrinsic
def b64_top_two_bits(typingctx, v, h, shift):
    """``v | ((h >> shift) & 3) << 4`` lane-wise (``v`` nibbles, ``h`` bytes, ``shift`` an
    integer): Q6_K's quants, a nibble and its top two bits."""
    if not (v == i8x64 and h == i8x64 and isinstance(shift, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        amount = ir_splat(builder, context.cast(builder, args[2], sig.args[2], types.uint8), _B64)
        bits = builder.and_(builder.lshr(args[1], amount), ir.Constant(_B64, [3] * 64))
        return builder.or_(args[0], builder.shl(bits, ir.Constant(_B64, [4] * 64)))

    return i8x64(v, h, shift), codegen


@intrinsic
def q16_zero(typingctx):
    """Sixteen int32 zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(I16L, None)

    return i32x16(), codegen


@intrinsic
def q16_sum(typingctx, a, b):
    """``a + b`` lane-wise (int32)."""
    if not (a == i32x16 and b == i32x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return i32x16(a, b), codegen


def _dpbusd_intrinsic(small: bool):
    """An intrinsic ``(acc, a, b) -> acc + sum_{i<4} a[4l + i] * b[4l + i]`` in each int32
    lane ``l``, ``a`` unsigned and ``b`` signed bytes, exact (at most ``32 * 255 * 127`` a
    block): AVX512-VNNI's ``vpdpbusd``; else AVX-VNNI's on each 256-bit half; else, for
    ``small`` operands ``a < 128`` whose adjacent products cannot saturate an int16, AVX2's
    ``vpmaddubsw`` then ``vpmaddwd`` by ones on each half (llama.cpp's
    ``mul_sum_us8_pairs_float``); else generic IR."""
    @intrinsic
    def dpbusd(typingctx, acc, a, b):
        if not (acc == i32x16 and a == i8x64 and b == i8x64):
            return None

        def codegen(context, builder, sig, args):
            acc, a, b = args
            if _has_avx512_vnni(context):
                return _call(builder, "llvm.x86.avx512.vpdpbusd.512", I16L, acc, builder.bitcast(a, I16L),
                             builder.bitcast(b, I16L))
            if _has_vnni(context) or (small and _has_avx2(context)):
                halves = []
                for h in (0, 32):
                    ah = builder.shuffle_vector(a, a, _mask(range(h, h + 32)))
                    bh = builder.shuffle_vector(b, b, _mask(range(h, h + 32)))
                    if _has_vnni(context):
                        halves.append(_call(builder, "llvm.x86.avx512.vpdpbusd.256", I8, ir.Constant(I8, None),
                                            builder.bitcast(ah, I8), builder.bitcast(bh, I8)))
                    else:
                        p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, ah, bh)
                        halves.append(_call(builder, "llvm.x86.avx2.pmadd.wd", I8, p16, ir.Constant(_W16, [1] * 16)))
                return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], _mask(range(16))))
            wide = ir.VectorType(ir.IntType(32), 64)
            prod = builder.mul(builder.zext(a, wide), builder.sext(b, wide))
            return builder.add(acc, _pairs(builder, _pairs(builder, prod, ir.VectorType(ir.IntType(32), 32)), I16L))

        return i32x16(acc, a, b), codegen

    return dpbusd


#: :func:`_dpbusd_intrinsic` for any unsigned bytes (Q8_0's ``q + 128``).
q16_dpbusd = _dpbusd_intrinsic(False)
#: :func:`_dpbusd_intrinsic` for bytes below 128 (the 4-, 5- and 6-bit quants: ``2 * 127 * 127``
#: fits an int16).
q16_dpbusd_small = _dpbusd_intrinsic(True)


# ---------------------------------------------------------------------------------------
# The layout.


def interleave(w, *, keep_row_major: bool = True) -> tuple[np.ndarray, ...]:
    """The interleaved planes of a :class:`GGUFWeight` ``w [N, K]`` of a type in
    :data:`INTEGER_TYPES`, built at its first product and kept on ``w`` (dropped on pickle).
    ``keep_row_major=False`` then drops ``w``'s own planes, which :func:`row_major_planes`
    rebuilds where something still reads them (:func:`interleave_model`: an engine whose
    products all run here keeps one copy of each matrix, not two); the interleaved planes
    are then written over the row-major ones' buffers where the row count allows (a
    multiple of 16) and the sizes match, so ``w`` must own them (not share them with another
    weight; the loaders' weights do), and the product plans built on them are dropped with them.

    Returns:
        ``(qr, hr, sr, dr, mr)`` for ``G = ceil(N / 16)`` groups of rows (rows past ``N`` have
        zero quants and scales) and ``nb`` blocks a row (``K / 32``, or ``K / 256`` for the
        K-quants' superblocks). ``qr`` uint8 flat ``[G, nb, S, 16, 4]``: slice ``s`` of
        group ``g``'s block ``b`` holds quant bytes ``4s .. 4s + 3`` of each of the sixteen
        rows (``S`` = 4 slices of nibble bytes, 8 for Q8_0, whose bytes are ``q + 128``, 32
        for the K-quants: Q4_K/Q5_K's ``qs``, Q6_K's ``ql``). ``hr`` uint8: Q5_0/Q5_1 flat
        ``[G, nb, 4, 2, 8]``, per slice the fifth bits of its low nibbles' quants, then of its
        high nibbles', as 64-bit little-endian masks (bit ``4r + c`` for row ``r``, byte
        ``c``); Q5_K ``[G, nb, 8, 8, 8]``, per sub-block of 32 and slice of its chunk, that
        mask; Q6_K ``[G, nb, 16, 16, 4]``, its ``qh`` bytes in slices as ``qr``; else empty.
        ``sr``: Q4_K/Q5_K uint8 ``[G, nb, 16, 16]``, the eight 6-bit scales then the eight
        mins (:func:`~refengine.quant.gguf_blocks.k_scales_mins`) of each row; Q6_K int8
        ``[G, nb, 16, 16]``, its sixteen scales; else empty. ``dr``, ``mr`` uint16 flat
        ``[G, nb, 16]``: the rows' f16 scales ``d`` and minimums (``m``: Q4_1, Q5_1;
        ``dmin``: Q4_K, Q5_K; else empty).
    Raises:
        ValueError: ``w`` of another type.
    """
    if w.format not in _KERNELS:
        raise ValueError(f"no interleaved layout for GGUF type {w.format!r}; types: {', '.join(INTEGER_TYPES)}")
    planes = w.__dict__.get("_x16")
    if planes is None or not keep_row_major:
        with _LOCK:
            planes = w.__dict__.get("_x16")
            if planes is None:
                planes = _interleave(w.format, w.planes, w.shape[0], in_place=not keep_row_major)
                w._x16 = planes
            if not keep_row_major:  # the row-major bytes may be gone: nothing may read them now
                w.__dict__.pop("_plans", None)
                w.drop_planes()
    return planes


def _to_groups(a: np.ndarray, count: int, nb: int, unit: int) -> np.ndarray:
    """The rows ``a [16 count, nb * per]`` of a plane (``per`` items a block) in the
    interleaved order, flat ``[count, nb, per / unit, 16, unit]``: per group of sixteen rows
    and block, slices of ``unit`` items of each row."""
    per = a.shape[1] // nb
    return a.reshape(count, GROUP, nb, per // unit, unit).transpose(0, 2, 3, 1, 4).reshape(-1)


def _from_groups(flat: np.ndarray, groups: int, nb: int, per: int, unit: int, g: np.ndarray,
                 lane: np.ndarray) -> np.ndarray:
    """Rows ``16 g + lane`` of an interleaved plane (:func:`_to_groups`' order), ``[n, nb * per]``."""
    return flat.reshape(groups, nb, per // unit, GROUP, unit)[g, :, :, lane, :].reshape(g.size, nb * per)


def _q5_k_masks(qh: np.ndarray, count: int, nb: int) -> np.ndarray:
    """Q5_K's fifth bits, rows ``qh [16 count, nb * 32]`` (bit ``s`` of byte ``l``: weight
    ``32 s + l``), as :func:`interleave`'s ``hr``: per sub-block ``s`` and slice ``j``, a
    64-bit mask whose bit ``4r + i`` is bit ``s`` of row ``r``'s byte ``4j + i``, flat."""
    bits = np.unpackbits(qh.reshape(count * GROUP, nb, 32, 1), axis=-1, bitorder="little")  # [rows, nb, l, s]
    bits = bits.reshape(count, GROUP, nb, 8, 4, 8).transpose(0, 2, 5, 3, 1, 4)  # [count, nb, s, j, r, i]
    return np.packbits(bits.reshape(count, nb, 8, 8, 64), axis=-1, bitorder="little").reshape(-1)


def row_major_planes(w, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``w``'s planes (:class:`GGUFWeight`'s row-major layout) rebuilt from its interleaved
    ones, for the rows ``rows`` (int ``[n]``; None: all): the inverse of :func:`interleave`.

    Returns:
        name -> C-contiguous plane of ``n`` rows, as :class:`GGUFWeight` holds them: with
        ``nb = K / 32``, ``d`` (and ``m``) uint16 ``[n, nb]``, ``qh`` uint32 ``[n, nb]`` (Q5
        types), ``qs`` uint8 ``[n, 16 nb]``, or int8 ``[n, 32 nb]`` for Q8_0; the K-quants'
        planes of ``K / 256`` superblocks (``d``, ``dmin``, ``scales``, ``qh``, ``qs``; Q6_K
        ``ql``, ``qh``, ``scales``, ``d``).
    Raises:
        IndexError: a row outside ``[-N, N)``.
    """
    qr, hr, sr, dr, mr = w.__dict__["_x16"]
    fmt = w.format
    n, nb = w.shape[0], w.shape[1] // w.block_size
    rows = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < -n or rows.max() >= n):
        raise IndexError(f"rows outside [-{n}, {n}) of a {fmt} weight {w.shape}")
    rows = rows % max(n, 1)
    g, lane = rows // GROUP, rows % GROUP
    groups = -(-n // GROUP)

    def take(flat, per, unit):
        return _from_groups(flat, groups, nb, per, unit, g, lane)

    qs = take(qr, GROUP_BLOCK_BYTES[fmt] // GROUP, 4)
    out = {"d": take(dr, 1, 1)}
    if fmt == "Q8_0":
        qs = (qs ^ np.uint8(0x80)).view(np.int8)
    if fmt == "Q6_K":
        out.update(ql=qs, qh=take(hr, 64, 4), scales=take(sr, 16, 1))
        return {k: np.ascontiguousarray(v) for k, v in out.items()}
    if mr.size:
        out["dmin" if fmt in Q8_K_TYPES else "m"] = take(mr, 1, 1)
    if fmt in Q8_K_TYPES:  # Q4_K, Q5_K
        pairs = take(sr, 16, 1).reshape(rows.size, nb, 16)
        out["scales"] = k_pack_scales_mins(pairs[..., :8], pairs[..., 8:]).reshape(rows.size, nb * 12)
        if hr.size:
            bits = np.unpackbits(hr.reshape(groups, nb, 8, 8, 8)[g], axis=-1, bitorder="little")  # [n, nb, s, j, 64]
            bits = bits.reshape(rows.size, nb, 8, 8, GROUP, 4)[np.arange(rows.size), :, :, :, lane, :]  # n, nb, s, j, i
            qh = np.packbits(bits.transpose(0, 1, 3, 4, 2), axis=-1, bitorder="little")  # bit s of byte 4j + i
            out["qh"] = qh.reshape(rows.size, nb * 32)
    elif hr.size:
        bits = np.unpackbits(hr.reshape(groups, nb, 4, 2, 8)[g], axis=-1, bitorder="little")  # the rows' groups only
        bits = bits.reshape(rows.size, nb, 4, 2, GROUP, 4)[np.arange(rows.size), :, :, :, lane, :]  # [n, nb, s, h, c]
        weight = bits.transpose(0, 1, 3, 2, 4).reshape(rows.size, nb, 32).astype(np.uint32)  # bit 16h + 4s + c
        out["qh"] = (weight << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    out["qs"] = qs
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def interleave_model(model) -> int:
    """Interleave every matrix of ``model`` (the decoder layers' and the ``lm_head``, parts of
    stacked ones included) whose type has a kernel here (:data:`INTEGER_TYPES`), dropping its
    row-major planes: for an engine with ``activation_dtype="q8_0"``, whose products of these
    types all run here (a tied embedding's lookups read the interleaved rows,
    :func:`row_major_planes`). Returns how many it interleaved."""
    from refengine.quant import StackedWeight
    from refengine.quant.gguf_blocks import GGUFWeight

    values = [value for layer in getattr(model, "layers", ()) for value in vars(layer).values()]
    values.append(getattr(model, "lm_head", None))
    done = set()
    for value in values:
        for w in value.parts if isinstance(value, StackedWeight) else [value]:
            if isinstance(w, GGUFWeight) and w.format in INTEGER_TYPES and id(w) not in done:
                interleave(w, keep_row_major=False)
                done.add(id(w))
    return len(done)


#: Row-major quant bytes interleaved at a time (at least one group of rows): bounds the temporaries.
_CHUNK_BYTES = 4 << 20


def _interleave(fmt: str, p: dict, n: int, in_place: bool = False) -> tuple[np.ndarray, ...]:
    """:func:`interleave`'s planes from the row-major planes ``p`` of ``n`` rows, a chunk of
    groups at a time. ``in_place`` (with ``n`` a multiple of 16): written over ``p``'s own
    buffers (a group's rows are one contiguous region in both layouts) where the plane keeps
    its size (all but the 32-weight Q5 masks and Q4_K/Q5_K's decoded scales); those
    buffers no longer hold the row-major planes after."""
    groups = -(-n // GROUP)
    nb = p["d"].shape[1]
    qs = (p["ql"] if fmt == "Q6_K" else p["qs"]).view(np.uint8)
    in_place = in_place and n % GROUP == 0

    def target(a):
        return a.reshape(-1) if in_place else np.empty(groups * GROUP * a.shape[1], a.dtype)

    def empty(dtype):
        return np.zeros(0, dtype)

    qr, dr = target(qs), target(p["d"])
    moved = [(qr, qs, 4), (dr, p["d"], 1)]  # (interleaved plane, row-major plane, items a slice)
    minimum = p.get("m", p.get("dmin"))
    mr = empty(np.uint16) if minimum is None else target(minimum)
    if minimum is not None:
        moved.append((mr, minimum, 1))
    hr, sr = empty(np.uint8), empty(np.uint8)
    if fmt in ("Q5_0", "Q5_1"):
        hr = np.empty(groups * nb * 64, np.uint8)
    elif fmt == "Q5_K":
        hr = target(p["qh"])
    if fmt in ("Q4_K", "Q5_K"):
        sr = np.empty(groups * GROUP * nb * 16, np.uint8)
    elif fmt == "Q6_K":
        hr, sr = target(p["qh"]), target(p["scales"])
        moved += [(hr, p["qh"], 4), (sr, p["scales"], 1)]
    chunk = max(1, _CHUNK_BYTES // (GROUP * qs.shape[1]))  # groups at a time
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        count, r0, r1 = g1 - g0, g0 * GROUP, min(n, g1 * GROUP)

        def rows(a):  # the chunk's rows (a copy), zero rows past n
            out = np.zeros((count * GROUP, *a.shape[1:]), a.dtype)
            out[:r1 - r0] = a[r0:r1]
            return out

        for dst, src, unit in moved:
            part = rows(src)
            if dst is qr and fmt == "Q8_0":
                part ^= np.uint8(0x80)  # q + 128 as an unsigned byte
            width = src.shape[1] * GROUP  # items of one group
            dst[g0 * width:g1 * width] = _to_groups(part, count, nb, unit)
        if fmt in ("Q4_K", "Q5_K"):
            pairs = np.concatenate(k_scales_mins(rows(p["scales"]).reshape(count * GROUP, nb, 12)), axis=-1)
            sr[g0 * GROUP * nb * 16:g1 * GROUP * nb * 16] = _to_groups(pairs.reshape(count * GROUP, nb * 16), count,
                                                                       nb, 1)
        if fmt == "Q5_K":
            hr[g0 * GROUP * nb * 32:g1 * GROUP * nb * 32] = _q5_k_masks(rows(p["qh"]), count, nb)
        elif fmt in ("Q5_0", "Q5_1"):
            qh = rows(p["qh"]).astype("<u4").view(np.uint8).reshape(count * GROUP, nb, 4)
            bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [rows, nb, 32]: bit i of each word
            bits = bits.reshape(count, GROUP, nb, 2, 4, 4)  # (low/high nibble, slice, byte)
            bits = bits.transpose(0, 2, 4, 3, 1, 5).reshape(count, nb, 4, 2, 64)
            hr[g0 * nb * 64:g1 * nb * 64] = np.packbits(bits, axis=-1, bitorder="little").reshape(-1)
    return qr, hr, sr, dr, mr


# ---------------------------------------------------------------------------------------
# The kernels.
#
# numba's own inliner (``inline="always"``) re-runs its passes on the callee at every call
# site, dead branches included: the K-quants' superblock pieces and the group store are
# plain cached functions, compiled once for every type (``kind`` an argument there, folded
# when LLVM inlines them into each kernel, as it does), so a kernel of one type no longer
# carries the others' inlined bodies through numba's passes.


@njit(cache=True)
def _k_group_isum(kind, qr, hr, sr, blk, xq, xo):  # pragma: no cover - compiled
    """Superblock ``blk`` of a group, Q4_K or Q5_K: the sixteen rows' ``sum_s sc_s * dot_s``
    over the eight sub-blocks of 32, ``dot_s`` the exact int32 dot of the sub-block's quants
    with the activation quants ``xq[xo + 32 s ...]`` (flat int8). Per chunk ``c`` of 64
    weights, eight slices whose low nibbles are sub-block ``2c``'s quants and high nibbles
    ``2c + 1``'s, two chains; then each chain times its sub-block's scales, lane by lane."""
    isum = q16_zero()
    base = blk * _U(2048)
    for c in range(_U(4)):
        even = q16_zero()
        odd = q16_zero()
        for j in range(_U(8)):
            v = b64_load(qr, base + (c * _U(8) + j) * _U(64))
            lo, hi = b64_low_nibbles(v), b64_high_nibbles(v)
            if kind == Q5_K:
                h = ((blk * _U(8) + _U(2) * c) * _U(8) + j) * _U(8)
                lo, hi = b64_fifth_bits(lo, hr, h), b64_fifth_bits(hi, hr, h + _U(64))
            xc = xo + c * _U(64) + j * _U(4)
            even = q16_dpbusd_small(even, lo, b64_bcast4(xq, xc))
            odd = q16_dpbusd_small(odd, hi, b64_bcast4(xq, xc + _U(32)))
        so = (blk * _U(16) + _U(2) * c) * _U(16)
        scaled = q16_sum(q16_mul(even, q16_load_bytes(sr, so)), q16_mul(odd, q16_load_bytes(sr, so + _U(16))))
        isum = q16_sum(isum, scaled)
    return isum


@njit(cache=True)
def _q6_group_isum(qr, hr, sr, blk, xq, xo):  # pragma: no cover - compiled
    """Superblock ``blk`` of a group, Q6_K: the sixteen rows' ``sum_g sc_g * dot_g`` over the
    sixteen groups of 16 weights, ``dot_g`` the int32 dot of the unsigned 6-bit quants (the
    ``- 32`` comes off in :func:`_block_step`) with ``xq[xo + 16 g ...]``. Per half ``h``
    and half of a quarter's 32 weights, four slices of each quarter ``k``: ``ql``'s chunk
    ``(h, k % 2)`` (low nibble for ``k < 2``) with bits ``2k, 2k + 1`` of the ``qh`` slice
    (ggml's ``dequantize_row_q6_K``), four chains."""
    isum = q16_zero()
    lb, hb = blk * _U(2048), blk * _U(1024)
    for h in range(_U(2)):
        for half in range(_U(2)):
            a0 = a1 = a2 = a3 = q16_zero()
            for jj in range(_U(4)):
                j = half * _U(4) + jj
                top = b64_load(hr, hb + (h * _U(8) + j) * _U(64))
                v0 = b64_load(qr, lb + (h * _U(16) + j) * _U(64))
                v1 = b64_load(qr, lb + (h * _U(16) + _U(8) + j) * _U(64))
                xc = xo + h * _U(128) + j * _U(4)
                a0 = q16_dpbusd_small(a0, b64_top_two_bits(b64_low_nibbles(v0), top, 0), b64_bcast4(xq, xc))
                a1 = q16_dpbusd_small(a1, b64_top_two_bits(b64_low_nibbles(v1), top, 2), b64_bcast4(xq, xc + _U(32)))
                a2 = q16_dpbusd_small(a2, b64_top_two_bits(b64_high_nibbles(v0), top, 4), b64_bcast4(xq, xc + _U(64)))
                a3 = q16_dpbusd_small(a3, b64_top_two_bits(b64_high_nibbles(v1), top, 6), b64_bcast4(xq, xc + _U(96)))
            so = (blk * _U(16) + h * _U(8) + half) * _U(16)  # group 8h + 2k + half: 32 bytes a quarter
            s01 = q16_sum(q16_mul(a0, q16_load_bytes(sr, so)), q16_mul(a1, q16_load_bytes(sr, so + _U(32))))
            s23 = q16_sum(q16_mul(a2, q16_load_bytes(sr, so + _U(64))), q16_mul(a3, q16_load_bytes(sr, so + _U(96))))
            isum = q16_sum(isum, q16_sum(s01, s23))
    return isum


@njit(inline="always")
def _group_isum(kind, qr, hr, sr, blk, xq, xo):  # pragma: no cover - compiled
    """Block ``blk`` (counted over groups and blocks) of a group: the sixteen rows' exact
    int32 dots of their unsigned quant bytes with the activation quants ``xq[xo ...]`` (flat
    int8), in two interleaved chains (low and high nibbles, or even and odd slices); the
    K-quants' superblocks with their sub-blocks' scales (:func:`_k_group_isum`,
    :func:`_q6_group_isum`)."""
    if kind == Q4_K or kind == Q5_K:
        return _k_group_isum(kind, qr, hr, sr, blk, xq, xo)
    if kind == Q6_K:
        return _q6_group_isum(qr, hr, sr, blk, xq, xo)
    i0 = q16_zero()
    i1 = q16_zero()
    if kind == Q8_0:
        base = blk * _U(512)
        for s in range(_U(0), _U(8), _U(2)):
            i0 = q16_dpbusd(i0, b64_load(qr, base + s * _U(64)), b64_bcast4(xq, xo + s * _U(4)))
            i1 = q16_dpbusd(i1, b64_load(qr, base + (s + _U(1)) * _U(64)), b64_bcast4(xq, xo + (s + _U(1)) * _U(4)))
    else:
        base = blk * _U(256)
        for s in range(_U(4)):
            v = b64_load(qr, base + s * _U(64))
            lo, hi = b64_low_nibbles(v), b64_high_nibbles(v)
            if kind == Q5_0 or kind == Q5_1:
                h = blk * _U(64) + s * _U(16)
                lo, hi = b64_fifth_bits(lo, hr, h), b64_fifth_bits(hi, hr, h + _U(8))
            i0 = q16_dpbusd_small(i0, lo, b64_bcast4(xq, xo + s * _U(4)))
            i1 = q16_dpbusd_small(i1, hi, b64_bcast4(xq, xo + _U(16) + s * _U(4)))
    return q16_sum(i0, i1)


@njit(cache=True)
def _k_block_step(kind, isum, bs, dx, t, b, sr, dr, mr, blk, acc, accm):  # pragma: no cover - compiled
    """Superblock ``b`` of activation row ``t`` into that row's accumulators, K-quants (the
    module docstring's chain): Q4_K/Q5_K's minimums meet only the activations' sums,
    ``msum = sum_s m_s * (bs[2s] + bs[2s + 1])``; Q6_K's ``- 32`` is ``-32 sum_g sc_g bs[g]``;
    then ``acc += float(isum) * (d_w * dx)`` and ``accm += float(msum) * (dmin_w * -dx)``,
    a multiply and an add (no FMA: ggml's scalar order, and a NumPy twin's)."""
    o = b * _U(16)
    d = dx[t, b]
    if kind == Q6_K:
        offset = q16_zero()
        for g in range(_U(16)):
            offset = q16_sum(offset, q16_mul_int(q16_load_bytes(sr, (blk * _U(16) + g) * _U(16)), bs[t, o + g]))
        isum = q16_sum(isum, q16_mul_int(offset, -32))
    else:
        msum = q16_zero()
        for s in range(_U(8)):
            pair = bs[t, o + _U(2) * s] + bs[t, o + _U(2) * s + _U(1)]
            msum = q16_sum(msum, q16_mul_int(q16_load_bytes(sr, (blk * _U(16) + _U(8) + s) * _U(16)), pair))
        accm = v16_add(accm, v16_mul(q16_to_f(msum), v16_mul(v16_load_f16(mr, blk * _U(16)), v16_splat(-d))))
    acc = v16_add(acc, v16_mul(q16_to_f(isum), v16_mul(v16_load_f16(dr, blk * _U(16)), v16_splat(d))))
    return acc, accm


@njit(inline="always")
def _block_step(kind, isum, qsum, dx, xsq, t, b, sr, dr, mr, blk, acc, accm):  # pragma: no cover - compiled
    """Block ``b`` of activation row ``t`` into that row's accumulators (the module
    docstring's chain): the offset's correction in integers (``qsum[t, b]``, read for the
    types with an offset only), then ``acc += float(isum) * (d_w * dx[t, b])`` and, with a
    minimum, ``accm += m_w * xsq[t, b]``. The K-quants: :func:`_k_block_step` (``qsum`` their ``bsums``)."""
    if kind == Q4_K or kind == Q5_K or kind == Q6_K:
        return _k_block_step(kind, isum, qsum, dx, t, b, sr, dr, mr, blk, acc, accm)
    if kind == Q8_0:
        isum = q16_add(isum, -128 * qsum[t, b])
    elif kind == Q4_0:
        isum = q16_add(isum, -8 * qsum[t, b])
    elif kind == Q5_0:
        isum = q16_add(isum, -16 * qsum[t, b])
    scale = v16_mul(v16_load_f16(dr, blk * _U(16)), v16_splat(dx[t, b]))
    acc = v16_fma(q16_to_f(isum), scale, acc)
    if kind == Q4_1 or kind == Q5_1:
        accm = v16_fma(v16_load_f16(mr, blk * _U(16)), v16_splat(xsq[t, b]), accm)
    return acc, accm


@njit(cache=True)
def _store_group(of, t, j, n, acc, accm, tmp):  # pragma: no cover - compiled
    """``out[t, j : j + 16] = acc + accm`` (``of``: ``out [T, n]`` flat), only the columns
    below ``n`` (a last, partial group through ``tmp``)."""
    r = v16_add(acc, accm)
    o = t * n + j
    if j + _U(16) <= n:
        v16_store(of, o, r)
    else:
        v16_store(tmp, 0, r)
        for i in range(n - j):
            of[o + i] = tmp[i]


@njit(inline="always")
def _q8_groups(kind, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """``out[:, 16 g : 16 g + 16] = x̂ @ w[16 g : 16 g + 16].T`` for the groups ``g0 <= g < g1``
    (the task of ``_q4_1_q8_linear`` ...; ``kind`` a constant): ``xq, dx, xsq`` as
    :func:`quantize_q8_0` gives them, ``qsum`` int32 ``[T, nb]`` the activation blocks' quant
    sums (read for the types with an offset); the K-quants' ``xq, dx, qsum`` as
    :func:`quantize_q8_k` gives them (``qsum`` its ``bsums``; ``xsq`` unused); ``qr, hr, sr,
    dr, mr`` from :func:`interleave`, ``tmp`` float32 ``[16]``. Input rows in blocks that
    stay in cache while the task's groups pass; in a block, four rows at a time share each
    loaded slice (LLVM loads and decodes it once for the four), then single rows."""
    rows, k = xq.shape
    nb = _U(dx.shape[1])
    n = _U(out.shape[1])
    kk = _U(k)
    width = _U(256) if kind == Q4_K or kind == Q5_K or kind == Q6_K else _U(32)  # weights a block
    xqf, of = xq.reshape(-1), out.reshape(-1)
    x_block = x_block_rows(k // 4, 4)  # int8 rows: a quarter of a float32 row
    for r0 in range(_U(0), _U(rows), x_block):
        r1 = min(r0 + x_block, _U(rows))
        fours = r0 + (r1 - r0) // _U(4) * _U(4)
        for g in range(_U(g0), _U(g1)):
            j = g * _U(16)
            for t in range(r0, fours, _U(4)):
                t1, t2, t3 = t + _U(1), t + _U(2), t + _U(3)
                a0 = a1 = a2 = a3 = m0 = m1 = m2 = m3 = v16_zero()
                for b in range(nb):
                    blk, c = g * nb + b, t * kk + b * width
                    i0 = _group_isum(kind, qr, hr, sr, blk, xqf, c)
                    i1 = _group_isum(kind, qr, hr, sr, blk, xqf, c + kk)
                    i2 = _group_isum(kind, qr, hr, sr, blk, xqf, c + _U(2) * kk)
                    i3 = _group_isum(kind, qr, hr, sr, blk, xqf, c + _U(3) * kk)
                    a0, m0 = _block_step(kind, i0, qsum, dx, xsq, t, b, sr, dr, mr, blk, a0, m0)
                    a1, m1 = _block_step(kind, i1, qsum, dx, xsq, t1, b, sr, dr, mr, blk, a1, m1)
                    a2, m2 = _block_step(kind, i2, qsum, dx, xsq, t2, b, sr, dr, mr, blk, a2, m2)
                    a3, m3 = _block_step(kind, i3, qsum, dx, xsq, t3, b, sr, dr, mr, blk, a3, m3)
                _store_group(of, t, j, n, a0, m0, tmp)
                _store_group(of, t1, j, n, a1, m1, tmp)
                _store_group(of, t2, j, n, a2, m2, tmp)
                _store_group(of, t3, j, n, a3, m3, tmp)
            for t in range(fours, r1):
                a0 = m0 = v16_zero()
                for b in range(nb):
                    blk = g * nb + b
                    i0 = _group_isum(kind, qr, hr, sr, blk, xqf, t * kk + b * width)
                    a0, m0 = _block_step(kind, i0, qsum, dx, xsq, t, b, sr, dr, mr, blk, a0, m0)
                _store_group(of, t, j, n, a0, m0, tmp)


# One compiled version per type (the type a constant, so its branches fold away): task, parallel loop.


@njit(cache=True)
def _prepare_input(kind, x, nq, xq, dx, xsq, qsum):  # pragma: no cover - compiled
    """The serial start of a product: the first ``nq`` rows of ``x`` into ``xq, dx, xsq``
    (:func:`_quantize_task`; the K-quants: ``xq, dx, qsum``, :func:`_quantize_k_task`; 0: the
    caller quantized them), then, for the types with an offset, every row's block quant sums
    into ``qsum`` (:func:`_block_qsums`). One call in the kernel, where a decode step's
    one-row products made three from Python."""
    if kind == Q4_K or kind == Q5_K or kind == Q6_K:
        if nq > 0:
            _quantize_k_task(x, xq, dx, qsum, 0, nq)
        return
    if nq > 0:
        _quantize_task(x, xq, dx, xsq, 0, nq)
    if kind == Q8_0 or kind == Q4_0 or kind == Q5_0:
        _block_qsums(xq, qsum)


@njit(cache=True)
def _q8_0_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q8_0 weights."""
    _q8_groups(Q8_0, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q8_0_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q8_0 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q8_0, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q8_0_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q4_0_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q4_0 weights."""
    _q8_groups(Q4_0, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q4_0_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q4_0 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q4_0, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q4_0_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q4_1_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q4_1 weights."""
    _q8_groups(Q4_1, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q4_1_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q4_1 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q4_1, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q4_1_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q5_0_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q5_0 weights."""
    _q8_groups(Q5_0, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q5_0_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q5_0 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q5_0, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q5_0_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q5_1_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q5_1 weights."""
    _q8_groups(Q5_1, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q5_1_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q5_1 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q5_1, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q5_1_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q4_k_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q4_K weights."""
    _q8_groups(Q4_K, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q4_k_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q4_K weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q4_K, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q4_k_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q5_k_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q5_K weights."""
    _q8_groups(Q5_K, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q5_k_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q5_K weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q5_K, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q5_k_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q6_k_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q6_K weights."""
    _q8_groups(Q6_K, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q6_k_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q6_K weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q6_K, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q6_k_q8_groups(xq, dx, xsq, qsum, qr, hr, sr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


_KERNELS = {"Q8_0": _q8_0_q8_linear, "Q4_0": _q4_0_q8_linear, "Q4_1": _q4_1_q8_linear, "Q5_0": _q5_0_q8_linear,
            "Q5_1": _q5_1_q8_linear, "Q4_K": _q4_k_q8_linear, "Q5_K": _q5_k_q8_linear, "Q6_K": _q6_k_q8_linear}


@njit(cache=True)
def _block_qsums(xq, out):  # pragma: no cover - compiled
    """``out[t, b] = sum(xq[t, 32 b : 32 b + 32])``: the activation blocks' int8 quant sums,
    int32 (the offset corrections)."""
    rows, nb = out.shape
    for t in range(rows):
        for b in range(nb):
            s = 0
            for i in range(32 * b, 32 * b + 32):
                s += xq[t, i]
            out[t, b] = s


def q8_linear(x: np.ndarray, w) -> np.ndarray:
    """``quantize_q8_0(x) @ w.T`` -> float32 ``[T, out]`` for a :class:`GGUFWeight` ``w`` of a
    type in :data:`Q8_TYPES`, ``quantize_q8_k(x) @ w.T`` for the K-quants (the module
    docstring), any ``T``.

    Raises:
        ValueError: ``x`` not 2-D with ``in_features`` columns, or ``w`` of another type.
    """
    if w.format not in _KERNELS:
        raise ValueError(f"no integer kernel for GGUF type {w.format!r}; types: {', '.join(INTEGER_TYPES)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [T, {w.shape[1]}] for a {w.format} weight {w.shape}, got {x.shape}")
    rows, n = x.shape[0], w.shape[0]
    out = np.empty((rows, n), dtype=np.float32)
    if rows == 0 or n == 0:
        return out
    kernel, planes, block, tmp, xq, dx, xsq, qsum = gguf_products.product_plan(w, "q8", _q8_plan)
    nq = rows  # quantized by the kernel, into the plan's buffers
    if rows > 1 and w.format in Q8_K_TYPES:
        xq, dx, qsum = quantize_q8_k(x)  # in parallel
        xsq, nq = dx, 0  # unused by the K-quants
    elif rows > 1:
        xq, dx, xsq = quantize_q8_0(x)  # in parallel
        qsum, nq = np.empty(dx.shape, np.int32), 0
    kernel(x, nq, xq, dx, xsq, qsum, *planes, out, block, tmp)
    return out


def _q8_plan(w, threads: int) -> tuple:
    """:func:`refengine.cpu.gguf_products.product_plan` builder of :func:`q8_linear`: the
    kernel (its parallel twin from two threads), the interleaved planes (:func:`interleave`;
    interleaving in place drops the plans built before), groups of rows per task (about four
    tasks per thread), a float32 ``[16]`` scratch per task, and a one-row input's buffers
    ``xq, dx, xsq, qsum``: :func:`quantize_q8_0`'s ``xq`` int8 ``[1, in]``, ``dx`` and ``xsq``
    float32 ``[1, in/32]``, and the block sums, int32 ``[1, in/32]``; for the K-quants
    :func:`quantize_q8_k`'s ``xq``, ``dx`` float32 ``[1, in/256]`` (also passed as the unused
    ``xsq``) and ``bsums`` int32 ``[1, in/16]``."""
    groups = -(-w.shape[0] // GROUP)
    block = max(1, -(-groups // (4 * threads)))
    pair = _KERNELS[w.format]
    k = w.shape[1]
    if w.format in Q8_K_TYPES:
        dx = np.empty((1, k // 256), np.float32)
        row = (np.empty((1, k), np.int8), dx, dx, np.empty((1, k // 16), np.int32))
    else:
        row = (np.empty((1, k), np.int8), np.empty((1, k // 32), np.float32), np.empty((1, k // 32), np.float32),
               np.empty((1, k // 32), np.int32))
    return (pair.for_threads(threads), interleave(w), block, np.empty((-(-groups // block), GROUP), np.float32), *row)


class RowProduct:
    """:func:`q8_linear` of one input row for one weight, with every argument but the row
    bound once (the kernel for ``threads`` numba threads, the interleaved planes, the
    quantized row's buffers): the product a decode step makes over a hundred times, whose
    Python around the kernel call then costs more than the checks and lookups can afford.

    ``run(x)`` takes ``x`` of shape :attr:`in_shape` ``(1, in_features)``, C-contiguous
    float32, unchecked (the caller checks, :meth:`refengine.cpu.layer_ops.NumbaOps.linear`),
    and returns a fresh float32 ``[1, out_features]``, the same bits as :func:`q8_linear`.
    It owns its buffers: one calling thread at a time (one engine's steps).
    """

    __slots__ = ("weight", "threads", "in_shape", "_kernel", "_inputs", "_tail", "_out_shape")

    def __init__(self, w, threads: int):
        kernel, planes, block, tmp, xq, dx, xsq, qsum = _q8_plan(w, threads)
        self.weight, self.threads, self.in_shape = w, threads, (1, w.shape[1])
        self._kernel, self._inputs, self._tail = kernel, (xq, dx, xsq, qsum, *planes), (block, tmp)
        self._out_shape = (1, w.shape[0])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(self._out_shape, dtype=np.float32)
        self._kernel(x, 1, *self._inputs, out, *self._tail)
        return out

    def bind(self, x: np.ndarray, out: np.ndarray):
        """The product of the buffer ``x`` (:attr:`in_shape`, C-contiguous float32) into the
        buffer ``out`` (float32 ``[1, out_features]``, C-contiguous) as a call of no arguments,
        every argument bound (the captured decode step replays it each step).

        Raises:
            ValueError: ``x`` or ``out`` of another shape.
        """
        if x.shape != self.in_shape or out.shape != self._out_shape:
            raise ValueError(f"a row product of {self.weight.shape} binds x {self.in_shape} and out "
                             f"{self._out_shape}, got {x.shape} and {out.shape}")
        return partial(self._kernel, x, 1, *self._inputs, out, *self._tail)


def linear(x: np.ndarray, w, *, batch_invariant: bool = False) -> np.ndarray:
    """``x [T, in] @ w.T`` -> float32 ``[T, out]`` with Q8_0 (Q8_K) activations where ``w``'s type
    has a kernel here (:func:`q8_linear`, every row count), else the float32 products
    (:func:`refengine.cpu.gguf_products.linear`, with ``batch_invariant``).

    Raises:
        ValueError: ``x`` not 2-D with ``in_features`` columns.
    """
    if w.format in _KERNELS:
        return q8_linear(x, w)
    return gguf_products.linear(x, w, batch_invariant=batch_invariant)


register_kernels(sys.modules[__name__])
