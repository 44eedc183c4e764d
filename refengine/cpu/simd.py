"""Eight- and sixteen-lane float32/int32 vectors for numba kernels: the LLVM vector types, the
intrinsics on them (loads, stores, fused multiply-adds, lane sums, integer decoding) and exact
f16 <-> f32 conversions. The GGUF, Q8 and int products and the CPU attention kernels use them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


# ---------------------------------------------------------------------------------------
# Eight-lane vectors: the types and the intrinsics on them.

F8 = ir.VectorType(ir.FloatType(), 8)
I8 = ir.VectorType(ir.IntType(32), 8)
I32 = ir.IntType(32)


def vector_type(name: str, ir_type) -> types.Type:
    """A numba type ``name`` held in registers as the LLVM vector type ``ir_type``."""
    def __init__(self):
        types.Type.__init__(self, name=name)

    cls = type("_" + name.capitalize(), (types.Type,), {"__init__": __init__, "__module__": __name__})
    globals()[cls.__name__] = cls  # importable by name, as pickling (numba's cache) needs

    @register_model(cls)
    class _Model(models.PrimitiveModel):
        def __init__(self, dmm, fe_type):
            super().__init__(dmm, fe_type, ir_type)

    return cls()


#: Eight float32 lanes (LLVM ``<8 x float>``, one AVX2 ``ymm`` register).
f32x8 = vector_type("f32x8", F8)


def is_c_array(a, *dtypes) -> bool:
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype in dtypes


def vector_ptr(context, builder, arrty, arr, idxty, idx, vecty):
    """A pointer to ``vecty`` at flat element ``idx`` of the C-contiguous array ``arr``."""
    ary = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.bitcast(builder.gep(ary.data, [i]), vecty.as_pointer())


def ir_splat(builder, scalar, vecty):
    """``scalar`` (already of the lane type) in every lane of ``vecty``."""
    undef = ir.Constant(vecty, ir.Undefined)
    one = builder.insert_element(undef, scalar, I32(0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, vecty.count), None))


@intrinsic
def f8_sum(typingctx, v):
    """The eight lanes' sum in a fixed tree: ``(l, l + 4)`` pairs, then ``(l, l + 2)``, then the last two."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]

        def half(vec, lanes):
            mask = ir.Constant(ir.VectorType(I32, len(lanes)), [I32(i) for i in lanes])
            return builder.shuffle_vector(vec, vec, mask)

        s4 = builder.fadd(half(x, (0, 1, 2, 3)), half(x, (4, 5, 6, 7)))
        s2 = builder.fadd(half(s4, (0, 1)), half(s4, (2, 3)))
        return builder.fadd(builder.extract_element(s2, I32(0)), builder.extract_element(s2, I32(1)))

    return types.float32(v), codegen


