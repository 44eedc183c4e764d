"""GGUF tensors kept as stored (:class:`GGUFWeight`), and their NumPy dequantization.

Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.

A GGUF tensor of a quantized type is a sequence of blocks, each ``block_size`` consecutive
weights of one row in ``type_size`` bytes (``gguf.GGML_QUANT_SIZES``): 32 weights for the
``Q*_0``/``Q*_1`` types, superblocks of 256 for the K-quants. :class:`GGUFWeight` keeps
those bytes, split by field into planes (:class:`GGUFWeight` documents the layout), and
:meth:`GGUFWeight.dequantize` decodes them in NumPy, one formula per type written from its
definition in ggml (``ggml/src/ggml-quants.c``, ``dequantize_row_*``; each function names
the one it mirrors). ``gguf.quants.dequantize`` is its bit-exact oracle in the tests
(``tests/quant/test_gguf_blocks.py``): the formulas are evaluated in float32 in ggml's order, so
every value is the same float.

The products with activations are compiled: :mod:`refengine.cpu.gguf_products` (float32
activations, decoding on the fly) and, with ``activation_dtype="q8_0"``,
:mod:`refengine.cpu.q8_products` (Q8_0 activations, Q8_K for the K-quants, integer sums), imported when
:meth:`GGUFWeight.numba_linear` is first called. Their NumPy twin is
:func:`refengine.quant.reference_linear`.

Files are taken to be little-endian (GGUF's default; the big-endian variant is not read).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from refengine.quant import QuantizedWeight, compiled_products

#: Per type: (weights per block, bytes per block, fields). A field is (plane name, byte
#: offset in the block, bytes in the block, plane dtype); the planes' order is the file's.
BLOCK_LAYOUTS: dict[str, tuple[int, int, tuple[tuple[str, int, int, str], ...]]] = {
    "F32": (1, 4, (("w", 0, 4, "<f4"),)),
    "F16": (1, 2, (("bits", 0, 2, "<u2"),)),
    "BF16": (1, 2, (("bits", 0, 2, "<u2"),)),
    "Q8_0": (32, 34, (("d", 0, 2, "<u2"), ("qs", 2, 32, "i1"))),
    "Q4_0": (32, 18, (("d", 0, 2, "<u2"), ("qs", 2, 16, "u1"))),
    "Q4_1": (32, 20, (("d", 0, 2, "<u2"), ("m", 2, 2, "<u2"), ("qs", 4, 16, "u1"))),
    "Q5_0": (32, 22, (("d", 0, 2, "<u2"), ("qh", 2, 4, "<u4"), ("qs", 6, 16, "u1"))),
    "Q5_1": (32, 24, (("d", 0, 2, "<u2"), ("m", 2, 2, "<u2"), ("qh", 4, 4, "<u4"), ("qs", 8, 16, "u1"))),
    "Q4_K": (256, 144, (("d", 0, 2, "<u2"), ("dmin", 2, 2, "<u2"), ("scales", 4, 12, "u1"), ("qs", 16, 128, "u1"))),
    "Q5_K": (256, 176, (("d", 0, 2, "<u2"), ("dmin", 2, 2, "<u2"), ("scales", 4, 12, "u1"),
                        ("qh", 16, 32, "u1"), ("qs", 48, 128, "u1"))),
    "Q6_K": (256, 210, (("ql", 0, 128, "u1"), ("qh", 128, 64, "u1"), ("scales", 192, 16, "i1"), ("d", 208, 2, "<u2"))),
}

#: The types :class:`GGUFWeight` holds.
SUPPORTED_TYPES = tuple(BLOCK_LAYOUTS)


def _qtype(qtype):
    """``qtype`` (a ``gguf.GGMLQuantizationType``, its name or its number) -> the enum member.

    Raises:
        ValueError: a type that is not in :data:`SUPPORTED_TYPES`.
    """
    from gguf import GGMLQuantizationType  # imported here so `import refengine` stays light

    try:
        if isinstance(qtype, str):
            member = GGMLQuantizationType[qtype.upper()]
        else:
            member = GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"unknown GGUF tensor type {qtype!r}; supported: {', '.join(SUPPORTED_TYPES)}") from None
    if member.name not in BLOCK_LAYOUTS:
        raise ValueError(f"unsupported GGUF tensor type {member.name!r}; supported: {', '.join(SUPPORTED_TYPES)}")
    return member


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    """IEEE half-precision bit patterns (uint16, any shape) -> float32, exactly (NumPy's conversion)."""
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 ``[..., n]`` -> ``[..., 2n]``: the low nibbles, then the high nibbles."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of Q4_K/Q5_K superblocks: uint8 ``[..., 12]`` ->
    two uint8 ``[..., 8]``. Mirrors ggml's ``get_scale_min_k4`` (ggml-quants.c): pairs 0-3
    are the low six bits of bytes 0-3 (scales) and 4-7 (mins); pairs 4-7 take their low four
    bits from bytes 8-11 (low nibble scale, high nibble min) and their top two bits from the
    top two bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = scales
    low = s[..., 0:4] & np.uint8(63), s[..., 4:8] & np.uint8(63)
    high_sc = (s[..., 8:12] & np.uint8(0x0F)) | ((s[..., 0:4] >> np.uint8(6)) << np.uint8(4))
    high_m = (s[..., 8:12] >> np.uint8(4)) | ((s[..., 4:8] >> np.uint8(6)) << np.uint8(4))
    return np.concatenate([low[0], high_sc], axis=-1), np.concatenate([low[1], high_m], axis=-1)


def k_pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The inverse of :func:`k_scales_mins`: eight 6-bit scales and eight 6-bit mins, two
    uint8 ``[..., 8]``, packed into the superblocks' 12 bytes, uint8 ``[..., 12]`` (every bit
    of the 12 bytes is one of the 96 bits, so packing is exact)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    low_sc = (sc[..., 0:4] & np.uint8(63)) | ((sc[..., 4:8] >> np.uint8(4)) << np.uint8(6))
    low_m = (mn[..., 0:4] & np.uint8(63)) | ((mn[..., 4:8] >> np.uint8(4)) << np.uint8(6))
    high = (sc[..., 4:8] & np.uint8(0x0F)) | ((mn[..., 4:8] & np.uint8(0x0F)) << np.uint8(4))
    return np.concatenate([low_sc, low_m, high], axis=-1)


