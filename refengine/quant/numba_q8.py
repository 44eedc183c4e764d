"""Products of GGUF 32-weight block types with the activations quantized to ggml's Q8_0
blocks, in integers: llama.cpp's scheme for its CPU dot products, ``activation_dtype="q8_0"``.

``x [T, in] @ w.T`` for ``w [out, in]`` in Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1, in two steps:

1. :func:`quantize_q8_0` rounds each row of ``x`` to Q8_0 blocks, exactly as ggml's
   reference ``quantize_row_q8_0_ref`` (``ggml-quants.c``) and gguf-py's
   ``gguf.quants.quantize(x, Q8_0)`` do: per block of 32, ``d = max|x| / 127`` (stored as
   f16), ``q = roundf(x / d)`` (half away from zero; ``x * (1 / d)`` with the float32
   ``d``), ``q`` in ``[-127, 127]``. The value it stands for is ``x̂ = f16(d) * q``.
2. The fused kernels take a block's 32 weight quants as bytes (Q4_0 and Q5_0 with their
   offset, ``q - 8`` and ``q - 16``, applied in integers), multiply them with the block's
   activation quants and sum the products in integers, exactly; then one conversion to
   float32 and one FMA per block add ``d_w * d_x * sum`` to eight float32 accumulators.
   Q4_1 and Q5_1 add their minimum, ``m_w * sum(x̂)`` per block, with
   ``sum(x̂) = f16(d) * sum(q)`` from the integers. So every output is, up to float32
   rounding, ``dequantize(quantize_q8_0(x)) @ dequantize(w).T`` (tested against gguf-py's
   own quantizer and dequantizer, in float64).

The integer products are llama.cpp's AVX2 ones (``mul_sum_us8_pairs_float``,
``mul_sum_i8_pairs_float``): ``vpmaddubsw`` multiplies 32 unsigned weight bytes with 32
signed activation bytes and adds adjacent pairs into int16, ``vpmaddwd`` by ones adds
those pairs into eight int32 lanes; signed weights go first through ``vpsignb``/``vpabsb``
(``|w| * (x * sign(w))``). With VNNI one ``vpdpbusd`` does both steps, and the kernels
take two blocks per instruction (:func:`_dot64_intrinsic`: 512-bit with AVX512-VNNI).
LLVM does not form these instructions from generic IR (it rewrote a ``vpmaddwd`` pattern
into twice the work), so the intrinsics here call them by name on a CPU that has them,
and compute the same sums in generic IR elsewhere.

What it costs and saves: the activations carry ggml's Q8_0 rounding error (each value
within half a step, ``max|x| / 254`` of its block); ``refengine eval perplexity
--activation-dtype q8_0`` measures what that does to a model. Per activation row a pair of
blocks costs one ``vpdpbusd``, one conversion, one multiply (the scales) and one FMA in
AVX-512 registers (AVX2: two integer multiply-adds, one conversion and one FMA per block)
instead of four float32 FMAs per block and the weights' conversion to float32.

Numerics: a block's integer sum is exact whatever the order of its lanes; the float32 sums
run in one fixed order per output (sixteen lanes across the block pairs, even blocks in
lanes 0-7 and odd ones in 8-15, folded into eight (:func:`v16_halves`), an odd last block
added there, :func:`f8_sum`, then the minimum terms as in
:mod:`refengine.quant.numba_gguf`), the same whatever the number of rows, the group a row
falls in, or the threads: batch-invariant at every row count. This
path therefore serves every row count (it has no BLAS twin); the other block types keep
their float32 kernels (:func:`linear` falls back to :func:`refengine.quant.numba_gguf.linear`).
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from refengine.quant import numba_gguf
from refengine.quant.numba_gguf import (
    _BLOCKS32, _F8, _F16L, _I8, _I16L, _I32, CHUNK_ROWS, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, _chunk_scales, _fours_end,
    _halves_to_float, _has_f16c, _is_c_array, _prefetch_pair, _splat, _store_row,
    _vector_ptr, _vector_type, _weighted_sum_f16, f16_to_f32, f32_to_f16, f8_fma, f8_splat, f8_sum,
    f32x8, f32x16, i32x16, q16_to_f, v16_fma, v16_halves, v16_load, v16_mul, v16_zero)
from refengine.runtime.numba_support import get_num_threads, parallel_kernel, register_kernels, x_block_rows

#: Block types whose products take Q8_0 activations here (the others stay float32).
Q8_TYPES = _BLOCKS32
#: From this many rows :func:`quantize_q8_0` runs its rows in parallel.
QUANTIZE_PARALLEL_MIN_ROWS = 64

_U = np.uintp
_B32 = ir.VectorType(ir.IntType(8), 32)
_W16 = ir.VectorType(ir.IntType(16), 16)

_B64 = ir.VectorType(ir.IntType(8), 64)
_W32 = ir.VectorType(ir.IntType(16), 32)

#: Thirty-two int8 lanes (LLVM ``<32 x i8>``, one AVX2 ``ymm`` register): a block's 32 quants.
i8x32 = _vector_type("i8x32", _B32)
#: Sixty-four int8 lanes (LLVM ``<64 x i8>``, one AVX-512 ``zmm`` register, two ``ymm`` where
#: LLVM splits it): the quants of two consecutive blocks.
i8x64 = _vector_type("i8x64", _B64)
#: Eight int32 lanes (LLVM ``<8 x i32>``): a block's integer partial sums.
i32x8 = _vector_type("i32x8", _I8)


def _has_avx2(context) -> bool:
    """Whether the code is compiled for a CPU with AVX2 (numba targets the host CPU; its cache
    is keyed by the CPU's features)."""
    return "+avx2" in str(getattr(context.codegen(), "_tm_features", "")).split(",")


def _has_vnni(context) -> bool:
    """Whether the code is compiled for a CPU with a 256-bit ``vpdpbusd``: AVX-VNNI, or
    AVX512-VNNI with AVX512-VL (numba targets the host CPU, as :func:`_has_avx2`)."""
    features = str(getattr(context.codegen(), "_tm_features", "")).split(",")
    return "+avxvnni" in features or ("+avx512vnni" in features and "+avx512vl" in features)


def _has_avx512_vnni(context) -> bool:
    """Whether the code is compiled for a CPU with the 512-bit ``vpdpbusd`` (AVX512-VNNI)."""
    return "+avx512vnni" in str(getattr(context.codegen(), "_tm_features", "")).split(",")


def _mask(lanes) -> ir.Constant:
    """A shuffle mask: the lane numbers ``lanes``."""
    return ir.Constant(ir.VectorType(_I32, len(lanes)), [_I32(i) for i in lanes])


def _call(builder, name, ret, *vals):
    """A call of the LLVM intrinsic ``name`` returning ``ret``."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [v.type for v in vals]), name)
    return builder.call(fn, vals)


@intrinsic
def b32_load(typingctx, arr, idx):
    """Elements ``idx .. idx + 31`` (flat) of a C-contiguous int8 or uint8 array, as :data:`i8x32`. Not bounds-checked."""
    if not (_is_c_array(arr, types.uint8, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _B32), align=1)

    return i8x32(arr, idx), codegen


@intrinsic
def b32_nibbles(typingctx, arr, idx):
    """The 32 nibbles of bytes ``idx .. idx + 15`` of a C-contiguous uint8 array as
    :data:`i8x32`: lane ``i`` the low nibble of byte ``i``, lane ``i + 16`` its high nibble
    (ggml's order within a 4-bit block)."""
    if not (_is_c_array(arr, types.uint8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        b16 = ir.VectorType(ir.IntType(8), 16)
        v = builder.load(_vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], b16), align=1)
        both = builder.shuffle_vector(v, builder.lshr(v, ir.Constant(b16, [4] * 16)), _mask(range(32)))
        return builder.and_(both, ir.Constant(_B32, [15] * 32))

    return i8x32(arr, idx), codegen


@intrinsic
def b32_high_bits(typingctx, v, word):
    """``v`` with bit ``i`` of the 32-bit ``word`` set as bit 4 of lane ``i`` (``v | 16``
    there): the fifth bit of Q5_0/Q5_1 quants. ggml's ``bytes_from_bits_32`` in generic IR:
    each lane takes its byte of ``word``, tests its bit, and selects 16 or 0."""
    if not (v == i8x32 and isinstance(word, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        w = context.cast(builder, args[1], sig.args[1], types.uint32)
        bytes4 = builder.bitcast(builder.insert_element(ir.Constant(ir.VectorType(_I32, 1), None), w, _I32(0)),
                                 ir.VectorType(ir.IntType(8), 4))
        spread = builder.shuffle_vector(bytes4, bytes4, _mask([i // 8 for i in range(32)]))
        bit = builder.and_(spread, ir.Constant(_B32, [1 << (i % 8) for i in range(32)]))
        set_ = builder.icmp_unsigned("!=", bit, ir.Constant(_B32, [0] * 32))
        return builder.or_(args[0], builder.select(set_, ir.Constant(_B32, [16] * 32), ir.Constant(_B32, [0] * 32)))

    return i8x32(v, word), codegen


@intrinsic
def b32_add(typingctx, v, n):
    """``v + n`` lane-wise (int8, wrapping), ``n`` an integer."""
    if not (v == i8x32 and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], _splat(builder, context.cast(builder, args[1], sig.args[1], types.int8), _B32))

    return i8x32(v, n), codegen


@intrinsic
def b64_load(typingctx, arr, idx):
    """Elements ``idx .. idx + 63`` (flat) of a C-contiguous int8 or uint8 array, as :data:`i8x64`. Not bounds-checked."""
    if not (_is_c_array(arr, types.uint8, types.int8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _B64), align=1)

    return i8x64(arr, idx), codegen


@intrinsic
def b64_nibbles(typingctx, arr, idx):
    """:func:`b32_nibbles` of two consecutive 16-byte blocks at once: bytes ``idx .. idx + 31``
    of a C-contiguous uint8 array as :data:`i8x64`, lanes 0-31 the first block's quants
    (low nibbles, then high), lanes 32-63 the second's."""
    if not (_is_c_array(arr, types.uint8) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _B32), align=1)
        lo = builder.and_(v, ir.Constant(_B32, [15] * 32))
        hi = builder.lshr(v, ir.Constant(_B32, [4] * 32))
        return builder.shuffle_vector(lo, hi, _mask([*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]))

    return i8x64(arr, idx), codegen


@intrinsic
def b64_high_bits(typingctx, v, word0, word1):
    """:func:`b32_high_bits` of two blocks: lanes 0-31 take their fifth bit from ``word0``,
    lanes 32-63 from ``word1``."""
    if not (v == i8x64 and isinstance(word0, types.Integer) and isinstance(word1, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        words = ir.Constant(ir.VectorType(_I32, 2), None)
        for i in (0, 1):
            words = builder.insert_element(words, context.cast(builder, args[1 + i], sig.args[1 + i], types.uint32),
                                           _I32(i))
        bytes8 = builder.bitcast(words, ir.VectorType(ir.IntType(8), 8))
        spread = builder.shuffle_vector(bytes8, bytes8, _mask([i // 8 for i in range(64)]))
        bit = builder.and_(spread, ir.Constant(_B64, [1 << (i % 8) for i in range(64)]))
        set_ = builder.icmp_unsigned("!=", bit, ir.Constant(_B64, [0] * 64))
        return builder.or_(args[0], builder.select(set_, ir.Constant(_B64, [16] * 64), ir.Constant(_B64, [0] * 64)))

    return i8x64(v, word0, word1), codegen


@intrinsic
def b64_add(typingctx, v, n):
    """``v + n`` lane-wise (int8, wrapping), ``n`` an integer."""
    if not (v == i8x64 and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], _splat(builder, context.cast(builder, args[1], sig.args[1], types.int8), _B64))

    return i8x64(v, n), codegen


@intrinsic
def v16_pair(typingctx, a, b):
    """An :data:`f32x16` with ``a`` in lanes 0-7 and ``b`` in lanes 8-15 (two blocks' scales)."""
    if not (isinstance(a, types.Float) and isinstance(b, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        halves = [_splat(builder, context.cast(builder, v, t, types.float32), _F8) for v, t in zip(args, sig.args)]
        return builder.shuffle_vector(halves[0], halves[1], _mask(range(16)))

    return f32x16(a, b), codegen


@intrinsic
def v16_f16_pair(typingctx, arr, idx):
    """Elements ``idx`` and ``idx + 1`` (flat) of a C-contiguous uint16 array of f16 bit
    patterns as an :data:`f32x16`: the first in lanes 0-7, the second in lanes 8-15 (two
    blocks' scales, converted where the loop needs them: one 4-byte load, one shuffle, one
    ``vcvtph2ps`` with F16C, else bit arithmetic; exact either way)."""
    if not (_is_c_array(arr, types.uint16) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        two = ir.VectorType(ir.IntType(16), 2)
        raw = builder.load(_vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], two), align=2)
        wide = builder.shuffle_vector(raw, raw, _mask([0] * 8 + [1] * 8))
        if _has_f16c(context):
            return builder.fpext(builder.bitcast(wide, ir.VectorType(ir.HalfType(), 16)), _F16L)
        return _halves_to_float(builder, builder.zext(wide, _I16L), _I16L, _F16L)

    return f32x16(arr, idx), codegen


def _pairs(builder, v, out):
    """Adjacent lanes of ``v`` added, as ``out`` (``<2n x iK>`` -> ``<n x iM>``, ``M >= K``,
    sign-extended where ``M > K``)."""
    n = out.count

    def lanes(first):
        half = builder.shuffle_vector(v, v, _mask(range(first, 2 * n, 2)))
        return half if out.element.width == v.type.element.width else builder.sext(half, out)

    return builder.add(lanes(0), lanes(1))


def _dot32_ir(context, builder, a, b, is_signed: bool):
    """The IR of :func:`_dot_intrinsic`'s sums for one 32-byte pair ``a`` (weights), ``b``."""
    if _has_avx2(context):
        if is_signed:
            b = _call(builder, "llvm.x86.avx2.psign.b", _B32, b, a)
            a = builder.select(builder.icmp_signed("<", a, ir.Constant(_B32, [0] * 32)), builder.neg(a), a)
        if _has_vnni(context):  # both steps in one instruction, int32 sums, no int16 stage
            return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _I8, ir.Constant(_I8, [0] * 8),
                         builder.bitcast(a, _I8), builder.bitcast(b, _I8))
        p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, a, b)
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _I8, p16, ir.Constant(_W16, [1] * 16))
    wide = ir.VectorType(ir.IntType(16), 32)
    prod = builder.mul(builder.sext(a, wide) if is_signed else builder.zext(a, wide), builder.sext(b, wide))
    return _pairs(builder, _pairs(builder, prod, _W16), _I8)


def _dot_intrinsic(is_signed: bool):
    """An intrinsic ``(w, x) -> i32x8``: the 32 products ``w[i] * x[i]`` summed in fours into
    eight exact int32 lanes (lane ``l``: ``i = 4l .. 4l + 3``); ``x`` int8, ``w`` int8 when
    ``is_signed`` else unsigned bytes.

    On AVX2: ``vpmaddubsw`` (unsigned times signed bytes, adjacent pairs added into int16:
    at most ``2 * 128 * 127`` here, so it never saturates) then ``vpmaddwd`` by ones; signed
    weights first through ``vpsignb``/``vpabsb`` (``|w| * (x * sign(w))``), as llama.cpp's
    ``mul_sum_i8_pairs_float``. With AVX-VNNI or AVX512-VNNI, one ``vpdpbusd`` instead of
    the two (the same sums: no int16 stage to saturate). Elsewhere the same sums in generic IR."""
    @intrinsic
    def dot(typingctx, w, x):
        if not (w == i8x32 and x == i8x32):
            return None

        def codegen(context, builder, sig, args):
            return _dot32_ir(context, builder, args[0], args[1], is_signed)

        return i32x8(w, x), codegen

    return dot


def _dot64_intrinsic(is_signed: bool):
    """:func:`_dot_intrinsic` of two blocks at once: ``(w, x) -> i32x16`` for :data:`i8x64`
    operands, lanes 0-7 the first 32 bytes' sums, 8-15 the second's. With AVX512-VNNI one
    512-bit ``vpdpbusd`` (signed weights: ``|w|`` and ``x`` negated where ``w < 0``, as
    AVX-512 has no ``vpsignb``); elsewhere each half as :func:`_dot_intrinsic` and the two joined."""
    @intrinsic
    def dot(typingctx, w, x):
        if not (w == i8x64 and x == i8x64):
            return None

        def codegen(context, builder, sig, args):
            a, b = args
            if _has_avx512_vnni(context):
                if is_signed:
                    neg = builder.icmp_signed("<", a, ir.Constant(_B64, [0] * 64))
                    b = builder.select(neg, builder.neg(b), b)
                    a = builder.select(neg, builder.neg(a), a)
                return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _I16L, ir.Constant(_I16L, [0] * 16),
                             builder.bitcast(a, _I16L), builder.bitcast(b, _I16L))
            halves = [_dot32_ir(context, builder, builder.shuffle_vector(a, a, _mask(range(h, h + 32))),
                                builder.shuffle_vector(b, b, _mask(range(h, h + 32))), is_signed) for h in (0, 32)]
            return builder.shuffle_vector(halves[0], halves[1], _mask(range(16)))

        return i32x16(w, x), codegen

    return dot


#: :func:`_dot_intrinsic` for unsigned weight quants (Q4_1, Q5_1).
b32_dot = _dot_intrinsic(False)
#: :func:`_dot_intrinsic` for int8 weight quants (Q8_0, and Q4_0, Q5_0 with their offsets).
b32_dot_signed = _dot_intrinsic(True)
#: :func:`_dot64_intrinsic` for unsigned weight quants.
b64_dot = _dot64_intrinsic(False)
#: :func:`_dot64_intrinsic` for int8 weight quants.
b64_dot_signed = _dot64_intrinsic(True)


@intrinsic
def i8_to_f8(typingctx, v):
    """Eight int32 lanes -> float32 (exact below 2**24; a lane of a block's dot is at most 4 * 128 * 127)."""
    if v != i32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _F8)

    return f32x8(v), codegen


# ---------------------------------------------------------------------------------------
# The activations: ggml's Q8_0 blocks.


@njit(inline="always")
def f16_round(v):  # pragma: no cover - compiled
    """The float32 ``v >= 0`` rounded to the nearest float16 value (ties to even; at or above
    65520, infinity), returned as float32: the value NumPy's ``astype(float16)`` stores
    (:func:`refengine.quant.numba_gguf.f32_to_f16`, read back exactly)."""
    return f16_to_f32(f32_to_f16(v))


def _block_f8(context, builder, sig, args):
    """The four :data:`f32x8` of the 32 float32 at flat element ``args[1]`` of the array ``args[0]``."""
    ptr = _vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _F8)
    return [builder.load(builder.gep(ptr, [_I32(i)]), align=4) for i in range(4)]


@intrinsic
def _block_amax(typingctx, x, xo):
    """``max |x[xo : xo + 32]|`` (flat float32 array; finite values), in vector registers."""
    if not (_is_c_array(x, types.float32) and isinstance(xo, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = [_call(builder, "llvm.fabs.v8f32", _F8, a) for a in _block_f8(context, builder, sig, args)]
        m = _call(builder, "llvm.maxnum.v8f32", _F8, _call(builder, "llvm.maxnum.v8f32", _F8, v[0], v[1]),
                  _call(builder, "llvm.maxnum.v8f32", _F8, v[2], v[3]))
        for half in (4, 2, 1):  # max is exact: any order gives the same value
            top = builder.shuffle_vector(m, m, _mask([i + half if i < half else i for i in range(8)]))
            m = _call(builder, "llvm.maxnum.v8f32", _F8, m, top)
        return builder.extract_element(m, _I32(0))

    return types.float32(x, xo), codegen


@intrinsic
def _block_round(typingctx, x, xo, inv, q, qo):
    """``q[qo + i] = roundf(x[xo + i] * inv)`` for ``i < 32`` (flat float32 ``x``, int8 ``q``;
    ``roundf`` as gguf-py's ``np_roundf``: ``floor(a) + floor(2 * (a - floor(a)))`` of
    ``a = |v|``, with ``v``'s sign, exactly); returns the sum of the 32 quants (int32)."""
    if not (_is_c_array(x, types.float32) and _is_c_array(q, types.int8) and isinstance(inv, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        scale = _splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), _F8)
        two = ir.Constant(_F8, [2.0] * 8)
        total, parts = None, []
        for v in _block_f8(context, builder, sig, args[:2]):
            v = builder.fmul(v, scale)
            a = _call(builder, "llvm.fabs.v8f32", _F8, v)
            fl = _call(builder, "llvm.floor.v8f32", _F8, a)
            r = builder.fadd(fl, _call(builder, "llvm.floor.v8f32", _F8, builder.fmul(two, builder.fsub(a, fl))))
            qi = builder.fptosi(_call(builder, "llvm.copysign.v8f32", _F8, r, v), _I8)
            total = qi if total is None else builder.add(total, qi)
            parts.append(builder.trunc(qi, ir.VectorType(ir.IntType(8), 8)))
        lo = builder.shuffle_vector(parts[0], parts[1], _mask(range(16)))
        hi = builder.shuffle_vector(parts[2], parts[3], _mask(range(16)))
        out = builder.shuffle_vector(lo, hi, _mask(range(32)))
        builder.store(out, _vector_ptr(context, builder, sig.args[3], args[3], sig.args[4], args[4], _B32), align=1)
        for half in (4, 2, 1):
            total = builder.add(total, builder.shuffle_vector(total, total, _mask([(i + half) % 8 for i in range(8)])))
        return builder.extract_element(total, _I32(0))

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
# The products.


@njit(inline="always")
def _decode_bytes(kind, qs, qh, j, b):  # pragma: no cover - compiled
    """Block ``b`` of row ``j``: its 32 quants as :data:`i8x32`, signed for Q8_0 (``q``),
    Q4_0 (``q - 8``) and Q5_0 (``q - 16``), unsigned for Q4_1 and Q5_1 (``q``): the values
    :func:`refengine.quant.numba_gguf._decode32` gives as float32."""
    if kind == Q8_0:
        return b32_load(qs, (_U(j) * _U(qs.shape[1] // 32) + _U(b)) * _U(32))
    q = b32_nibbles(qs, (_U(j) * _U(qs.shape[1] // 16) + _U(b)) * _U(16))
    if kind == Q5_0 or kind == Q5_1:
        q = b32_high_bits(q, qh[j, b])
    if kind == Q4_0:
        q = b32_add(q, -8)
    elif kind == Q5_0:
        q = b32_add(q, -16)
    return q


@njit(inline="always")
def _block_idot(kind, w, xq, xo, scale, acc):  # pragma: no cover - compiled
    """One block: the integer dot of its quants ``w`` (:func:`_decode_bytes`) with
    ``xq[xo : xo + 32]`` (flat int8), exact, converted once and added as
    ``acc + scale * sum`` (eight float32 lanes)."""
    x = b32_load(xq, xo)
    p = b32_dot(w, x) if kind == Q4_1 or kind == Q5_1 else b32_dot_signed(w, x)
    return f8_fma(f8_splat(scale), i8_to_f8(p), acc)


@njit(inline="always")
def _decode_pair(kind, qs, qh, j, b):  # pragma: no cover - compiled
    """Blocks ``b`` and ``b + 1`` of row ``j`` as :data:`i8x64`: each block's quants as
    :func:`_decode_bytes` gives them, the first in lanes 0-31."""
    if kind == Q8_0:
        return b64_load(qs, (_U(j) * _U(qs.shape[1] // 32) + _U(b)) * _U(32))
    q = b64_nibbles(qs, (_U(j) * _U(qs.shape[1] // 16) + _U(b)) * _U(16))
    if kind == Q5_0 or kind == Q5_1:
        q = b64_high_bits(q, qh[j, b], qh[j, b + 1])
    if kind == Q4_0:
        q = b64_add(q, -8)
    elif kind == Q5_0:
        q = b64_add(q, -16)
    return q


@njit(inline="always")
def _pair_idot(kind, w, xq, xo, scale, acc):  # pragma: no cover - compiled
    """Two blocks: the integer dots of their quants ``w`` (:func:`_decode_pair`) with
    ``xq[xo : xo + 64]`` (flat int8), exact, converted once and added as ``acc + scale * sum``
    (sixteen float32 lanes: 0-7 the first block's, with ``scale``'s lanes 0-7, 8-15 the second's)."""
    x = b64_load(xq, xo)
    p = b64_dot(w, x) if kind == Q4_1 or kind == Q5_1 else b64_dot_signed(w, x)
    return v16_fma(scale, q16_to_f(p), acc)


@njit(inline="always")
def _last_block(kind, h, qs, qh, j, xq, xo, scale):  # pragma: no cover - compiled
    """``h`` (eight lanes: a row's block pairs folded, :func:`v16_halves`) plus the odd last
    block of row ``j`` with ``xq[xo : xo + 32]`` and ``scale`` (:func:`_block_idot`). Called
    inside the callers' ``if odd`` itself: arrays passed into an inlined function that
    branches at run time keep numba's reference counting (atomic ``NRT_incref``/``NRT_decref``
    calls, measured at half the kernel's time) in the loop."""
    nb = _U(qs.shape[1]) // _U(32) if kind == Q8_0 else _U(qs.shape[1]) // _U(16)
    return _block_idot(kind, _decode_bytes(kind, qs, qh, j, nb - _U(1)), xq, xo, scale, h)


@njit(inline="always")
def _q8_rows(kind, xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """``out[:, j] = x̂ @ w[j]`` for ``j0 <= j < j1`` (the task of ``_q4_1_q8_linear`` ...;
    ``kind`` a constant): ``xq``, ``dx``, ``xsq`` from :func:`quantize_q8_0`, ``dxe`` the
    scales ``dx`` with each repeated eight times (``[T, K/4]``; more than one row only);
    ``d``, ``m``, ``qh``, ``qs`` the weight planes as in
    :func:`refengine.quant.numba_gguf._blocks32_rows`; ``out`` float32 ``[T, N]``;
    ``scratch`` float32 ``[>= 2 * (CHUNK_ROWS * K/32 + 8)]``: the f16 scales (and minimums)
    of :data:`CHUNK_ROWS` weight rows at a time (several activation rows), or that row's
    ``dx`` with each repeated eight times (one row: the weight scales are converted in the
    loop, :func:`v16_f16_pair`, and multiplied by it, the same products ``d_w * d_x`` the
    multi-row path forms with ``dxe``).

    Blocks go in pairs (:func:`_pair_idot`: one 64-byte integer dot, one conversion, one FMA
    for both), a last odd block alone (:func:`_last_block`). One row (decode at batch 1): two
    weight rows at a time (two FMA chains; one load of each activation pair for both), their
    quants prefetched. More rows: blocks of input rows that stay in cache while the task's
    weight rows pass, two weight rows at a time, in groups of four input rows (a 4 x 2 tile
    of sixteen-lane accumulators: each activation pair read once for both weight rows,
    each decoded weight pair used four times; a last group of 2-3 repeats its last row),
    then one by one. Every output's sums are the same whichever
    way it ran."""
    rows, k = xq.shape
    nb = _U(d.shape[1])
    pairs = nb // _U(2) * _U(2)
    odd = pairs < nb
    last = (nb - _U(1)) * _U(32)  # the odd last block's first quant in a row
    kk = _U(k)
    xqf, dxf, dxef, xsf = xq.reshape(-1), dx.reshape(-1), dxe.reshape(-1), xsq.reshape(-1)
    half = _U(CHUNK_ROWS) * nb + _U(8)
    sd, sm = scratch[:half], scratch[half:]
    with_min = kind == Q4_1 or kind == Q5_1
    if _U(rows) == _U(1):
        # No scale pass: each pair's two f16 scales converted in the loop and multiplied by
        # the activation scales, expanded to eight lanes each in the scratch once per task
        # (the products d_w * d_x the chunk pass forms, so the same bits).
        dxl = scratch[:nb * _U(8)]
        for b in range(nb):
            for i in range(_U(8)):
                dxl[b * _U(8) + i] = dxf[b]
        df, mf = d.reshape(-1), m.reshape(-1)
        for j in range(_U(j0), _U(j1), _U(2)):
            _prefetch_pair(kind, qs, qh, d, m, j)
            so = _U(j) * nb
            if j + _U(1) < _U(j1):
                so1 = so + nb
                a0 = a1 = v16_zero()
                for b in range(_U(0), pairs, _U(2)):
                    c = b * _U(32)
                    dxp = v16_load(dxl, b * _U(8))
                    a0 = _pair_idot(kind, _decode_pair(kind, qs, qh, j, b), xqf, c,
                                    v16_mul(v16_f16_pair(df, so + b), dxp), a0)
                    a1 = _pair_idot(kind, _decode_pair(kind, qs, qh, j + _U(1), b), xqf, c,
                                    v16_mul(v16_f16_pair(df, so1 + b), dxp), a1)
                h0, h1 = v16_halves(a0), v16_halves(a1)
                if odd:
                    lb = nb - _U(1)
                    h1 = _last_block(kind, h1, qs, qh, j + _U(1), xqf, last, f16_to_f32(df[so1 + lb]) * dxf[lb])
                    h0 = _last_block(kind, h0, qs, qh, j, xqf, last, f16_to_f32(df[so + lb]) * dxf[lb])
                s1, s0 = f8_sum(h1), f8_sum(h0)
                if with_min:
                    s1 += _weighted_sum_f16(mf, so1, xsf, nb)
                    s0 += _weighted_sum_f16(mf, so, xsf, nb)
                out[0, j + _U(1)] = s1
                out[0, j] = s0
            else:
                a0 = v16_zero()
                for b in range(_U(0), pairs, _U(2)):
                    a0 = _pair_idot(kind, _decode_pair(kind, qs, qh, j, b), xqf, b * _U(32),
                                    v16_mul(v16_f16_pair(df, so + b), v16_load(dxl, b * _U(8))), a0)
                h0 = v16_halves(a0)
                if odd:
                    lb = nb - _U(1)
                    h0 = _last_block(kind, h0, qs, qh, j, xqf, last, f16_to_f32(df[so + lb]) * dxf[lb])
                s0 = f8_sum(h0)
                if with_min:
                    s0 += _weighted_sum_f16(mf, so, xsf, nb)
                out[0, j] = s0
        return
    x_block = x_block_rows(k // 2, 4)  # an int8 row and its repeated scales: half a float32 row
    ke = kk // _U(4)  # dxe's row length
    for r0 in range(_U(0), _U(rows), x_block):
        r1 = min(r0 + x_block, _U(rows))
        fours, last_row = _fours_end(r0, r1)
        for j in range(_U(j0), _U(j1), _U(2)):  # weight rows in pairs (same chunk: j - j0 is even)
            so = _chunk_scales(d, m, j, j0, j1, sd, sm, with_min, nb)
            two = j + _U(1) < _U(j1)
            jb = j + _U(1) if two else j  # a last odd weight row is computed twice, stored once
            sob = so + nb if two else so
            for t0 in range(r0, fours, _U(4)):
                t1, t2, t3 = min(t0 + _U(1), last_row), min(t0 + _U(2), last_row), min(t0 + _U(3), last_row)
                x0, x1, x2, x3 = t0 * kk, t1 * kk, t2 * kk, t3 * kk
                e0, e1, e2, e3 = t0 * ke, t1 * ke, t2 * ke, t3 * ke
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = v16_zero()
                for b in range(_U(0), pairs, _U(2)):
                    wa, wb = _decode_pair(kind, qs, qh, j, b), _decode_pair(kind, qs, qh, jb, b)
                    sa, sb = v16_pair(sd[so + b], sd[so + b + _U(1)]), v16_pair(sd[sob + b], sd[sob + b + _U(1)])
                    c, e = b * _U(32), b * _U(8)
                    # each activation pair and its scales loaded once for both weight rows (LLVM merges the loads)
                    d0, d1, d2, d3 = (v16_load(dxef, e0 + e), v16_load(dxef, e1 + e), v16_load(dxef, e2 + e),
                                      v16_load(dxef, e3 + e))
                    a0 = _pair_idot(kind, wa, xqf, x0 + c, v16_mul(sa, d0), a0)
                    b0 = _pair_idot(kind, wb, xqf, x0 + c, v16_mul(sb, d0), b0)
                    a1 = _pair_idot(kind, wa, xqf, x1 + c, v16_mul(sa, d1), a1)
                    b1 = _pair_idot(kind, wb, xqf, x1 + c, v16_mul(sb, d1), b1)
                    a2 = _pair_idot(kind, wa, xqf, x2 + c, v16_mul(sa, d2), a2)
                    b2 = _pair_idot(kind, wb, xqf, x2 + c, v16_mul(sb, d2), b2)
                    a3 = _pair_idot(kind, wa, xqf, x3 + c, v16_mul(sa, d3), a3)
                    b3 = _pair_idot(kind, wb, xqf, x3 + c, v16_mul(sb, d3), b3)
                ha0, ha1, ha2, ha3 = v16_halves(a0), v16_halves(a1), v16_halves(a2), v16_halves(a3)
                hb0, hb1, hb2, hb3 = v16_halves(b0), v16_halves(b1), v16_halves(b2), v16_halves(b3)
                if odd:
                    lb = nb - _U(1)
                    da, db = sd[so + lb], sd[sob + lb]
                    ha0 = _last_block(kind, ha0, qs, qh, j, xqf, x0 + last, da * dxf[t0 * nb + lb])
                    ha1 = _last_block(kind, ha1, qs, qh, j, xqf, x1 + last, da * dxf[t1 * nb + lb])
                    ha2 = _last_block(kind, ha2, qs, qh, j, xqf, x2 + last, da * dxf[t2 * nb + lb])
                    ha3 = _last_block(kind, ha3, qs, qh, j, xqf, x3 + last, da * dxf[t3 * nb + lb])
                    hb0 = _last_block(kind, hb0, qs, qh, jb, xqf, x0 + last, db * dxf[t0 * nb + lb])
                    hb1 = _last_block(kind, hb1, qs, qh, jb, xqf, x1 + last, db * dxf[t1 * nb + lb])
                    hb2 = _last_block(kind, hb2, qs, qh, jb, xqf, x2 + last, db * dxf[t2 * nb + lb])
                    hb3 = _last_block(kind, hb3, qs, qh, jb, xqf, x3 + last, db * dxf[t3 * nb + lb])
                if two:
                    _store_row(out, t3, jb, f8_sum(hb3), with_min, sm, sob, xsf, nb)
                    _store_row(out, t2, jb, f8_sum(hb2), with_min, sm, sob, xsf, nb)
                    _store_row(out, t1, jb, f8_sum(hb1), with_min, sm, sob, xsf, nb)
                    _store_row(out, t0, jb, f8_sum(hb0), with_min, sm, sob, xsf, nb)
                _store_row(out, t3, j, f8_sum(ha3), with_min, sm, so, xsf, nb)
                _store_row(out, t2, j, f8_sum(ha2), with_min, sm, so, xsf, nb)
                _store_row(out, t1, j, f8_sum(ha1), with_min, sm, so, xsf, nb)
                _store_row(out, t0, j, f8_sum(ha0), with_min, sm, so, xsf, nb)
            for t in range(fours, r1):
                for jj in range(j, jb + _U(1)):
                    sj = so + (jj - j) * nb
                    a0 = v16_zero()
                    for b in range(_U(0), pairs, _U(2)):
                        ws = v16_pair(sd[sj + b], sd[sj + b + _U(1)])
                        a0 = _pair_idot(kind, _decode_pair(kind, qs, qh, jj, b), xqf, t * kk + b * _U(32),
                                        v16_mul(ws, v16_load(dxef, t * ke + b * _U(8))), a0)
                    h0 = v16_halves(a0)
                    if odd:
                        h0 = _last_block(kind, h0, qs, qh, jj, xqf, t * kk + last,
                                         sd[sj + nb - _U(1)] * dxf[t * nb + nb - _U(1)])
                    _store_row(out, t, jj, f8_sum(h0), with_min, sm, sj, xsf, nb)


# One compiled version per type (the type a constant, so its branches fold away): task, parallel loop.


@njit(cache=True)
def _q8_0_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_q8_rows` for Q8_0 weights."""
    _q8_rows(Q8_0, xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q8_0_q8_linear(xq, dx, dxe, xsq, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q8_0 weights: ``out [T, N]`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q8_0_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True)
def _q4_0_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_q8_rows` for Q4_0 weights."""
    _q8_rows(Q4_0, xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q4_0_q8_linear(xq, dx, dxe, xsq, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q4_0 weights: ``out [T, N]`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q4_0_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True)
def _q4_1_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_q8_rows` for Q4_1 weights."""
    _q8_rows(Q4_1, xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q4_1_q8_linear(xq, dx, dxe, xsq, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q4_1 weights: ``out [T, N]`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q4_1_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True)
def _q5_0_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_q8_rows` for Q5_0 weights."""
    _q8_rows(Q5_0, xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q5_0_q8_linear(xq, dx, dxe, xsq, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q5_0 weights: ``out [T, N]`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q5_0_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


@njit(cache=True)
def _q5_1_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch):  # pragma: no cover - compiled
    """:func:`_q8_rows` for Q5_1 weights."""
    _q8_rows(Q5_1, xq, dx, dxe, xsq, d, m, qh, qs, out, j0, j1, scratch)


@parallel_kernel()
def _q5_1_q8_linear(xq, dx, dxe, xsq, d, m, qh, qs, out, block, scratch):  # pragma: no cover - compiled
    """Q5_1 weights: ``out [T, N]`` in tasks of ``block`` output rows (task ``i`` uses ``scratch[i]``)."""
    n = out.shape[1]
    for blk in prange((n + block - 1) // block):
        _q5_1_q8_rows(xq, dx, dxe, xsq, d, m, qh, qs, out, blk * block, min(blk * block + block, n), scratch[blk])


_KERNELS = {"Q8_0": _q8_0_q8_linear, "Q4_0": _q4_0_q8_linear, "Q4_1": _q4_1_q8_linear,
            "Q5_0": _q5_0_q8_linear, "Q5_1": _q5_1_q8_linear}


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
    kernel, planes, block, scratch, xq, dx, xsq = numba_gguf.product_plan(w, "q8", _q8_plan)
    if rows == 1:  # into the plan's buffers; the one-row kernel spreads the scales to lanes itself
        _quantize_task(x, xq, dx, xsq, 0, 1)
        dxe = dx
    else:
        xq, dx, xsq = quantize_q8_0(x)
        dxe = np.repeat(dx, 8, axis=1)  # a block's scale in each of its eight lanes
    kernel(xq, dx, dxe, xsq, *planes, out, block, scratch)
    return out


def _q8_plan(w, threads: int) -> tuple:
    """:func:`refengine.quant.numba_gguf.product_plan` builder of :func:`q8_linear`:
    :func:`refengine.quant.numba_gguf.plan_arguments` and ``xq`` int8 ``[1, in]``, ``dx`` and
    ``xsq`` float32 ``[1, in/32]``, a one-row input's :func:`quantize_q8_0` buffers."""
    k = w.shape[1]
    return (*numba_gguf.plan_arguments(w, _KERNELS[w.format], threads), np.empty((1, k), dtype=np.int8),
            np.empty((1, k // 32), dtype=np.float32), np.empty((1, k // 32), dtype=np.float32))


def linear(x: np.ndarray, w, *, batch_invariant: bool = False) -> np.ndarray:
    """``x [T, in] @ w.T`` -> float32 ``[T, out]`` with Q8_0 activations where ``w``'s type has
    a kernel here (:func:`q8_linear`, every row count), else the float32 products
    (:func:`refengine.quant.numba_gguf.linear`, with ``batch_invariant``).

    Raises:
        ValueError: ``x`` not 2-D with ``in_features`` columns.
    """
    if w.format in _KERNELS:
        return q8_linear(x, w)
    return numba_gguf.linear(x, w, batch_invariant=batch_invariant)


register_kernels(sys.modules[__name__])
