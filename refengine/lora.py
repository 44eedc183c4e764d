"""LoRA adapters over one base model, several in one batch: ``y = x W + (x A) B · scale``.

The formula (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3,
``h = W0 x + B A x``, scaled by ``alpha / r`` as its §4.1 says; PEFT's ``LoraLayer``):

    y[t] = x[t] @ W  +  ((x[t] @ A.T) @ B.T) * scale

for a projection ``W`` (``[in, out]``), an adapter's ``A`` (``lora_A.weight``, ``[r, in]``)
and ``B`` (``lora_B.weight``, ``[out, r]``), and ``scale = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski 2023, "A Rank Stabilization
Scaling Factor for Fine-Tuning with LoRA"; PEFT's ``LoraLayer.update_layer``). The base
product ``x @ W`` is computed as without adapters, whatever ``W``'s storage (float32, int8,
GGUF blocks, AWQ/GPTQ): the adapter is never merged into the weights, so rows of different
adapters, and rows of none, share one step (S-LoRA, Sheng et al. 2023; Punica, Chen et al.
2023). Rows without an adapter get exactly the base product: their bits do not change.

Batched shape (Punica's SGMV, vLLM's ``PunicaWrapper``): a step's rows are grouped by
adapter (:class:`LoRABatch`: per adapter, the sorted row indices of its sequences), and per
group and projection the layer ops add ``((x[rows] @ A.T) @ B.T) * scale`` into
``y[rows]`` (:meth:`refengine.ops.LayerOps.add_lora`; the NumPy twin is
:func:`add_lora_reference`, the numba kernel :mod:`refengine.cpu.lora_products`).

Fused projections: refengine multiplies q/k/v and gate/up as one matrix each
(:attr:`refengine.models.llama.LlamaForCausalLM.fused`). An adapter's modules of one fused
projection become one pair: ``A`` their ``lora_A`` stacked (``[r_q + r_k + r_v, in]``), ``B``
block-diagonal (``[r_q + r_k + r_v, out_q + out_k + out_v]``: module ``m``'s ``lora_B.T``
in its rows and columns, zeros elsewhere) and ``scale`` one number per output column (the
scale of the module the column belongs to, 0 for an untargeted module). The zeros add
nothing, so each column gets its module's ``((x A_m.T) B_m.T) * scale_m``.

PEFT adapters (``adapter_config.json`` + ``adapter_model.safetensors``, what
``PeftModel.save_pretrained`` writes): ``peft_type`` LORA, ``r``, ``lora_alpha``,
``use_rslora``, ``rank_pattern`` / ``alpha_pattern`` (per-module overrides),
``target_modules`` over the attention and MLP projections (``q_proj`` ... ``down_proj``,
or a family's own fused names such as Phi-3's ``qkv_proj``). Refused, by name: DoRA
(``use_dora``), ``fan_in_fan_out`` (GPT-2's Conv1D layout), trained biases (``bias`` other
than ``"none"``, ``lora_bias``), ``modules_to_save``, and adapters on the embedding or the LM head.

vLLM's names: :class:`LoRARequest` (``lora_name``, ``lora_int_id``, ``lora_path``),
``enable_lora``, ``max_lora_rank``, ``--lora-modules name=path``.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Tensor names in a PEFT adapter file: ``base_model.model.<module>.lora_{A,B}.weight``.
_PEFT_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<name>.+)")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's ``LoRARequest``).

    Attributes:
        lora_name: the adapter's name (a server's ``model`` for it).
        lora_int_id: a unique id >= 1 the engine knows the adapter by (its weights are
            loaded once per id).
        lora_path: the PEFT adapter directory.

    Raises (on construction):
        ValueError: an empty name or path, or an id that is not an integer >= 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} is invalid: must be a non-empty str")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} is invalid: must be an integer >= 1")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} is invalid: must be an adapter directory")


def lora_cache_key(lora_request: LoRARequest | None) -> bytes:
    """The bytes a sequence's first KV block hash takes for its adapter
    (:meth:`refengine.core.block_manager.BlockManager.block_hash_of`): nothing for the base
    model, else the id and the name after a tag, so a prompt under adapter A never matches
    blocks computed under B or the base (vLLM keys blocks by ``lora_name`` the same way)."""
    if lora_request is None:
        return b""
    name = lora_request.lora_name.encode("utf-8", "surrogatepass")
    return b"lora" + struct.pack("<qQ", lora_request.lora_int_id, len(name)) + name


def lora_scale(r: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling: ``alpha / sqrt(r)`` with rsLoRA, else ``alpha / r``."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def add_lora_reference(y, x, rows, a, b, scale, xp=np) -> None:
    """``y[rows] += ((x[rows] @ a.T) @ b) * scale`` in place: the NumPy twin of
    :meth:`refengine.ops.LayerOps.add_lora` (CuPy through ``xp``).

    Args:
        y: ``[T, out]`` float32, the base product of the step's rows.
        x: ``[T, in]`` float32, the projection's input.
        rows: ``[n]`` int64 (host), sorted, the rows of one adapter.
        a: ``[R, in]`` float32, the adapter's stacked ``lora_A``.
        b: ``[R, out]`` float32, its block-diagonal ``lora_B.T``.
        scale: ``[out]`` float32, each column's ``alpha / r`` (or rsLoRA's).
    """
    idx = xp.asarray(rows)
    shrunk = x[idx] @ a.T  # [n, R]
    y[idx] += (shrunk @ b) * scale


@dataclass
class LoRAWeights:
    """One fused projection's adapter: ``a [R, in]``, ``b [R, out]``, ``scale [out]``, float32 on the device."""

    a: object
    b: object
    scale: object