@intrinsic
def f8_transpose8(typingctx, r0, r1, r2, r3, r4, r5, r6, r7):
    """The 8 x 8 transpose of eight vectors (row ``i`` = ``ri``): a tuple of eight ``f32x8``
    whose vector ``d`` is lane ``d`` of ``r0 .. r7``. Three rounds of two-input shuffles
    (pairs of lanes, pairs of pairs, halves: ``vunpcklps``/``vshufps``/``vperm2f128`` or
    their AVX-512 forms); values are moved, never rounded."""
    rows = (r0, r1, r2, r3, r4, r5, r6, r7)
    if any(r != f32x8 for r in rows):
        return None

    def codegen(context, builder, sig, args):
        def shuffle(a, b, lanes):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 8), [I32(i) for i in lanes]))

        lo, hi = (0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15)
        t = []
        for i in range(0, 8, 2):  # interleave rows pairwise
            t += [shuffle(args[i], args[i + 1], lo), shuffle(args[i], args[i + 1], hi)]
        lo2, hi2 = (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)
        u = [shuffle(t[0], t[2], lo2), shuffle(t[0], t[2], hi2), shuffle(t[1], t[3], lo2), shuffle(t[1], t[3], hi2),
             shuffle(t[4], t[6], lo2), shuffle(t[4], t[6], hi2), shuffle(t[5], t[7], lo2), shuffle(t[5], t[7], hi2)]
        first, second = (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)
        out = [shuffle(u[i], u[i + 4], first) for i in range(4)] + [shuffle(u[i], u[i + 4], second) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(f32x8, 8)(*rows), codegen


# ---------------------------------------------------------------------------------------
# Sixteen-lane vectors (one AVX-512 ``zmm`` register; two ``ymm`` where LLVM splits them):
# the block kernels hold a block of 32 weights as two of them, weights 0-15 and 16-31. Lane
# ``l`` of a sixteen-lane sum is lane ``l % 8`` of the eight-lane pair it replaces (weights
# 0-7 with 16-23, 8-15 with 24-31), so the sums are the same bits (:func:`v16_halves`).

F16L = ir.VectorType(ir.FloatType(), 16)
I16L = ir.VectorType(ir.IntType(32), 16)


#: Sixteen float32 lanes (LLVM ``<16 x float>``).
f32x16 = vector_type("f32x16", F16L)
#: Sixteen int32 lanes (LLVM ``<16 x i32>``).
i32x16 = vector_type("i32x16", I16L)


@intrinsic
def v16_halves(typingctx, v):
    """Lanes 0-7 plus lanes 8-15: an :data:`f32x8` (then :func:`f8_sum` gives the sum)."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        def lanes(first):
            mask = ir.Constant(ir.VectorType(I32, 8), [I32(first + i) for i in range(8)])
            return builder.shuffle_vector(args[0], args[0], mask)

        return builder.fadd(lanes(0), lanes(8))

    return f32x8(v), codegen


@intrinsic
def v16_sums16(typingctx, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15):
    """The sixteen vectors' lane sums as one vector: lane ``i`` is the sum of ``ti``'s
    lanes, in :func:`v16_halves` then :func:`f8_sum`'s tree (the same bits as
    ``f8_sum(v16_halves(ti))``), for about three operations a vector instead of seven.

    Four rounds halve the lanes each vector still has to add: a round pairs two vectors
    and adds, in one shuffle of each, the first half of every group of lanes to its
    second half, so the number of vectors halves and the groups per vector double; a last
    shuffle puts the sums, then in bit-reversed order, in order."""
    vs = (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
    if any(v != f32x16 for v in vs):
        return None

    def codegen(context, builder, sig, args):
        def shuffle(a, b, lanes):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(lanes)), [I32(i) for i in lanes]))

        vecs, size = list(args), 16  # size: lanes per group (one vector's partial sums)
        while size > 1:
            half = size // 2
            lo = [g + i for g in range(0, 16, size) for i in (*range(half), *range(16, 16 + half))]
            hi = [i + half for i in lo]
            vecs = [builder.fadd(shuffle(a, b, lo), shuffle(a, b, hi)) for a, b in zip(vecs[::2], vecs[1::2])]
            size = half
        order = [int(f"{i:04b}"[::-1], 2) for i in range(16)]  # lane i holds the sum of vector order[i]
        out = vecs[0]
        return shuffle(out, out, [order.index(i) for i in range(16)])

    return f32x16(*vs), codegen


@intrinsic
def q16_bits(typingctx, word, first):
    """Lane ``l``: bit ``first + l`` of the 32-bit ``word`` (0 or 1)."""
    if not (isinstance(word, types.Integer) and isinstance(first, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        w = ir_splat(builder, context.cast(builder, args[0], sig.args[0], types.uint32), I16L)
        f = ir_splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), I16L)
        lanes = ir.Constant(I16L, [I32(i) for i in range(16)])
        return builder.and_(builder.lshr(w, builder.add(f, lanes)), ir_splat(builder, I32(1), I16L))

    return i32x16(word, first), codegen


# ---------------------------------------------------------------------------------------
# The intrinsics of both widths, written once: loads, stores, arithmetic, integer decoding.


def _lane_intrinsics(fvec, f_ir, ivec=None, i_ir=None) -> SimpleNamespace:
    """The intrinsics on ``fvec`` (float32 lanes, LLVM ``f_ir``): ``zero``, ``splat``,
    ``load``, ``store``, ``mul``, ``add``, ``fma``; with ``ivec`` (int32 lanes, ``i_ir``) also
    ``load_bytes``, ``and_``, ``add_int``, ``mul_int``, ``imul``, ``shr``, ``shl``, ``or_``,
    ``to_float`` on them.
    Loads and stores are not bounds-checked; ``fma`` is ``llvm.fma`` (one rounding), ``mul``
    is never fused with a later add."""
    lanes = f_ir.count

    @intrinsic
    def zero(typingctx):
        def codegen(context, builder, sig, args):
            return ir.Constant(f_ir, None)

        return fvec(), codegen

    @intrinsic
    def splat(typingctx, value):
        if not isinstance(value, types.Float):
            return None

        def codegen(context, builder, sig, args):
            return ir_splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), f_ir)

        return fvec(value), codegen

    @intrinsic
    def load(typingctx, arr, idx):
        if not (is_c_array(arr, types.float32) and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], f_ir), align=4)

        return fvec(arr, idx), codegen

    @intrinsic
    def store(typingctx, arr, idx, v):
        if not (is_c_array(arr, types.float32) and isinstance(idx, types.Integer) and v == fvec):
            return None

        def codegen(context, builder, sig, args):
            builder.store(args[2], vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], f_ir),
                          align=4)
            return context.get_dummy_value()

        return types.void(arr, idx, v), codegen

    def binop(op, vec, scalar_arg):
        """``op`` lane-wise on ``vec`` and a second ``vec`` (or an integer in every lane)."""
        @intrinsic
        def apply(typingctx, a, b):
            if not (a == vec and (isinstance(b, types.Integer) if scalar_arg else b == vec)):
                return None

            def codegen(context, builder, sig, args):
                other = args[1]
                if scalar_arg:
                    other = ir_splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), i_ir)
                return getattr(builder, op)(args[0], other)

            return vec(a, b), codegen

        return apply

    @intrinsic
    def fma(typingctx, a, b, c):
        if not (a == fvec and b == fvec and c == fvec):
            return None

        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f_ir, [f_ir] * 3), f"llvm.fma.v{lanes}f32")
            return builder.call(fn, args)

        return fvec(a, b, c), codegen

    @intrinsic
    def load_bytes(typingctx, arr, idx):
        if not (is_c_array(arr, types.uint8, types.int8) and isinstance(idx, types.Integer)):
            return None
        signed = arr.dtype == types.int8

        def codegen(context, builder, sig, args):
            raw_ty = ir.VectorType(ir.IntType(8), lanes)
            raw = builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], raw_ty), align=1)
            return builder.sext(raw, i_ir) if signed else builder.zext(raw, i_ir)

        return ivec(arr, idx), codegen

    @intrinsic
    def to_float(typingctx, v):
        if v != ivec:
            return None

        def codegen(context, builder, sig, args):
            return builder.sitofp(args[0], f_ir)

        return fvec(v), codegen

    ops = SimpleNamespace(zero=zero, splat=splat, load=load, store=store, mul=binop("fmul", fvec, False),
                          add=binop("fadd", fvec, False), fma=fma)
    if ivec is not None:
        ops.__dict__.update(load_bytes=load_bytes, and_=binop("and_", ivec, True), add_int=binop("add", ivec, True),
                            mul_int=binop("mul", ivec, True), imul=binop("mul", ivec, False),
                            shr=binop("lshr", ivec, True), shl=binop("shl", ivec, True),
                            or_=binop("or_", ivec, False), to_float=to_float)
    docs = {"zero": f"{lanes} float32 zeros.", "splat": f"``value`` (a float) in all {lanes} lanes.",
            "load": f"Elements ``idx .. idx + {lanes - 1}`` (flat) of a C-contiguous float32 array.",
            "store": f"Write ``v`` to elements ``idx .. idx + {lanes - 1}`` (flat) of a C-contiguous float32 array.",
            "mul": "``a * b`` lane-wise (rounded, never fused with a later add).", "add": "``a + b`` lane-wise.",
            "fma": "``a * b + c`` lane-wise, one rounding (``llvm.fma``: ``vfmadd`` on a CPU with FMA).",
            "load_bytes": f"Bytes ``idx .. idx + {lanes - 1}`` (flat) of a C-contiguous uint8 (zero-extended) "
                          f"or int8 (sign-extended) array, as {lanes} int32.",
            "and_": "``v & n`` lane-wise.", "add_int": "``v + n`` lane-wise.",
            "mul_int": "``v * n`` lane-wise (int32, wrapping).", "imul": "``a * b`` lane-wise (int32, wrapping).",
            "shr": "``v >> n`` lane-wise (logical).", "shl": "``v << n`` lane-wise.", "or_": "``a | b`` lane-wise.",
            "to_float": "int32 lanes -> float32 (exact below 2**24)."}
    for name, doc in docs.items():
        if hasattr(ops, name):
            getattr(ops, name).__doc__ = doc
    return ops


_L8 = _lane_intrinsics(f32x8, F8)
f8_zero, f8_splat, f8_load, f8_store = _L8.zero, _L8.splat, _L8.load, _L8.store
f8_mul, f8_add, f8_fma = _L8.mul, _L8.add, _L8.fma
_L16 = _lane_intrinsics(f32x16, F16L, i32x16, I16L)
v16_zero, v16_splat, v16_load, v16_store = _L16.zero, _L16.splat, _L16.load, _L16.store
v16_mul, v16_add, v16_fma = _L16.mul, _L16.add, _L16.fma
q16_load_bytes, q16_and, q16_add, q16_shr, q16_shl = (_L16.load_bytes, _L16.and_, _L16.add_int, _L16.shr,
                                                       _L16.shl)
q16_or, q16_to_f, q16_mul, q16_mul_int = _L16.or_, _L16.to_float, _L16.imul, _L16.mul_int


def _halves_to_float(builder, h, ivec, fvec):
    """f16 bit patterns (zero-extended to the i32 lanes ``ivec``) -> float32 lanes ``fvec``,
    exactly (module docstring)."""
    const = lambda c: ir_splat(builder, I32(c), ivec)  # noqa: E731
    em = builder.shl(builder.and_(h, const(0x7FFF)), const(13))
    finite = builder.fmul(builder.bitcast(em, fvec), ir_splat(builder, ir.Constant(ir.FloatType(), 2.0 ** 112), fvec))
    special = builder.bitcast(builder.or_(em, const(0x7F800000)), fvec)  # inf, NaN: the all-ones exponent
    value = builder.select(builder.icmp_unsigned(">=", em, const(0x7C00 << 13)), special, finite)
    sign = builder.shl(builder.and_(h, const(0x8000)), const(16))
    return builder.bitcast(builder.or_(builder.bitcast(value, ivec), sign), fvec)


def _has_f16c(context) -> bool:
    """Whether the code is compiled for a CPU with F16C (numba targets the host CPU, and its
    cache is keyed by the CPU's features). Without it LLVM would lower a half-to-float
    conversion to a library call that numba's JIT may not resolve, hence the bit arithmetic."""
    return "+f16c" in str(getattr(context.codegen(), "_tm_features", "")).split(",")


def _f16_intrinsic(use_f16c: bool, lanes: int = 8):
    """An intrinsic ``(uint16 array, flat index) -> f32x8`` (``lanes`` 8) or ``f32x16`` (16)
    converting that many f16 bit patterns, by the CPU's ``vcvtph2ps`` when ``use_f16c`` and
    the CPU has F16C, else by bit arithmetic."""
    fvec, f_ir, i_ir = {8: (f32x8, F8, I8), 16: (f32x16, F16L, I16L)}[lanes]

    @intrinsic
    def load(typingctx, arr, idx):
        if not (is_c_array(arr, types.uint16) and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            v16 = ir.VectorType(ir.IntType(16), lanes)
            raw = builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], v16), align=2)
            if use_f16c and _has_f16c(context):
                return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), lanes)), f_ir)
            return _halves_to_float(builder, builder.zext(raw, i_ir), i_ir, f_ir)

        return fvec(arr, idx), codegen

    return load