class GGUFWeight(QuantizedWeight):
    """A matrix ``[out_features, in_features]`` in one GGUF block type, its bytes as stored.

    Layout: the file's blocks split by field into planes (structure of arrays), each a
    C-contiguous array ``[rows, blocks_per_row * items]`` in :attr:`planes` (a dict, in the
    block's field order), together exactly the file's bytes (:attr:`nbytes` is
    ``rows * bytes_per_row``, as in the file). f16 fields are kept as their uint16 bit patterns
    (numba has no float16). With ``nb = in_features // block_size``:

    * F32: ``w`` float32 ``[rows, in]``. F16, BF16: ``bits`` uint16 ``[rows, in]``.
    * Q8_0 (32 per block): ``d`` uint16 ``[rows, nb]``; ``qs`` int8 ``[rows, nb*32]``.
    * Q4_0: ``d``; ``qs`` uint8 ``[rows, nb*16]``: byte ``i`` of a block holds weight ``i``
      in its low nibble and weight ``i + 16`` in its high nibble.
    * Q4_1: ``d``, ``m`` uint16 ``[rows, nb]``; ``qs`` as Q4_0.
    * Q5_0: ``d``; ``qh`` uint32 ``[rows, nb]`` (bit ``i``: the fifth bit of weight ``i``); ``qs`` as Q4_0.
    * Q5_1: ``d``, ``m``, ``qh``, ``qs``.
    * Q4_K (superblocks of 256): ``d``, ``dmin`` uint16 ``[rows, nb]``; ``scales`` uint8
      ``[rows, nb*12]`` (eight 6-bit scale/min pairs, :func:`k_scales_mins`); ``qs`` uint8
      ``[rows, nb*128]``: bytes ``32c .. 32c + 31`` hold weights ``64c + l`` (low nibble)
      and ``64c + 32 + l`` (high nibble).
    * Q5_K: as Q4_K plus ``qh`` uint8 ``[rows, nb*32]`` (bit ``s`` of byte ``l``: the fifth
      bit of weight ``32s + l``), in the order ``d, dmin, scales, qh, qs``.
    * Q6_K: ``ql`` uint8 ``[rows, nb*128]``, ``qh`` uint8 ``[rows, nb*64]``, ``scales`` int8
      ``[rows, nb*16]`` (one per 16 weights), ``d`` uint16 ``[rows, nb]``.

    Attributes:
        qtype: the ``gguf.GGMLQuantizationType``.
        format: its name (``"Q4_1"`` ...).
        shape: ``(out_features, in_features)``.
        block_size, type_size: weights and bytes per block.
        planes: the fields' arrays, as above.

    Rows are independent (each its own blocks), so :meth:`take_rows` and
    :meth:`concat_rows` move bytes and never requantize.
    """

    def __init__(self, qtype, planes: dict[str, np.ndarray], shape: tuple[int, int]):
        """From planes already split (:meth:`from_raw` splits a file's bytes).

        Raises:
            ValueError: an unknown type, a row length that is not a multiple of the block
                size, or planes missing, extra, or not of the layout's dtype and shape.
        """
        self.qtype = _qtype(qtype)
        self.format = self.qtype.name
        self.block_size, self.type_size, fields = BLOCK_LAYOUTS[self.format]
        rows, cols = int(shape[0]), int(shape[1])
        if rows < 0 or cols <= 0 or cols % self.block_size:
            raise ValueError(f"{self.format} rows must hold a positive multiple of {self.block_size} weights, "
                             f"got shape {tuple(shape)}")
        self.shape = (rows, cols)
        nb = cols // self.block_size
        if set(planes) != {f[0] for f in fields}:
            raise ValueError(f"{self.format} planes must be {[f[0] for f in fields]}, got {sorted(planes)}")
        self._planes = {}
        for name, _offset, size, dtype in fields:
            plane = planes[name]
            want = (rows, nb * size // np.dtype(dtype).itemsize)
            if plane.dtype != np.dtype(dtype).newbyteorder("=") or plane.shape != want:
                raise ValueError(f"{self.format} plane {name!r} must be {np.dtype(dtype).name} {want}, "
                                 f"got {plane.dtype.name} {plane.shape}")
            self._planes[name] = np.ascontiguousarray(plane)

    @classmethod
    def from_raw(cls, qtype, data: np.ndarray, shape: Sequence[int] | None = None) -> "GGUFWeight":
        """From a tensor's bytes as stored: ``data`` is what ``gguf.GGUFReader`` returns as
        ``tensor.data`` (uint8 ``[rows, bytes_per_row]`` for the block types and BF16,
        float32/float16 ``[rows, cols]`` for F32/F16), or any array of the same bytes.

        Args:
            qtype: a ``gguf.GGMLQuantizationType``, its name (``"Q4_1"``) or its number.
            data: the bytes, ``rows * cols // block_size * type_size`` of them.
            shape: ``(rows, cols)`` in weights (``[out, in]``); by default ``data``'s shape,
                converted from bytes to weights when ``data`` is uint8.

        Raises:
            ValueError: an unknown type, ``cols`` not a multiple of the block size, or a byte
                count that does not match ``shape``.
        """
        qtype = _qtype(qtype)
        block_size, type_size, fields = BLOCK_LAYOUTS[qtype.name]
        data = np.asarray(data)
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        if shape is None:
            if data.ndim != 2:
                raise ValueError(f"{qtype.name} data must be 2-D [rows, ...] when no shape is given, got {data.shape}")
            if data.dtype == np.uint8:
                if data.shape[1] % type_size:
                    raise ValueError(f"{qtype.name} rows of {data.shape[1]} bytes are not a multiple of "
                                     f"its {type_size}-byte blocks")
                shape = (data.shape[0], data.shape[1] // type_size * block_size)
            else:
                shape = data.shape
        rows, cols = int(shape[0]), int(shape[1])
        if cols <= 0 or cols % block_size:
            raise ValueError(f"{qtype.name} row length {cols} is not a positive multiple of its "
                             f"block size {block_size}")
        nb = cols // block_size
        want = rows * nb * type_size
        if data.nbytes != want:
            raise ValueError(f"{qtype.name} {rows}x{cols} needs {want} bytes, got {data.nbytes}")
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(rows, nb, type_size)
        planes = {}
        for name, offset, size, dtype in fields:
            field = np.ascontiguousarray(raw[:, :, offset:offset + size])
            planes[name] = field.view(np.dtype(dtype).newbyteorder("=")).reshape(rows, -1)
        return cls(qtype, planes, (rows, cols))

    @classmethod
    def from_tensor(cls, tensor) -> "GGUFWeight":
        """From a ``gguf.ReaderTensor`` (``GGUFReader(path).tensors[i]``): its ``data`` and
        ``tensor_type``, rows of ``tensor.shape[0]`` weights (ggml lists dimensions
        innermost first). Raises ValueError as :meth:`from_raw`."""
        dims = [int(n) for n in tensor.shape]
        cols = dims[0]
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        return cls.from_raw(tensor.tensor_type, tensor.data, (rows, cols))

    # ---------------------------------------------------------------------------------
    # bytes

    @property
    def planes(self) -> dict[str, np.ndarray]:
        """The fields' arrays (the class docstring). A weight whose products run on its
        interleaved copy alone (:meth:`drop_planes`) rebuilds them on each access, from
        that copy (:func:`refengine.cpu.q8_products.row_major_planes`)."""
        if self._planes is None:
            return compiled_products("q8").row_major_planes(self)
        return self._planes

    def drop_planes(self) -> None:
        """Keep only the interleaved copy of the quants (built first,
        :func:`refengine.cpu.q8_products.interleave`): one copy of the matrix in memory.

        Raises:
            ValueError: no interleaved copy yet.
        """
        if "_x16" not in self.__dict__:
            raise ValueError(f"{self.format} weight {self.shape} has no interleaved copy to keep")
        self._planes = None

    @property
    def nbytes(self) -> int:
        """Bytes held: the file's ``rows * bytes_per_row`` (the interleaved copy's, padding
        rows included, once the planes are dropped)."""
        if self._planes is None:
            return sum(int(p.nbytes) for p in self._x16)
        return sum(int(p.nbytes) for p in self.planes.values())

    @property
    def blocks_per_row(self) -> int:
        return self.shape[1] // self.block_size

    def to_raw(self) -> np.ndarray:
        """The blocks as the file stores them: uint8 ``[rows, blocks_per_row * type_size]``."""
        rows, nb = self.shape[0], self.blocks_per_row
        raw = np.empty((rows, nb, self.type_size), dtype=np.uint8)
        planes = self.planes
        for name, offset, size, _dtype in BLOCK_LAYOUTS[self.format][2]:
            raw[:, :, offset:offset + size] = planes[name].view(np.uint8).reshape(rows, nb, size)
        return raw.reshape(rows, nb * self.type_size)

    def _with_planes(self, planes: dict[str, np.ndarray]) -> "GGUFWeight":
        return GGUFWeight(self.qtype, planes, (next(iter(planes.values())).shape[0], self.shape[1]))

    def take_rows(self, order: np.ndarray) -> "GGUFWeight":
        """The weight whose row ``i`` is this one's row ``order[i]`` (int ``[n]``: a permutation
        or a subset), same type: each plane's rows are gathered.

        Raises:
            IndexError: an index outside ``[-rows, rows)``.
        """
        order = np.asarray(order, dtype=np.int64).reshape(-1)
        return self._with_planes({k: np.ascontiguousarray(p[order]) for k, p in self.planes.items()})

    def take_columns(self, start: int, stop: int) -> "GGUFWeight":
        """Weights ``start:stop`` of every row, same type: whole blocks, so each plane's
        columns of those blocks are sliced and no block is requantized.

        Raises:
            ValueError: ``start`` or ``stop`` not a multiple of the block size, or outside the row.
        """
        bs = self.block_size
        if start % bs or stop % bs or not 0 <= start < stop <= self.shape[1]:
            raise ValueError(f"{self.format} columns {start}:{stop} of {self.shape[1]} do not fall on its "
                             f"{bs}-weight blocks")
        nb = self.blocks_per_row
        planes = {}
        for name, p in self.planes.items():
            per_block = p.shape[1] // nb
            planes[name] = np.ascontiguousarray(p[:, start // bs * per_block:stop // bs * per_block])
        return GGUFWeight(self.qtype, planes, (self.shape[0], stop - start))

    @classmethod
    def concat_rows(cls, parts: Sequence["GGUFWeight"]) -> "GGUFWeight":
        """``parts`` stacked on the output axis (each plane concatenated).

        Raises:
            ValueError: no parts, or parts of different types or row lengths.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("concat_rows needs at least one part")
        kinds = {(p.format, p.shape[1]) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"concat_rows needs one type and row length, got {sorted(kinds)}")
        each = [p.planes for p in parts]
        planes = {k: np.concatenate([p[k] for p in each], axis=0) for k in each[0]}
        return parts[0]._with_planes(planes)

    # ---------------------------------------------------------------------------------
    # NumPy dequantization: the definition of each type

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` (Python slice semantics) as float32 ``[n, in_features]``."""
        rows = slice(start, stop)
        if self._planes is None:  # only the interleaved copy: just these rows rebuilt
            return self._decode(compiled_products("q8").row_major_planes(self, np.arange(self.shape[0])[rows]))
        return self._decode({k: p[rows] for k, p in self.planes.items()})

    def select_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int, any shape, flattened) as float32 ``[n, in_features]``: an
        embedding lookup that decodes only the rows asked for.

        Raises:
            IndexError: an index outside ``[-rows, rows)``.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if self._planes is None:
            return self._decode(compiled_products("q8").row_major_planes(self, rows))
        return self._decode({k: p[rows] for k, p in self.planes.items()})

    def _decode(self, planes: dict[str, np.ndarray]) -> np.ndarray:
        """The planes of some rows -> float32 ``[n, in_features]`` by the type's formula."""
        n = next(iter(planes.values())).shape[0]
        out = _DECODERS[self.format](planes, n, self.blocks_per_row)
        return np.ascontiguousarray(out.reshape(n, self.shape[1]), dtype=np.float32)

    # ---------------------------------------------------------------------------------

    #: The ``activation_dtype`` values :meth:`numba_linear` takes.
    activation_dtypes = ("auto", "q8_0")

    def numba_linear(self, x: np.ndarray, *, batch_invariant: bool = False,
                     activation_dtype: str = "auto") -> np.ndarray:
        """``x [T, in] @ self.T`` -> float32 ``[T, out]`` by the compiled kernels of
        :mod:`refengine.cpu.gguf_products` (decoding on the fly, never the whole matrix).
        ``x``: float32 (cast to C-contiguous float32 otherwise). ``batch_invariant``: the
        fused dot kernels at every row count (a row's results the same bits in any batch).
        ``activation_dtype="q8_0"``: ``x`` rounded to ggml's Q8_0 blocks and integer
        products for the block types (Q8_K for the K-quants; :mod:`refengine.cpu.q8_products`).

        Raises:
            ValueError: ``x`` not 2-D with ``in_features`` columns, or an ``activation_dtype``
                not in :attr:`activation_dtypes`.
        """
        if activation_dtype == "q8_0":
            return compiled_products("q8").linear(x, self, batch_invariant=batch_invariant)
        if activation_dtype != "auto":
            raise ValueError(f"activation_dtype={activation_dtype!r} is not one of {self.activation_dtypes}")
        return compiled_products("gguf").linear(x, self, batch_invariant=batch_invariant)

    def row_product(self, threads: int):
        """This weight's one-row product with Q8_0 (Q8_K) activations on ``threads`` numba threads,
        every argument but the row bound (:class:`refengine.cpu.q8_products.RowProduct`:
        ``run(x [1, in_features])``, C-contiguous float32, unchecked), or None for a type
        without an integer kernel. A fresh one each call, owning its buffers."""
        q8 = compiled_products("q8")
        return q8.RowProduct(self, threads) if self.format in q8.INTEGER_TYPES else None

    def __getstate__(self) -> dict:
        """Pickled without the kernels' product plans (compiled functions and scratch kept on
        the weight by :func:`refengine.cpu.gguf_products.product_plan`) and interleaved planes
        (:func:`refengine.cpu.q8_products.interleave`), rebuilt at first use; with the
        row-major planes, rebuilt first where only the interleaved copy was kept."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_plans", "_x16")}
        state["_planes"] = self.planes  # rebuilt where only the interleaved copy was kept
        return state


# -------------------------------------------------------------------------------------
# The formulas, one per type. Each takes the planes of n rows and returns float32 whose
# elements, flattened per row, are the row's weights. float32 throughout, in ggml's order
# of operations (never fused): the same floats as ggml's scalar code and gguf-py.


def _dequant_f32(p, n, nb):
    """F32: the values themselves (a copy: the caller may write to it)."""
    return p["w"].copy()


def _dequant_f16(p, n, nb):
    """F16: IEEE half -> float32 (ggml's ``ggml_fp16_to_fp32_row``)."""
    return f16_to_f32(p["bits"])


def _dequant_bf16(p, n, nb):
    """BF16: the top 16 bits of a float32 (ggml's ``ggml_bf16_to_fp32_row``)."""
    return (p["bits"].astype(np.uint32) << np.uint32(16)).view(np.float32)


def _dequant_q8_0(p, n, nb):
    """Q8_0: ``y = q * d``, ``q`` int8 (ggml's ``dequantize_row_q8_0``)."""
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    q = p["qs"].reshape(n, nb, 32).astype(np.float32)
    return q * d


def _dequant_q4_0(p, n, nb):
    """Q4_0: ``y = (q - 8) * d``, ``q`` the 4-bit ``0..15`` (ggml's ``dequantize_row_q4_0``)."""
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    q = _nibbles(p["qs"].reshape(n, nb, 16)).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * d


def _dequant_q4_1(p, n, nb):
    """Q4_1: ``y = q * d + m``, ``q`` the 4-bit ``0..15`` (ggml's ``dequantize_row_q4_1``)."""
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    m = f16_to_f32(p["m"]).reshape(n, nb, 1)
    q = _nibbles(p["qs"].reshape(n, nb, 16)).astype(np.float32)
    return q * d + m


def _five_bit(qs, qh, n, nb):
    """The Q5_0/Q5_1 quants ``0..31``: nibble ``| (bit i of qh) << 4`` for weight ``i`` of a block."""
    bit = (qh.reshape(n, nb, 1) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return _nibbles(qs.reshape(n, nb, 16)) | (bit.astype(np.uint8) << np.uint8(4))


def _dequant_q5_0(p, n, nb):
    """Q5_0: ``y = (q - 16) * d``, ``q`` the 5-bit ``0..31`` (ggml's ``dequantize_row_q5_0``)."""
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    q = _five_bit(p["qs"], p["qh"], n, nb).astype(np.int8) - np.int8(16)
    return q.astype(np.float32) * d


def _dequant_q5_1(p, n, nb):
    """Q5_1: ``y = q * d + m``, ``q`` the 5-bit ``0..31`` (ggml's ``dequantize_row_q5_1``)."""
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    m = f16_to_f32(p["m"]).reshape(n, nb, 1)
    q = _five_bit(p["qs"], p["qh"], n, nb).astype(np.float32)
    return q * d + m


def _k_sub_scales(p, n, nb):
    """Q4_K/Q5_K: per 32-weight sub-block ``d * sc`` and ``dmin * m``, float32 ``[n, nb, 8, 1]``."""
    sc, mn = k_scales_mins(p["scales"].reshape(n, nb, 12))
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    dmin = f16_to_f32(p["dmin"]).reshape(n, nb, 1)
    return (d * sc.astype(np.float32))[..., None], (dmin * mn.astype(np.float32))[..., None]


def _k_nibbles(qs, n, nb):
    """Q4_K/Q5_K low four bits ``[n, nb, 8, 32]``: sub-block ``2c`` the low nibbles of bytes
    ``32c ..``, sub-block ``2c + 1`` their high nibbles."""
    q = qs.reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (q & np.uint8(0x0F)).reshape(n, nb, 8, 32)


def _k_quants(p, n, nb):
    """Q4_K/Q5_K quants ``[n, nb, 8, 32]`` (sub-block, weight), uint8: the 4-bit ``0..15``,
    or for Q5_K (a ``qh`` plane) the 5-bit ``0..31``, whose fifth bit for weight ``l`` of
    sub-block ``s`` is bit ``s`` of ``qh[l]``."""
    q = _k_nibbles(p["qs"], n, nb)
    if "qh" in p:
        high = (p["qh"].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & np.uint8(1)
        q = q | (high << np.uint8(4))
    return q


def _dequant_q4_k(p, n, nb):
    """Q4_K: ``y = (d * sc) * q - dmin * m`` per 32-weight sub-block, ``q`` the 4-bit
    ``0..15`` (ggml's ``dequantize_row_q4_K``)."""
    d1, m1 = _k_sub_scales(p, n, nb)
    return d1 * _k_quants(p, n, nb).astype(np.float32) - m1


def _dequant_q5_k(p, n, nb):
    """Q5_K: as Q4_K with 5-bit ``q`` (:func:`_k_quants`; ggml's ``dequantize_row_q5_K``)."""
    d1, m1 = _k_sub_scales(p, n, nb)
    return d1 * _k_quants(p, n, nb).astype(np.float32) - m1


def _q6_k_quants(p, n, nb):
    """Q6_K quants ``q - 32`` ``[n, nb, 16, 16]`` (16-weight group, weight), int8 in
    ``-32..31``. Per half ``h`` of a superblock (weights ``128h ..``) and quarter ``k``,
    weight ``128h + 32k + l`` takes its low four bits from ``ql[64h + 32(k % 2) + l]`` (low
    nibble for ``k < 2``, high for ``k >= 2``) and its top two from bits ``2k, 2k + 1`` of
    ``qh[32h + l]`` (ggml's ``dequantize_row_q6_K``)."""
    ql = p["ql"].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, nb, 2, 4, 32)  # [half, quarter k = 2 * nibble + (l >= 32), l]
    qh = p["qh"].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = (ql | ((qh & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n, nb, 16, 16)


def _dequant_q6_k(p, n, nb):
    """Q6_K: ``y = (d * sc) * (q - 32)`` per 16-weight group, ``q`` the 6-bit ``0..63``
    (:func:`_q6_k_quants`; ggml's ``dequantize_row_q6_K``); the scale of a weight is
    ``scales[weight // 16]``."""
    d = f16_to_f32(p["d"]).reshape(n, nb, 1)
    scale = (d * p["scales"].reshape(n, nb, 16).astype(np.float32)).reshape(n, nb, 16, 1)
    return scale * _q6_k_quants(p, n, nb).astype(np.float32)


_DECODERS = {
    "F32": _dequant_f32, "F16": _dequant_f16, "BF16": _dequant_bf16,
    "Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1,
    "Q5_0": _dequant_q5_0, "Q5_1": _dequant_q5_1,
    "Q4_K": _dequant_q4_k, "Q5_K": _dequant_q5_k, "Q6_K": _dequant_q6_k,
}


# -------------------------------------------------------------------------------------
# Q8_K activations with the K-quants: the NumPy twin of refengine.cpu.q8_products' kernels.

#: The K-quant types whose products take Q8_K activations (:func:`reference_q8_k_linear`).
Q8_K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def reference_quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x [T, K]`` (float32, ``K`` a multiple of 256) as ggml's Q8_K blocks, written from
    ``quantize_row_q8_K_ref`` (``ggml-quants.c``; x86's ``quantize_row_q8_K`` calls it).

    Per block of 256: ``top`` the first value of largest magnitude (with its sign),
    ``iscale = -127 / top``, ``q = nearest_int(iscale * x)`` (round half to even: ggml adds
    ``1.5 * 2**23``), at most 127, ``d = 1 / iscale`` (float32, not f16: the value ``q``
    stands for is ``d * q``), and ``bsums`` the sums of the quants in groups of 16. A block
    of zeros has ``d = 0`` and zero quants.

    Returns:
        ``(q, d, bsums)``: int8 ``[T, K]`` in ``[-127, 127]``, float32 ``[T, K/256]``, int32
        ``[T, K/16]``.
    Raises:
        ValueError: ``x`` not 2-D, or ``K`` not a multiple of 256.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % 256:
        raise ValueError(f"x must be [T, K] with K a multiple of 256, got {x.shape}")
    rows, k = x.shape
    blocks = x.reshape(rows, k // 256, 256)
    mag = np.abs(blocks)
    amax = mag.max(axis=-1, initial=np.float32(0.0))
    first = np.argmax(mag == amax[..., None], axis=-1)  # ggml's scan keeps the first of the largest
    top = np.take_along_axis(blocks, first[..., None], axis=-1)[..., 0]
    zero = amax == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.float32(-127.0) / np.where(zero, np.float32(1.0), top)
        q = np.minimum(np.rint(blocks * iscale[..., None]), np.float32(127.0))
    q[zero] = 0
    q = q.astype(np.int8).reshape(rows, k)
    d = np.where(zero, np.float32(0.0), np.float32(1.0) / iscale).astype(np.float32)
    bsums = q.reshape(rows, k // 16, 16).sum(axis=-1, dtype=np.int32)
    return q, d, bsums


def reference_q8_k_linear(x: np.ndarray, w: GGUFWeight) -> np.ndarray:
    """``x [T, in] @ w.T`` -> float32 ``[T, out]`` with ``x`` rounded to Q8_K
    (:func:`reference_quantize_q8_k`) and a Q4_K, Q5_K or Q6_K ``w``: ggml's
    ``ggml_vec_dot_q4_K_q8_K`` ... ``_q6_K_q8_K`` in integers, the float32 steps in the order
    of :mod:`refengine.cpu.q8_products`' kernels, so that they give these bits.

    Per output ``(t, j)`` and superblock ``b``, exact integers: ``isum`` the sum over
    sub-blocks of ``sc * dot(q_w, q_x)`` (Q6_K: over its 16-weight groups, ``q_w - 32``), and
    for Q4_K/Q5_K ``msum = sum_s m_s * (bsums[2s] + bsums[2s + 1])`` (the minimums meet only
    the activations' sums). Then, in float32, one rounding each:
    ``acc = acc + float(isum) * (d_w * d_x)`` and ``accm = accm + float(msum) * (dmin_w *
    -d_x)`` over ``b`` in order, and ``acc + accm``. (ggml's own AVX2 kernels fold the same
    integers in another float order.)

    Raises:
        ValueError: ``w`` not of those types, or ``x`` not ``[T, in]``.
    """
    if w.format not in Q8_K_TYPES:
        raise ValueError(f"no Q8_K product for GGUF type {w.format!r}; types: {', '.join(Q8_K_TYPES)}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [T, {w.shape[1]}] for a {w.format} weight {w.shape}, got {x.shape}")
    q, dx, bsums = reference_quantize_q8_k(x)
    p, (n, _k), nb, rows = w.planes, w.shape, w.blocks_per_row, x.shape[0]
    if w.format == "Q6_K":
        dots = np.einsum("tbgl,nbgl->tnbg", q.reshape(rows, nb, 16, 16).astype(np.int64),
                         _q6_k_quants(p, n, nb).astype(np.int64))
        isum = (dots * p["scales"].reshape(1, n, nb, 16).astype(np.int64)).sum(axis=-1)
        msum, dmin = np.zeros_like(isum), np.zeros((n, nb), np.float32)
    else:
        dots = np.einsum("tbsl,nbsl->tnbs", q.reshape(rows, nb, 8, 32).astype(np.int64),
                         _k_quants(p, n, nb).astype(np.int64))
        sc, mn = k_scales_mins(p["scales"].reshape(n, nb, 12))
        isum = (dots * sc.astype(np.int64)).sum(axis=-1)
        pairs = bsums.reshape(rows, 1, nb, 8, 2).sum(axis=-1, dtype=np.int64)  # the sub-blocks' activation sums
        msum = (pairs * mn.astype(np.int64)).sum(axis=-1)
        dmin = f16_to_f32(p["dmin"])
    d = f16_to_f32(p["d"])
    acc = np.zeros((rows, n), np.float32)
    accm = np.zeros((rows, n), np.float32)
    for b in range(nb):
        acc = acc + isum[:, :, b].astype(np.float32) * (d[None, :, b] * dx[:, b, None])
        accm = accm + msum[:, :, b].astype(np.float32) * (dmin[None, :, b] * -dx[:, b, None])
    return acc + accm