class LoRAAdapter:
    """A PEFT adapter loaded for one model: per layer, fused projection name -> :class:`LoRAWeights`.

    Args:
        request: the :class:`LoRARequest` it was loaded for.
        model_class: the base model's class (its ``fused`` map and ``layer_shapes``).
        config: the base model's :class:`refengine.config.ModelConfig`.
        max_lora_rank: the largest ``r`` allowed.
        xp: where the weights live (``numpy`` or ``cupy``).

    Attributes: ``request``, ``rank`` (the largest module rank), ``layers`` (list of dicts).

    Raises:
        ValueError: a missing or unreadable ``adapter_config.json`` / ``adapter_model.safetensors``,
            an adapter type or option refused (see the module docstring), a rank above
            ``max_lora_rank``, a tensor for a module the model does not have, of the wrong
            shape, or an ``A`` without its ``B``; the message names the file and the tensor.
    """

    def __init__(self, request: LoRARequest, model_class, config, max_lora_rank: int, xp=np):
        self.request = request
        path = Path(request.lora_path)
        cfg = read_adapter_config(path)
        tensors = read_adapter_tensors(path)
        parts = _fused_parts(model_class, config)  # module -> (fused name, column offset, out, in)
        modules: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for name, w in tensors.items():
            m = _PEFT_TENSOR.fullmatch(name)
            layer = _LAYER_MODULE.fullmatch(m["module"]) if m else None
            if layer is None or layer["name"] not in parts or int(layer["layer"]) >= config.num_hidden_layers:
                targets = ", ".join(sorted(parts))
                raise ValueError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA matrix of a projection "
                                 f"of this model's {config.num_hidden_layers} layers ({targets})")
            modules.setdefault((int(layer["layer"]), layer["name"]), {})[m["ab"]] = w
        self.rank = 0
        layers: list[dict[str, dict]] = [{} for _ in range(config.num_hidden_layers)]
        for (li, module), ab in sorted(modules.items()):
            where = f"{path / ADAPTER_WEIGHTS}: model.layers.{li}.{module}"
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{where} has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
            fused, offset, n_out, n_in = parts[module]
            r = ab["A"].shape[0]
            if ab["A"].shape != (r, n_in) or ab["B"].shape != (n_out, r):
                raise ValueError(f"{where}: lora_A {tuple(ab['A'].shape)} and lora_B {tuple(ab['B'].shape)} do not fit "
                                 f"the projection ({n_out} x {n_in}): want [r, {n_in}] and [{n_out}, r]")
            want_r = _pattern_value(cfg.get("rank_pattern") or {}, f"model.layers.{li}.{module}", cfg["r"])
            if r != want_r:
                raise ValueError(f"{where}: rank {r} differs from adapter_config.json's r={want_r}")
            if r > max_lora_rank:
                raise ValueError(f"{where}: rank r={r} is above max_lora_rank={max_lora_rank} (an engine option)")
            alpha = _pattern_value(cfg.get("alpha_pattern") or {}, f"model.layers.{li}.{module}", cfg["lora_alpha"])
            layers[li].setdefault(fused, []).append((offset, ab["A"], ab["B"], lora_scale(r, alpha, cfg["use_rslora"])))
            self.rank = max(self.rank, r)
        out_sizes = {fused: sum(n for f, _, n, _ in parts.values() if f == fused) for fused in model_class.fused}
        in_sizes = {fused: next(n for f, _, _, n in parts.values() if f == fused) for fused in model_class.fused}
        self.layers = [{fused: _fuse(mods, in_sizes[fused], out_sizes[fused], xp) for fused, mods in layer.items()}
                       for layer in layers]


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_adapter_config(path: Path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter, checked: ``r`` (int >= 1),
    ``lora_alpha`` (a number, default 8 as PEFT's), ``use_rslora`` (default False).

    Raises:
        ValueError: the file is missing or not JSON, ``peft_type`` is not LORA, a value is
            invalid, or an option refused (module docstring); the message names it.
    """
    from refengine.config import check_key, read_json_object

    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {ADAPTER_CONFIG} (a PEFT adapter directory holds "
                         f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg = read_json_object(file)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{file}: peft_type={cfg['peft_type']!r} is not a LoRA adapter (LORA)")
    check_key(cfg, "r", "count", True, str(file))
    cfg.setdefault("lora_alpha", 8)
    if isinstance(cfg["lora_alpha"], bool) or not isinstance(cfg["lora_alpha"], (int, float)) \
            or not math.isfinite(cfg["lora_alpha"]):
        raise ValueError(f"{file}: 'lora_alpha' must be a finite number, got {cfg['lora_alpha']!r}")
    cfg["use_rslora"] = bool(cfg.get("use_rslora") or False)
    refused = {"use_dora": "DoRA (use_dora) adapters", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
               "lora_bias": "trained LoRA biases (lora_bias)",
               "modules_to_save": "modules_to_save (fully trained modules)"}
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{file}: {key}={cfg[key]!r}: {what} are not supported; a plain LoRA adapter is")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={cfg['bias']!r}: trained biases are not supported (bias must be 'none')")
    return cfg


def read_adapter_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``adapter_model.safetensors`` as float32.

    Raises:
        ValueError: the file is missing or unreadable, or holds DoRA magnitudes or
            embedding adapters (named).
    """
    import ml_dtypes  # noqa: F401  (numpy's bfloat16 for safetensors)
    from safetensors import safe_open

    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {ADAPTER_WEIGHTS}"
                         + (" (adapter_model.bin, a pickle, is not read: save with safe_serialization=True)"
                            if (path / "adapter_model.bin").is_file() else ""))
    try:
        with safe_open(str(file), framework="numpy") as f:
            return {name: np.ascontiguousarray(f.get_tensor(name), dtype=np.float32) for name in f.keys()}
    except Exception as e:  # safetensors' own error types
        raise ValueError(f"cannot read {str(file)!r}: {e}") from e


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the value of the first key that matches
    the end of ``module``'s name (``q_proj``, ``layers.3.self_attn.q_proj``, a regex), else ``default``."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _fused_parts(model_class, config) -> dict[str, tuple[str, int, int, int]]:
    """Module name (``self_attn.q_proj``) -> (fused projection, its first output column, out, in)."""
    shapes = model_class.layer_shapes(config)
    parts = {}
    for fused, names in model_class.fused.items():
        offset = 0
        for name in names:
            n_out, n_in = shapes[name]
            parts[name.removesuffix(".weight")] = (fused, offset, n_out, n_in)
            offset += n_out
    return parts


def _fuse(mods: list, n_in: int, n_out: int, xp) -> LoRAWeights:
    """One fused projection's modules ``(column offset, A [r, in], B [out_m, r], scale)`` ->
    stacked ``A``, block-diagonal ``B.T`` and per-column scales (see the module docstring)."""
    rank = sum(a.shape[0] for _, a, _, _ in mods)
    a_all = np.zeros((rank, n_in), np.float32)
    b_all = np.zeros((rank, n_out), np.float32)
    scale = np.zeros(n_out, np.float32)
    r0 = 0
    for offset, a, b, s in mods:
        r = a.shape[0]
        a_all[r0:r0 + r] = a
        b_all[r0:r0 + r, offset:offset + b.shape[0]] = b.T
        scale[offset:offset + b.shape[0]] = s
        r0 += r
    return LoRAWeights(xp.asarray(a_all), xp.asarray(b_all), xp.asarray(scale))


class LoRABatch:
    """One step's rows grouped by adapter: ``groups`` is a list of ``(adapter, rows)``, ``rows``
    ``[n]`` int64 sorted row indices of the flat batch (rows of no adapter appear in no group).

    :meth:`apply` adds each group's adapter product to a projection's output
    (``y[rows] += ((x[rows] @ A.T) @ B.T) * scale``) through the layer ops."""

    def __init__(self, groups: list[tuple[LoRAAdapter, np.ndarray]]):
        self.groups = groups

    @classmethod
    def from_sequences(cls, scheduled, adapter_of) -> "LoRABatch | None":
        """The groups of ``scheduled`` (``(sequence, num_rows)`` in flat-batch order) whose
        sequences have a ``lora_request``; ``adapter_of(request)`` gives its
        :class:`LoRAAdapter`. None when no sequence has one (the base model's step)."""
        rows: dict[int, list[np.ndarray]] = {}
        adapters = {}
        start = 0
        for seq, n in scheduled:
            req = seq.lora_request
            if req is not None:
                rows.setdefault(req.lora_int_id, []).append(np.arange(start, start + n, dtype=np.int64))
                adapters[req.lora_int_id] = adapter_of(req)
            start += n
        if not rows:
            return None
        return cls([(adapters[i], np.concatenate(r)) for i, r in sorted(rows.items())])

    def apply(self, ops, y, x, layer: int, projection: str, first_row: int = 0) -> None:
        """Add the adapters' products of ``layer``'s fused ``projection`` to ``y [T, out]``
        for ``x [T, in]``, which hold the batch rows ``first_row .. first_row + T - 1``
        (a slice of the step, as the chunked MLP runs)."""
        count = x.shape[0]
        for adapter, rows in self.groups:
            w = adapter.layers[layer].get(projection)
            if w is None:
                continue
            if first_row or count < rows[-1] + 1:
                lo, hi = np.searchsorted(rows, [first_row, first_row + count])
                rows = rows[lo:hi] - first_row
                if rows.size == 0:
                    continue
            ops.add_lora(y, x, rows, w.a, w.b, w.scale)


class LoRAManager:
    """The adapters an engine has loaded, by ``lora_int_id`` (vLLM's worker LoRA manager,
    without eviction: an adapter stays loaded once used; its weights are ``r * (in + out)``
    floats per projection, small beside the model).

    Args:
        model: the base model (its class's ``fused`` map and ``layer_shapes``, its ``config``, ``xp``).
        max_lora_rank: the largest adapter rank allowed.
    """

    def __init__(self, model, max_lora_rank: int):
        self.model_class, self.config, self.xp = type(model), model.config, model.xp
        self.max_lora_rank = max_lora_rank
        self._adapters: dict[int, LoRAAdapter] = {}

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Load ``request``'s adapter unless its id is loaded already.

        Raises:
            ValueError: ``request`` is not a :class:`LoRARequest`; its id is loaded under
                another name or path; the adapter cannot be loaded (:class:`LoRAAdapter`).
        """
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        known = self._adapters.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, str(known.request.lora_path)) != (request.lora_name, str(request.lora_path)):
                raise ValueError(f"lora_int_id={request.lora_int_id} is loaded as {known.request.lora_name!r} "
                                 f"({known.request.lora_path}), not {request.lora_name!r} ({request.lora_path}): "
                                 "one id per adapter")
            return known
        adapter = LoRAAdapter(request, self.model_class, self.config, self.max_lora_rank, self.xp)
        self._adapters[request.lora_int_id] = adapter
        return adapter

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of ``request`` (added by :meth:`add` when its request was)."""
        return self._adapters[request.lora_int_id]

    def list_loras(self) -> list[LoRARequest]:
        """The requests of every loaded adapter, by id."""
        return [self._adapters[i].request for i in sorted(self._adapters)]