#: Elements ``idx .. idx + 7`` (flat) of a C-contiguous uint16 array of f16 bit patterns, as
#: float32: ``vcvtph2ps`` on a CPU with F16C, else :data:`f8_load_f16_bits`; both exact.
f8_load_f16 = _f16_intrinsic(True)
#: :data:`f8_load_f16` by bit arithmetic only (the fallback, tested on any CPU).
f8_load_f16_bits = _f16_intrinsic(False)
#: Sixteen lanes of :data:`f8_load_f16` (the float16 KV cache's reads).
v16_load_f16 = _f16_intrinsic(True, 16)


@intrinsic
def f16_load(typingctx, arr, idx):
    """Element ``idx`` (flat) of a C-contiguous uint16 array of f16 bit patterns as float32:
    ``vcvtph2ps`` on a CPU with F16C, else :func:`f16_to_f32`'s bit arithmetic; exact."""
    if not (is_c_array(arr, types.uint16) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        one = ir.VectorType(ir.IntType(16), 1)
        raw = builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], one), align=2)
        if _has_f16c(context):
            v = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 1)), ir.VectorType(ir.FloatType(), 1))
        else:
            i1, f1 = ir.VectorType(ir.IntType(32), 1), ir.VectorType(ir.FloatType(), 1)
            v = _halves_to_float(builder, builder.zext(raw, i1), i1, f1)
        return builder.extract_element(v, I32(0))

    return types.float32(arr, idx), codegen
