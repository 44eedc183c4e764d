"""Products ``x [T, in] @ w.T`` with GGUF 32-weight block types, activations rounded to Q8_0, in integers.

llama.cpp's scheme for its CPU dot products, ``activation_dtype="q8_0"``. ``w [out, in]``
in Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 (:data:`Q8_TYPES`); ``x`` float32 ``[T, in]``; the result
float32 ``[T, out]``. Entry points: :func:`linear` (any block type: the others fall back to
:func:`refengine.cpu.gguf_products.linear`) and :class:`RowProduct` (one row, bound once).
Two steps:

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
d_x[t, b] * sum(q_x[t, b]), acc_m)`` in order, then ``acc + acc_m``. One activation row or
many (four rows at a time share each loaded slice), one thread or several, any CPU: each
output is this chain, so the bits do not depend on the batch (this path serves every row
count; it has no BLAS twin). The other block types keep their float32 products
(:func:`linear` falls back to :func:`refengine.cpu.gguf_products.linear`).

What it costs and saves: the activations carry ggml's Q8_0 rounding error (each value
within half a step, ``max|x| / 254`` of its block); ``refengine eval perplexity
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
                                f32_to_f16, i32x16, q16_add, q16_to_f, v16_add, v16_fma, v16_load_f16, v16_mul,
                                v16_splat, v16_store, v16_zero)

#: Block types whose products take Q8_0 activations here (the others stay float32).
Q8_TYPES = BLOCKS32
#: From this many rows :func:`quantize_q8_0` runs its rows in parallel.
QUANTIZE_PARALLEL_MIN_ROWS = 64
#: Output rows interleaved per group (the int32 lanes of one AVX-512 register).
GROUP = 16
#: Quant bytes of one group's block, per type: sixteen rows of 16 (4-, 5-bit) or 32 (8-bit).
GROUP_BLOCK_BYTES = {"Q8_0": 512, "Q4_0": 256, "Q4_1": 256, "Q5_0": 256, "Q5_1": 256}

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


@intrinsic
def _block_round(typingctx, x, xo, inv, q, qo):
    """``q[qo + i] = roundf(x[xo + i] * inv)`` for ``i < 32`` (flat float32 ``x``, int8 ``q``;
    ``roundf`` as gguf-py's ``np_roundf``: ``floor(a) + floor(2 * (a - floor(a)))`` of
    ``a = |v|``, with ``v``'s sign, exactly); returns the sum of the 32 quants (int32)."""
    if not (is_c_array(x, types.float32) and is_c_array(q, types.int8) and isinstance(inv, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        scale = ir_splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), F8)
        two = ir.Constant(F8, [2.0] * 8)
        total, parts = None, []
        for v in _block_f8(context, builder, sig, args[:2]):
            v = builder.fmul(v, scale)
            a = _call(builder, "llvm.fabs.v8f32", F8, v)
            fl = _call(builder, "llvm.floor.v8f32", F8, a)
            r = builder.fadd(fl, _call(builder, "llvm.floor.v8f32", F8, builder.fmul(two, builder.fsub(a, fl))))
            qi = builder.fptosi(_call(builder, "llvm.copysign.v8f32", F8, r, v), I8)
            total = qi if total is None else builder.add(total, qi)
            parts.append(builder.trunc(qi, ir.VectorType(ir.IntType(8), 8)))
        lo = builder.shuffle_vector(parts[0], parts[1], _mask(range(16)))
        hi = builder.shuffle_vector(parts[2], parts[3], _mask(range(16)))
        out = builder.shuffle_vector(lo, hi, _mask(range(32)))
        builder.store(out, vector_ptr(context, builder, sig.args[3], args[3], sig.args[4], args[4], _B32), align=1)
        for half in (4, 2, 1):
            total = builder.add(total, builder.shuffle_vector(total, total, _mask([(i + half) % 8 for i in range(8)])))
        return builder.extract_element(total, I32(0))

    return types.int32(x, xo, inv, q, qo), codegen


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
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"x must be [T, K] with K a multiple of 32, got {x.shape}")
    rows, k = x.shape
    xq = np.empty((rows, k), dtype=np.int8)
    dx = np.empty((rows, k // 32), dtype=np.float32)
    xsq = np.empty((rows, k // 32), dtype=np.float32)
    threads = get_num_threads()
    if threads > 1 and rows >= QUANTIZE_PARALLEL_MIN_ROWS:
        _quantize_rows.parallel(x, xq, dx, xsq, -(-rows // (4 * threads)))
    elif rows:
        _quantize_task(x, xq, dx, xsq, 0, rows)
    return xq, dx, xsq


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
#: :func:`_dpbusd_intrinsic` for bytes below 32 (the 4- and 5-bit quants).
q16_dpbusd_small = _dpbusd_intrinsic(True)


# ---------------------------------------------------------------------------------------
# The layout.


def interleave(w, *, keep_row_major: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The interleaved planes of a :class:`GGUFWeight` ``w [N, K]`` of a type in
    :data:`Q8_TYPES`, built at its first product and kept on ``w`` (dropped on pickle).
    ``keep_row_major=False`` then drops ``w``'s own planes, which :func:`row_major_planes`
    rebuilds where something still reads them (:func:`interleave_model`: an engine whose
    products all run here keeps one copy of each matrix, not two); the interleaved planes
    are then written over the row-major ones' buffers where the row count allows (a
    multiple of 16), so ``w`` must own them (not share them with another weight; the
    loaders' weights do), and the product plans built on them are dropped with them.

    Returns:
        ``(qr, hr, dr, mr)`` for ``G = ceil(N / 16)`` groups of rows (rows past ``N`` have
        zero quants and scales) and ``nb = K / 32`` blocks: ``qr`` uint8 flat ``[G, nb, S, 16, 4]``, slice
        ``s`` of group ``g``'s block ``b`` holding bytes ``4s .. 4s + 3`` of each of the
        sixteen rows' quants (``S`` = 4 slices of nibble bytes, or 8 for Q8_0, whose bytes
        are ``q + 128``); ``hr`` uint8 flat ``[G, nb, 4, 2, 8]`` (Q5_0/Q5_1, else empty):
        per slice, the fifth bits of its low nibbles' quants, then of its high nibbles', as
        64-bit little-endian masks (bit ``4r + c`` for row ``r``, byte ``c``); ``dr`` and
        ``mr`` uint16 flat ``[G, nb, 16]``: the rows' f16 scales and (Q4_1, Q5_1) minimums,
        ``mr`` empty for the others.
    Raises:
        ValueError: ``w`` of another type.
    """
    if w.format not in _KERNELS:
        raise ValueError(f"no interleaved layout for GGUF type {w.format!r}; types: {', '.join(Q8_TYPES)}")
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


def row_major_planes(w, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``w``'s planes (:class:`GGUFWeight`'s row-major layout) rebuilt from its interleaved
    ones, for the rows ``rows`` (int ``[n]``; None: all): the inverse of :func:`interleave`.

    Returns:
        name -> C-contiguous plane of ``n`` rows, ``nb = K / 32``: ``d`` (and ``m``) uint16
        ``[n, nb]``, ``qh`` uint32 ``[n, nb]`` (Q5 types), ``qs`` uint8 ``[n, 16 nb]``, or
        int8 ``[n, 32 nb]`` for Q8_0.
    Raises:
        IndexError: a row outside ``[-N, N)``.
    """
    qr, hr, dr, mr = w.__dict__["_x16"]
    n, nb = w.shape[0], w.shape[1] // 32
    rows = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < -n or rows.max() >= n):
        raise IndexError(f"rows outside [-{n}, {n}) of a {w.format} weight {w.shape}")
    rows = rows % max(n, 1)
    g, lane = rows // GROUP, rows % GROUP
    groups = -(-n // GROUP)
    slices = GROUP_BLOCK_BYTES[w.format] // 64
    qs = qr.reshape(groups, nb, slices, GROUP, 4)[g, :, :, lane, :].reshape(rows.size, nb * slices * 4)
    out = {"d": dr.reshape(groups, nb, GROUP)[g, :, lane]}
    if w.format == "Q8_0":
        qs = (qs ^ np.uint8(0x80)).view(np.int8)
    if mr.size:
        out["m"] = mr.reshape(groups, nb, GROUP)[g, :, lane]
    if hr.size:
        bits = np.unpackbits(hr.reshape(groups, nb, 4, 2, 8)[g], axis=-1, bitorder="little")  # the rows' groups only
        bits = bits.reshape(rows.size, nb, 4, 2, GROUP, 4)[np.arange(rows.size), :, :, :, lane, :]  # [n, nb, s, h, c]
        weight = bits.transpose(0, 1, 3, 2, 4).reshape(rows.size, nb, 32).astype(np.uint32)  # bit 16h + 4s + c
        out["qh"] = (weight << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    out["qs"] = qs
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def interleave_model(model) -> int:
    """Interleave every matrix of ``model`` (the decoder layers' and the ``lm_head``, parts of
    stacked ones included) whose type has a kernel here, dropping its row-major planes: for
    an engine with ``activation_dtype="q8_0"``, whose products of these types all run here
    (a tied embedding's lookups read the interleaved rows, :func:`row_major_planes`).
    Returns how many it interleaved."""
    from refengine.quant import StackedWeight
    from refengine.quant.gguf_blocks import GGUFWeight

    values = [value for layer in getattr(model, "layers", ()) for value in vars(layer).values()]
    values.append(getattr(model, "lm_head", None))
    done = set()
    for value in values:
        for w in value.parts if isinstance(value, StackedWeight) else [value]:
            if isinstance(w, GGUFWeight) and w.format in Q8_TYPES and id(w) not in done:
                interleave(w, keep_row_major=False)
                done.add(id(w))
    return len(done)


#: Row-major quant bytes interleaved at a time (at least one group of rows): bounds the temporaries.
_CHUNK_BYTES = 4 << 20


def _interleave(fmt: str, p: dict, n: int, in_place: bool = False) -> tuple[np.ndarray, ...]:
    """:func:`interleave`'s planes from the row-major planes ``p`` of ``n`` rows, a chunk of
    groups at a time. ``in_place`` (with ``n`` a multiple of 16): written over ``p``'s own
    buffers (a group's rows are one contiguous region in both layouts), which no longer
    hold the row-major planes after."""
    groups = -(-n // GROUP)
    nb = p["d"].shape[1]
    qs = p["qs"].view(np.uint8)
    slices = qs.shape[1] // nb // 4
    in_place = in_place and n % GROUP == 0
    with_min = fmt in ("Q4_1", "Q5_1")

    def target(a):
        return a.reshape(-1) if in_place else np.empty(groups * GROUP * a.shape[1], a.dtype)

    qr, dr = target(qs), target(p["d"])
    mr = target(p["m"]) if with_min else np.zeros(0, np.uint16)
    hr = np.empty(groups * nb * 64, np.uint8) if fmt in ("Q5_0", "Q5_1") else np.zeros(0, np.uint8)
    chunk = max(1, _CHUNK_BYTES // (GROUP * qs.shape[1]))  # groups at a time
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        count, r0, r1 = g1 - g0, g0 * GROUP, min(n, g1 * GROUP)

        def rows(a):  # the chunk's rows (a copy), zero rows past n
            out = np.zeros((count * GROUP, *a.shape[1:]), a.dtype)
            out[:r1 - r0] = a[r0:r1]
            return out

        q = rows(qs)
        if fmt == "Q8_0":
            q ^= np.uint8(0x80)  # q + 128 as an unsigned byte
        per = qs.shape[1] * GROUP  # bytes of one group
        qr[g0 * per:g1 * per] = q.reshape(count, GROUP, nb, slices, 4).transpose(0, 2, 3, 1, 4).reshape(-1)
        for src, dst in ((p["d"], dr), (p["m"], mr)) if with_min else ((p["d"], dr),):
            dst[g0 * GROUP * nb:g1 * GROUP * nb] = rows(src).reshape(count, GROUP, nb).transpose(0, 2, 1).reshape(-1)
        if hr.size:
            qh = rows(p["qh"]).astype("<u4").view(np.uint8).reshape(count * GROUP, nb, 4)
            bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [rows, nb, 32]: bit i of each word
            bits = bits.reshape(count, GROUP, nb, 2, 4, 4)  # (low/high nibble, slice, byte)
            bits = bits.transpose(0, 2, 4, 3, 1, 5).reshape(count, nb, 4, 2, 64)
            hr[g0 * nb * 64:g1 * nb * 64] = np.packbits(bits, axis=-1, bitorder="little").reshape(-1)
    return qr, hr, dr, mr


# ---------------------------------------------------------------------------------------
# The kernels.


@njit(inline="always")
def _group_isum(kind, qr, hr, blk, xq, xo):  # pragma: no cover - compiled
    """Block ``blk`` (counted over groups and blocks) of a group: the sixteen rows' exact
    int32 dots of their unsigned quant bytes with the activation quants ``xq[xo : xo + 32]``
    (flat int8), in two interleaved chains (low and high nibbles, or even and odd slices)."""
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


@njit(inline="always")
def _block_step(kind, isum, qsum, dx, xsq, t, b, dr, mr, blk, acc, accm):  # pragma: no cover - compiled
    """Block ``b`` of activation row ``t`` into that row's accumulators (the module
    docstring's chain): the offset's correction in integers (``qsum[t, b]``, read for the
    types with an offset only), then ``acc += float(isum) * (d_w * dx[t, b])`` and, with a
    minimum, ``accm += m_w * xsq[t, b]``."""
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


@njit(inline="always")
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
def _q8_groups(kind, xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """``out[:, 16 g : 16 g + 16] = x̂ @ w[16 g : 16 g + 16].T`` for the groups ``g0 <= g < g1``
    (the task of ``_q4_1_q8_linear`` ...; ``kind`` a constant): ``xq, dx, xsq`` as
    :func:`quantize_q8_0` gives them, ``qsum`` int32 ``[T, nb]`` the activation blocks' quant
    sums (read for the types with an offset), ``qr, hr, dr, mr`` from :func:`interleave`,
    ``tmp`` float32 ``[16]``. Input rows in blocks that stay in cache while the task's
    groups pass; in a block, four rows at a time share each loaded slice (LLVM loads and
    decodes it once for the four), then single rows."""
    rows, k = xq.shape
    nb = _U(dx.shape[1])
    n = _U(out.shape[1])
    kk = _U(k)
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
                    blk, c = g * nb + b, t * kk + b * _U(32)
                    i0 = _group_isum(kind, qr, hr, blk, xqf, c)
                    i1 = _group_isum(kind, qr, hr, blk, xqf, c + kk)
                    i2 = _group_isum(kind, qr, hr, blk, xqf, c + _U(2) * kk)
                    i3 = _group_isum(kind, qr, hr, blk, xqf, c + _U(3) * kk)
                    a0, m0 = _block_step(kind, i0, qsum, dx, xsq, t, b, dr, mr, blk, a0, m0)
                    a1, m1 = _block_step(kind, i1, qsum, dx, xsq, t1, b, dr, mr, blk, a1, m1)
                    a2, m2 = _block_step(kind, i2, qsum, dx, xsq, t2, b, dr, mr, blk, a2, m2)
                    a3, m3 = _block_step(kind, i3, qsum, dx, xsq, t3, b, dr, mr, blk, a3, m3)
                _store_group(of, t, j, n, a0, m0, tmp)
                _store_group(of, t1, j, n, a1, m1, tmp)
                _store_group(of, t2, j, n, a2, m2, tmp)
                _store_group(of, t3, j, n, a3, m3, tmp)
            for t in range(fours, r1):
                a0 = m0 = v16_zero()
                for b in range(nb):
                    blk = g * nb + b
                    i0 = _group_isum(kind, qr, hr, blk, xqf, t * kk + b * _U(32))
                    a0, m0 = _block_step(kind, i0, qsum, dx, xsq, t, b, dr, mr, blk, a0, m0)
                _store_group(of, t, j, n, a0, m0, tmp)


# One compiled version per type (the type a constant, so its branches fold away): task, parallel loop.


@njit(cache=True)
def _prepare_input(kind, x, nq, xq, dx, xsq, qsum):  # pragma: no cover - compiled
    """The serial start of a product: the first ``nq`` rows of ``x`` into ``xq, dx, xsq``
    (:func:`_quantize_task`; 0: the caller quantized them), then, for the types with an
    offset, every row's block quant sums into ``qsum`` (:func:`_block_qsums`). One call in
    the kernel, where a decode step's one-row products made three from Python."""
    if nq > 0:
        _quantize_task(x, xq, dx, xsq, 0, nq)
    if kind == Q8_0 or kind == Q4_0 or kind == Q5_0:
        _block_qsums(xq, qsum)


@njit(cache=True)
def _q8_0_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q8_0 weights."""
    _q8_groups(Q8_0, xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q8_0_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q8_0 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q8_0, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q8_0_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q4_0_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q4_0 weights."""
    _q8_groups(Q4_0, xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q4_0_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q4_0 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q4_0, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q4_0_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q4_1_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q4_1 weights."""
    _q8_groups(Q4_1, xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q4_1_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q4_1 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q4_1, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q4_1_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q5_0_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q5_0 weights."""
    _q8_groups(Q5_0, xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q5_0_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q5_0 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q5_0, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q5_0_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


@njit(cache=True)
def _q5_1_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp):  # pragma: no cover - compiled
    """:func:`_q8_groups` for Q5_1 weights."""
    _q8_groups(Q5_1, xq, dx, xsq, qsum, qr, hr, dr, mr, out, g0, g1, tmp)


@parallel_kernel()
def _q5_1_q8_linear(x, nq, xq, dx, xsq, qsum, qr, hr, dr, mr, out, block, tmp):  # pragma: no cover - compiled
    """Q5_1 weights: ``out [T, N]`` in tasks of ``block`` groups of rows (task ``i`` uses ``tmp[i]``),
    after :func:`_prepare_input`."""
    _prepare_input(Q5_1, x, nq, xq, dx, xsq, qsum)
    groups = (out.shape[1] + 15) // 16
    for i in prange((groups + block - 1) // block):
        _q5_1_q8_groups(xq, dx, xsq, qsum, qr, hr, dr, mr, out, i * block, min(i * block + block, groups), tmp[i])


_KERNELS = {"Q8_0": _q8_0_q8_linear, "Q4_0": _q4_0_q8_linear, "Q4_1": _q4_1_q8_linear,
            "Q5_0": _q5_0_q8_linear, "Q5_1": _q5_1_q8_linear}


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
    type in :data:`Q8_TYPES` (the module docstring), any ``T``.

    Raises:
        ValueError: ``x`` not 2-D with ``in_features`` columns, or ``w`` of another type.
    """
    if w.format not in _KERNELS:
        raise ValueError(f"no Q8_0-activation kernel for GGUF type {w.format!r}; types: {', '.join(Q8_TYPES)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [T, {w.shape[1]}] for a {w.format} weight {w.shape}, got {x.shape}")
    rows, n = x.shape[0], w.shape[0]
    out = np.empty((rows, n), dtype=np.float32)
    if rows == 0 or n == 0:
        return out
    kernel, planes, block, tmp, xq, dx, xsq, qsum = gguf_products.product_plan(w, "q8", _q8_plan)
    nq = rows  # quantized by the kernel, into the plan's buffers
    if rows > 1:
        xq, dx, xsq = quantize_q8_0(x)  # in parallel
        qsum, nq = np.empty(dx.shape, np.int32), 0
    kernel(x, nq, xq, dx, xsq, qsum, *planes, out, block, tmp)
    return out


def _q8_plan(w, threads: int) -> tuple:
    """:func:`refengine.cpu.gguf_products.product_plan` builder of :func:`q8_linear`: the
    kernel (its parallel twin from two threads), the interleaved planes (:func:`interleave`;
    interleaving in place drops the plans built before), groups of rows per task (about four
    tasks per thread), a float32 ``[16]`` scratch per task, and a one-row input's buffers:
    :func:`quantize_q8_0`'s ``xq`` int8 ``[1, in]``, ``dx`` and ``xsq`` float32 ``[1, in/32]``,
    and the block sums, int32 ``[1, in/32]``."""
    groups = -(-w.shape[0] // GROUP)
    block = max(1, -(-groups // (4 * threads)))
    pair = _KERNELS[w.format]
    k = w.shape[1]
    return (pair.for_threads(threads), interleave(w), block,
            np.empty((-(-groups // block), GROUP), np.float32), np.empty((1, k), np.int8),
            np.empty((1, k // 32), np.float32), np.empty((1, k // 32), np.float32), np.empty((1, k // 32), np.int32))


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
    """``x [T, in] @ w.T`` -> float32 ``[T, out]`` with Q8_0 activations where ``w``'s type has
    a kernel here (:func:`q8_linear`, every row count), else the float32 products
    (:func:`refengine.cpu.gguf_products.linear`, with ``batch_invariant``).

    Raises:
        ValueError: ``x`` not 2-D with ``in_features`` columns.
    """
    if w.format in _KERNELS:
        return q8_linear(x, w)
    return gguf_products.linear(x, w, batch_invariant=batch_invariant)


register_kernels(sys.modules[__name__])
