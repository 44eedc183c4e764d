"""AWQ and GPTQ checkpoints, repacked at load into :class:`refengine.quant.int4.Int4Weight`.

Hugging Face safetensors: ``config.json``'s ``quantization_config`` and the packed tensors.

A quantized linear layer ``P`` (e.g. ``model.layers.0.self_attn.q_proj``) ships
``P.qweight``, ``P.qzeros``, ``P.scales`` (and for GPTQ usually ``P.g_idx``) instead of
``P.weight [out, in]``. Both formats pack eight 4-bit values into each int32, value ``i``
in bits ``4i .. 4i + 3``; they differ in the axis packed, the order, and the zero point.
With ``G = ceil(in / group_size)`` groups (``group_size = -1``: one group, the whole row)::

    w[o, i] = (q[o, i] - z[g(i), o]) * s[g(i), o]

**AWQ, GEMM packing** (``quant_method: "awq"``, ``version``/``format: "gemm"``; AutoAWQ
``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``; Lin et al. 2023):

* ``qweight`` int32 ``[in, out / 8]``, packed along the *output* axis: nibble ``i`` of
  ``qweight[k, c]`` is ``q[8c + ORDER[i], k]`` with ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``
  (the interleave its CUDA kernel dequantizes in);
* ``qzeros`` int32 ``[G, out / 8]``, the zero points packed the same way, used as they are;
* ``scales`` float16 ``[G, out]``; ``g(i) = i // group_size``. ``zero_point: false`` has no
  GEMM packing (``from_linear`` requires zeros) and is refused.

**GPTQ** (``quant_method: "gptq"``; AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py``,
``QuantLinear.pack``; GPTQModel for v2; Frantar et al. 2022):

* ``qweight`` int32 ``[in / 8, out]``, packed along the *input* axis in order: nibble ``i`` of
  ``qweight[r, o]`` is ``q[o, 8r + i]``;
* ``qzeros`` int32 ``[G, out / 8]`` packed along the output axis in order: nibble ``i`` of
  ``qzeros[g, c]`` is the stored zero of output ``8c + i``. The v1 format
  (``checkpoint_format``/``format: "gptq"``, the default) stores ``z - 1`` (AutoGPTQ's
  ``zeros -= 1`` before packing) and adds the 1 back when unpacking, so the zero point
  is ``nibble + 1`` in [1, 16]; v2 (``"gptq_v2"``, GPTQModel) stores ``z`` itself;
* ``scales`` float16 ``[G, out]``;
* ``g_idx`` int32 ``[in]``: the group of each input column. Without act-order it is
  ``i // group_size``; with act-order (``desc_act: true``) the columns were quantized in
  order of decreasing Hessian diagonal, ``perm``, and ``g_idx[i] = invperm[i] // group_size``
  (AutoGPTQ / GPTQModel ``gptq.py``, ``fasterquant``): every group still holds
  ``group_size`` columns, scattered. :class:`Int4Weight` sorts the columns by group
  (``perm = argsort(g_idx, stable)``) and permutes the input at run time
  (:mod:`refengine.quant.int4`).

Only 4-bit, int32-packed checkpoints are read; other bit widths, ``pack_dtype`` values and
formats (``gemv``, ``marlin``, ...) are refused with a ValueError naming the key. Layers a
checkpoint leaves unquantized (``modules_to_not_convert``, the embedding, ``lm_head``)
ship a plain ``P.weight`` and load as float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refengine.config import read_json_object
from refengine.quant.int4 import Int4Weight

#: Nibble ``i`` of an AWQ GEMM int32 holds output ``8c + AWQ_ORDER[i]`` (AutoAWQ ``order_map``).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: The checkpoint quantizations this module reads (``quantization_config.quant_method``).
CHECKPOINT_METHODS = ("awq", "gptq")
#: Every value of the ``quantization`` engine option: computed at load, or read from the checkpoint.
QUANTIZATIONS = ("int8", *CHECKPOINT_METHODS)
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's ``quantization_config``, checked.

    Attributes:
        method: ``"awq"`` or ``"gptq"``.
        group_size: columns per group as the config says (-1: the whole row).
        zero_offset: added to every stored zero point (GPTQ v1: 1; v2 and AWQ: 0).
        desc_act: GPTQ act-order (then every layer must ship ``g_idx``).
        source: the config file, for messages.
    """

    method: str
    group_size: int
    zero_offset: int
    desc_act: bool
    source: str

    @classmethod
    def from_config(cls, qc: dict, source: str) -> "CheckpointQuantization":
        """Check a parsed ``quantization_config``.

        Raises:
            ValueError: an unsupported ``quant_method``, bit width, format, packing or
                group size, or a key of the wrong type; the message names ``source`` and the key.
        """
        where = f"{source}: quantization_config"
        method = qc.get("quant_method")
        if not isinstance(method, str) or method.lower() not in CHECKPOINT_METHODS:
            raise ValueError(f"{where}['quant_method'] = {method!r} is not supported; refengine reads "
                             f"{', '.join(map(repr, CHECKPOINT_METHODS))} checkpoints")
        method = method.lower()
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"{where}['bits'] = {bits!r}: only 4-bit {method.upper()} checkpoints are supported")
        group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not (isinstance(group_size, int) and not isinstance(group_size, bool)
                and (group_size == -1 or (group_size >= 2 and group_size % 2 == 0))):
            raise ValueError(f"{where}['group_size'] = {group_size!r} must be -1 (the whole row) or an even "
                             "integer >= 2")
        if method == "awq":
            fmt = str(qc.get("version") or qc.get("format") or "gemm").lower()
            if fmt != "gemm":
                raise ValueError(f"{where}: AWQ version/format {fmt!r} is not supported; only 'gemm' "
                                 "(AutoAWQ WQLinear_GEMM packing)")
            if qc.get("zero_point", True) is not True:
                raise ValueError(f"{where}['zero_point'] = {qc.get('zero_point')!r}: AWQ GEMM checkpoints "
                                 "have zero points (zero_point: true)")
            return cls("awq", group_size, 0, False, source)
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; 'gptq' (v1) or 'gptq_v2'")
        pack_dtype = str(qc.get("pack_dtype", "int32")).lower()
        if pack_dtype != "int32":
            raise ValueError(f"{where}['pack_dtype'] = {pack_dtype!r}: only int32 packing is supported")
        desc_act = qc.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise ValueError(f"{where}['desc_act'] must be true or false, got {desc_act!r}")
        return cls("gptq", group_size, 1 if fmt == "gptq" else 0, desc_act, source)

    # --- the tensors --------------------------------------------------------------------
    def repack(self, weights: dict, source: str) -> int:
        """Replace every ``P.qweight`` / ``P.qzeros`` / ``P.scales`` (/ ``P.g_idx``) set of
        ``weights`` (checkpoint name -> array) by one :class:`Int4Weight` named ``P.weight``,
        in place. Other tensors are left for the loader's strict check.

        Returns:
            How many matrices were repacked.
        Raises:
            ValueError: a set with a missing part, a layer with both ``P.weight`` and
                ``P.qweight``, tensors of the wrong dtype or of inconsistent shapes, a
                ``g_idx`` whose groups are not ``group_size`` columns each, or no
                ``*.qweight`` at all; the message names the tensor and ``source``.
        """
        prefixes = [name[:-len(".qweight")] for name in weights if name.endswith(".qweight")]
        if not prefixes:
            raise ValueError(f"{self.source} says the checkpoint is {self.method.upper()}-quantized, but "
                             f"{source!r} has no '*.qweight' tensor")
        for prefix in prefixes:
            if prefix + ".weight" in weights:
                raise ValueError(f"checkpoint in {source!r} has both {prefix}.weight and {prefix}.qweight")
            needed = [prefix + s for s in (".qzeros", ".scales")]
            if self.desc_act:
                needed.append(prefix + ".g_idx")
            missing = [n for n in needed if n not in weights]
            if missing:
                raise ValueError(f"checkpoint in {source!r} has {prefix}.qweight but not {', '.join(missing)} "
                                 f"({self.method.upper()} layers ship qweight, qzeros and scales"
                                 + (", and g_idx with desc_act" if self.desc_act else "") + ")")
            parts = {s: weights.pop(prefix + "." + s) for s in ("qweight", "qzeros", "scales")}
            g_idx = weights.pop(prefix + ".g_idx", None) if self.method == "gptq" else None
            try:
                weights[prefix + ".weight"] = (self._awq if self.method == "awq" else self._gptq)(g_idx=g_idx, **parts)
            except ValueError as e:
                raise ValueError(f"checkpoint in {source!r}, {prefix}: {e}") from None
        return len(prefixes)

    def _groups(self, in_features: int) -> tuple[int, int]:
        """``(group size in columns, number of groups)`` for ``in_features`` columns."""
        gs = in_features if self.group_size == -1 else self.group_size
        return gs, -(-in_features // gs)

    def _awq(self, qweight, qzeros, scales, g_idx=None) -> Int4Weight:
        """AWQ GEMM tensors -> :class:`Int4Weight` (module docstring)."""
        _check_int32("qweight", qweight, 2)
        _check_int32("qzeros", qzeros, 2)
        in_features, out_features = qweight.shape[0], 8 * qweight.shape[1]
        gs, n_groups = self._groups(in_features)
        _check_shape("qzeros", qzeros, (n_groups, out_features // 8), in_features, out_features, gs)
        _check_scales(scales, n_groups, out_features, in_features, gs)
        reverse = np.argsort(AWQ_ORDER)  # output 8c + m is nibble reverse[m]
        q = _nibbles(qweight)[:, :, reverse].reshape(in_features, out_features).T   # [out, in]
        z = _nibbles(qzeros)[:, :, reverse].reshape(n_groups, out_features).T       # [out, G]
        return Int4Weight.from_values(q, scales.astype(np.float32).T, z, gs)

    def _gptq(self, qweight, qzeros, scales, g_idx=None) -> Int4Weight:
        """GPTQ v1/v2 tensors (optionally act-order) -> :class:`Int4Weight` (module docstring)."""
        _check_int32("qweight", qweight, 2)
        _check_int32("qzeros", qzeros, 2)
        in_features, out_features = 8 * qweight.shape[0], qweight.shape[1]
        gs, n_groups = self._groups(in_features)
        _check_shape("qzeros", qzeros, (n_groups, out_features // 8), in_features, out_features, gs)
        _check_scales(scales, n_groups, out_features, in_features, gs)
        if out_features % 8:
            raise ValueError(f"out_features {out_features} is not a multiple of 8 (qzeros packs 8 per int32)")
        # qweight[r, o] nibble i -> q[o, 8r + i]
        q = _nibbles(qweight.T).reshape(out_features, in_features)
        z = _nibbles(qzeros).reshape(n_groups, out_features).T.astype(np.int16) + self.zero_offset
        perm = None
        if g_idx is not None:
            g_idx = np.asarray(g_idx)
            if g_idx.shape != (in_features,) or not np.issubdtype(g_idx.dtype, np.integer):
                raise ValueError(f"g_idx must be an integer [{in_features}] tensor, got {g_idx.dtype} {g_idx.shape}")
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= n_groups):
                raise ValueError(f"g_idx values must lie in [0, {n_groups})")
            perm = np.argsort(g_idx, kind="stable")
            if not np.array_equal(g_idx[perm], np.arange(in_features) // gs):
                raise ValueError(f"g_idx does not put {gs} columns in each group (group_size {self.group_size}); "
                                 "only GPTQ's own act-order layouts are supported")
            q = q[:, perm]
        return Int4Weight.from_values(q, scales.astype(np.float32).T, z, gs, perm)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """The eight 4-bit values of each int32, low bits first: ``[..., n] -> [..., n, 8]`` uint8."""
    u = np.ascontiguousarray(packed).view(np.uint32)
    return ((u[..., None] >> _SHIFTS) & 15).astype(np.uint8)


def _check_int32(name: str, a: np.ndarray, ndim: int) -> None:
    """``a`` is a non-empty int32 (or uint32) tensor of ``ndim`` dimensions, else a
    ValueError naming ``name`` (an empty one would make a matrix of no columns, and
    ``group_size`` -1 groups of no columns)."""
    if a.dtype not in (np.int32, np.uint32) or a.ndim != ndim:
        raise ValueError(f"{name} must be an int32 {ndim}-D tensor, got {a.dtype} {a.shape}")
    if not a.size:
        raise ValueError(f"{name} is empty (shape {a.shape}); a quantized matrix has at least one row and column")


def _check_shape(name, a, want, in_features, out_features, gs) -> None:
    if tuple(a.shape) != want:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {want} for a [{out_features}, {in_features}] "
                         f"matrix in groups of {gs}")


def _check_scales(scales, n_groups, out_features, in_features, gs) -> None:
    if not (np.issubdtype(scales.dtype, np.floating) or scales.dtype.name == "bfloat16"):
        raise ValueError(f"scales must be a float tensor, got {scales.dtype}")
    _check_shape("scales", scales, (n_groups, out_features), in_features, out_features, gs)


# --- the checkpoint and the engine option ---------------------------------------------------

def checkpoint_quantization(model_path: str | Path) -> CheckpointQuantization | None:
    """The quantization ``model_path/config.json`` declares (``quantization_config``), or
    None for a float checkpoint (or a path that is not a model directory, e.g. a GGUF file).

    Raises:
        ValueError: a ``quantization_config`` that is not an object or is not supported
            (:meth:`CheckpointQuantization.from_config`).
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    qc = read_json_object(path).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{path}: 'quantization_config' must be a JSON object, got {qc!r}")
    return CheckpointQuantization.from_config(qc, str(path))


def resolve_quantization(quantization: str | None, model_path: str | Path) -> str | None:
    """The quantization a model runs with: the ``quantization`` engine option (vLLM's name)
    checked against the checkpoint.

    * None: as the checkpoint is: ``"awq"`` / ``"gptq"`` when ``config.json`` says so, else None (float);
    * ``"int8"``: a float checkpoint, or a GGUF file's tensors dequantized from their blocks,
      quantized at load (:mod:`refengine.quant.int8`);
    * ``"awq"`` / ``"gptq"``: must be what the checkpoint is.

    Raises:
        ValueError: an unknown value; ``"awq"``/``"gptq"`` for a checkpoint that is not
            quantized so, or for a GGUF file; ``"int8"`` for an AWQ/GPTQ checkpoint; an
            unsupported ``quantization_config``.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {', '.join(map(repr, QUANTIZATIONS))}")
    path = Path(model_path)
    if path.is_file():  # a GGUF file: its tensors keep their own block types, or become int8
        if quantization not in (None, "int8"):
            raise ValueError(f"quantization={quantization!r} does not apply to the GGUF file {str(path)!r}: "
                             "its tensors keep the block types they are stored in (or pass quantization='int8' "
                             "to requantize them per channel)")
        return quantization
    ckpt = checkpoint_quantization(path)
    found = ckpt.method if ckpt is not None else None
    if quantization is None or quantization == found:
        return found
    if found is not None:
        raise ValueError(f"quantization={quantization!r} but {ckpt.source} declares a {found!r} checkpoint "
                         f"(quantization_config); leave quantization unset or pass {found!r}")
    if quantization == "int8":
        return "int8"
    raise ValueError(f"quantization={quantization!r} but the checkpoint in {str(path)!r} is not "
                     f"{quantization}-quantized (config.json has no quantization_config); "
                     "quantization='int8' quantizes a float checkpoint at load")