#: :data:`v16_load_f16` by bit arithmetic only.
v16_load_f16_bits = _f16_intrinsic(False, 16)


@intrinsic
def f8_load_bf16(typingctx, arr, idx):
    """Elements ``idx .. idx + 7`` (flat) of a C-contiguous uint16 array of bfloat16 bit patterns, as float32."""
    if not (is_c_array(arr, types.uint16) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(ir.IntType(16), 8)
        raw = builder.load(vector_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], v16), align=2)
        return builder.bitcast(builder.shl(builder.zext(raw, I8), ir_splat(builder, I32(16), I8)), F8)

    return f32x8(arr, idx), codegen


@intrinsic
def bits_as_f32(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, I32)
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@njit(inline="always")
def f16_to_f32(h):  # pragma: no cover - compiled
    """One f16 bit pattern (an unsigned integer below 2**16) -> float32, exactly (module docstring)."""
    u = np.uint32(h)
    em = (u & np.uint32(0x7FFF)) << np.uint32(13)
    v = bits_as_f32(em) * np.float32(2.0 ** 112)
    if em >= np.uint32(0x7C00 << 13):
        v = bits_as_f32(em | np.uint32(0x7F800000))
    if u & np.uint32(0x8000):
        v = -v
    return v


@njit(inline="always")
def f32_to_f16(x):  # pragma: no cover - compiled
    """The float32 ``x`` rounded to float16 (to nearest, ties to even) as its bit pattern
    (uint16): NumPy's ``astype(np.float16)`` bit for bit for every non-NaN float32 (past
    65504 rounds to infinity; below ``2**-14`` to a subnormal); a NaN stays a quiet NaN.
    Normal halves round the mantissa to 10 bits (the carry may step the exponent), then
    the exponent is rebiased (127 -> 15); subnormals scale by ``2**24`` and round to an
    integer by adding and taking away ``2**23`` (the float32 adds round to even)."""
    u = np.uint32(_f32_bits(x))
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):  # NaN: quiet, the top of its payload kept
        return np.uint16(sign | np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF)))
    if a >= np.uint32(0x477FF000):  # 65520 and up (and infinity): infinity
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):  # below 2**-14: a multiple of 2**-24 (1024 of them is the least normal)
        big = np.float32(2.0 ** 23)
        m = (bits_as_f32(a) * np.float32(2.0 ** 24) + big) - big
        return np.uint16(sign | np.uint32(m))
    r = a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))
    return np.uint16(sign | ((r - np.uint32(0x38000000)) >> np.uint32(13)))


@intrinsic
def _f32_bits(typingctx, v):
    """The bit pattern of the float32 ``v``, as uint32."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], I32)

    return types.uint32(v), codegen
