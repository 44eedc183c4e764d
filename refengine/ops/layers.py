"""The small building blocks of a Llama-family layer, over an array module ``xp``.

Each function mirrors the Hugging Face implementation named in its docstring, in float32.
"""

from __future__ import annotations

import math

import numpy as np


def rms_norm(x, weight, eps: float, xp=np):
    """RMSNorm: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    Args:
        x: ``[..., d]`` float32.
        weight: ``[d]`` float32.
    Returns:
        ``[..., d]`` float32.

    Source: ``LlamaRMSNorm`` in transformers ``models/llama/modeling_llama.py``
    (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4).
    """
    variance = xp.mean(x * x, axis=-1, keepdims=True)
    return (x * (1.0 / xp.sqrt(variance + eps))) * weight


def silu_and_mul(gate_up, xp=np):
    """SwiGLU activation: ``silu(gate) * up`` where ``gate_up = [gate | up]`` on the last axis.

    Args:
        gate_up: ``[T, 2 * intermediate]`` float32 (gate first, as the fused projection stores it).
    Returns:
        ``[T, intermediate]`` float32.

    Source: ``LlamaMLP.forward`` (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6).
    """
    d = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :d], gate_up[..., d:]
    return gate / (1.0 + xp.exp(-gate)) * up


def gelu_tanh_and_mul(gate_up, xp=np):
    """GeGLU with the tanh GELU: ``gelu_tanh(gate) * up`` where ``gate_up = [gate | up]``,
    ``gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``.

    Args:
        gate_up: ``[T, 2 * intermediate]`` float32 (gate first).
    Returns:
        ``[T, intermediate]`` float32.

    Source: ``GemmaMLP``/``Gemma3MLP`` with ``hidden_activation="gelu_pytorch_tanh"``
    (``torch.nn.functional.gelu(approximate="tanh")``; Hendrycks & Gimpel 2016, §2;
    Shazeer 2020, "GLU Variants Improve Transformer", eq. 5).
    """
    d = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :d], gate_up[..., d:]
    c = np.float32(math.sqrt(2.0 / math.pi))
    inner = c * (gate + np.float32(0.044715) * gate * gate * gate)
    return np.float32(0.5) * gate * (np.float32(1.0) + xp.tanh(inner)) * up


def _default_inv_freq(head_dim: int, base) -> np.ndarray:
    """``1 / base ** (2i / head_dim)`` for ``i < head_dim // 2``: ``[head_dim // 2]`` float32,
    in float32 steps as transformers does (``base`` and the exponent rounded to float32 first).

    The power is the correctly rounded float32 of the exact one (:func:`pow_f32`), the same
    bits on every CPU: NumPy's float32 ``power`` is a SIMD routine
    chosen by the CPU (on AVX-512 it is one ulp off in about a fifth of these entries, which
    moved Gemma 3's long-context logits by 1e-2 against transformers)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / pow_f32(base, exponent)).astype(np.float32)


def pow_f32(base, exponent: np.ndarray) -> np.ndarray:
    """``float32(base) ** exponent`` (float32 ``[n]``) correctly rounded to float32, the same
    bits on every CPU (libm's float64 ``pow``, then rounded; see :func:`_default_inv_freq`)."""
    b = float(np.float32(base))
    return np.array([math.pow(b, float(e)) for e in np.asarray(exponent, dtype=np.float32)]).astype(np.float32)


def _rope_key(rope_scaling: dict, key: str):
    """``rope_scaling[key]``, or a ValueError naming the rope type and the missing key."""
    value = rope_scaling.get(key)
    if value is None:
        raise ValueError(f"rope scaling type {rope_scaling.get('rope_type')!r} needs {key!r}")
    return value


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(head_dim: int, theta: float, rope_scaling: dict | None, *,
                     max_model_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the attention factor (a float that
    multiplies cos and sin) of the rotary embedding.

    Rope scaling types (``rope_scaling["rope_type"]``; None is ``default``):

    * ``default``, ``linear`` (``factor``), ``llama3`` (``factor``, ``low_freq_factor``,
      ``high_freq_factor``, ``original_max_position_embeddings``): attention factor 1.
    * ``dynamic`` (dynamic NTK; ``factor``, ``original_max_position_embeddings``: the length
      beyond which the base grows, which is transformers' ``config.max_position_embeddings``;
      :func:`refengine.models.hf_config.model_config_from_dict` stores it under that key).
      transformers recomputes the base in every forward from the current length ``L``
      (``dynamic_rope_update``): ``theta * (factor * L / original - (factor - 1)) **
      (d / (d - 2))`` once ``L > original``. A KV cache holds keys rotated at earlier steps and
      a batch shares one table, so the engine uses one static length instead:
      ``L = max(max_model_len, original)``, the frequencies transformers uses when the
      sequence reaches ``max_model_len`` (vLLM likewise builds its dynamic-NTK table once,
      for its maximum length). Up to ``original`` tokens that is the plain RoPE; beyond, a
      sequence shorter than ``max_model_len`` differs from transformers, which would use a
      smaller base for it. Past ``original`` the base is computed in float32, as
      transformers' forward does (its length is a tensor there); at ``original`` in
      Python floats, as its initialisation does.
    * ``yarn`` (``factor``, ``original_max_position_embeddings``; optional ``beta_fast``
      (32), ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``, ``attention_factor``,
      ``truncate`` (True)): interpolation by ``factor`` on the low-frequency dimensions,
      none on the high-frequency ones, a linear ramp between (NTK-by-parts; Peng et al. 2023,
      "YaRN", §3.2-3.4). Attention factor: ``attention_factor``, else
      ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set (nonzero),
      else ``0.1 ln(factor) + 1``. Static in transformers too. As there, a falsy ``beta_fast``
      / ``beta_slow`` takes the default and ``truncate`` is read as truthy/falsy.
    * ``longrope`` (Phi-3; ``short_factor``, ``long_factor``: ``head_dim // 2`` numbers each,
      ``original_max_position_embeddings``, ``factor`` (the parser fills in
      ``max_position_embeddings / original`` when absent), optional ``attention_factor``):
      ``inv_freq = 1 / (ext * theta ** (2i / d))`` with ``ext`` the short or the long factors.
      Attention factor: ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))``
      (1 for ``factor <= 1``). transformers switches from short to long factors once the
      current length exceeds ``original`` (``dynamic_rope_update``); the engine decides once:
      long factors when ``max_model_len > original``, else short ones (llama.cpp's rule: long
      factors when its context exceeds the original one). So a context allowed past
      ``original`` rotates short prompts with the long factors too, unlike transformers.

    Args:
        head_dim: the rotated size (even; the whole head: partial rotary is not supported).
        theta: the RoPE base (``rope_theta``).
        rope_scaling: None, or the dict :func:`refengine.models.hf_config.model_config_from_dict`
            checked (``rope_type`` normalised).
        max_model_len: the longest context the engine allows (``dynamic`` and ``longrope``
            read it); None: transformers' values at initialisation (no dynamic growth,
            ``longrope``'s short factors).
    Returns:
        ``(inv_freq [head_dim // 2] float32, attention_factor float)``.

    Source: ``ROPE_INIT_FUNCTIONS`` in transformers ``modeling_rope_utils.py``
    (``_compute_default_rope_parameters`` of ``LlamaRotaryEmbedding``,
    ``_compute_linear_scaling_rope_parameters``, ``_compute_dynamic_ntk_parameters``,
    ``_compute_yarn_parameters``, ``_compute_longrope_parameters``, ``_compute_llama3_parameters``)
    and its ``dynamic_rope_update``; Su et al. 2021, RoFormer §3.4.

    Raises:
        ValueError: an unsupported rope scaling type, or a key the type needs is missing.
    """
    f32 = np.float32
    if rope_scaling is None:
        return _default_inv_freq(head_dim, theta), 1.0
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return _default_inv_freq(head_dim, theta), 1.0
    if rope_type == "linear":
        return (_default_inv_freq(head_dim, theta) / f32(_rope_key(rope_scaling, "factor"))).astype(f32), 1.0
    if rope_type == "dynamic":
        factor = float(_rope_key(rope_scaling, "factor"))
        original = int(_rope_key(rope_scaling, "original_max_position_embeddings"))
        seq_len = max(original if max_model_len is None else int(max_model_len), original)
        exponent = head_dim / (head_dim - 2)
        if seq_len > original:  # transformers' forward: float32 tensors (torch raises a float32
            # tensor to a Python float's power in float64, then rounds)
            growth = f32(factor) * f32(seq_len) / f32(original) - f32(factor - 1)
            base = f32(theta) * f32(float(growth) ** exponent)
        else:  # transformers' initialisation: Python floats (growth 1, up to rounding)
            base = theta * (factor * seq_len / original - (factor - 1)) ** exponent
        return _default_inv_freq(head_dim, base), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, theta, rope_scaling)
    if rope_type == "longrope":
        original = int(_rope_key(rope_scaling, "original_max_position_embeddings"))
        factor = float(_rope_key(rope_scaling, "factor"))
        attention_factor = rope_scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        use_long = max_model_len is not None and max_model_len > original
        ext = np.asarray(_rope_key(rope_scaling, "long_factor" if use_long else "short_factor"), dtype=f32)
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
        inv_freq = (f32(1.0) / (ext * pow_f32(theta, exponent))).astype(f32)
        return inv_freq, float(attention_factor)
    if rope_type == "llama3":
        return _llama3_inv_freq(head_dim, theta, rope_scaling), 1.0
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, dynamic, yarn, "
                     "longrope, llama3")


def _yarn_frequencies(head_dim: int, theta: float, rope_scaling: dict) -> tuple[np.ndarray, float]:
    """YaRN's ``(inv_freq [head_dim // 2] float32, attention_factor)``: see :func:`rope_frequencies`.
    Source: ``_compute_yarn_parameters`` in transformers ``modeling_rope_utils.py``."""
    f32 = np.float32
    factor = float(_rope_key(rope_scaling, "factor"))
    original = int(_rope_key(rope_scaling, "original_max_position_embeddings"))
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength turns ``rotations`` times over ``original`` positions."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
    keep = f32(1) - ramp  # 1: extrapolate (plain RoPE), 0: interpolate by `factor`
    pos_freqs = pow_f32(theta, np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim))
    extrapolated = f32(1.0) / pos_freqs
    interpolated = f32(1.0) / (f32(factor) * pos_freqs)
    inv_freq = interpolated * (f32(1) - keep) + extrapolated * keep
    return inv_freq.astype(f32), float(attention_factor)


def _llama3_inv_freq(head_dim: int, theta: float, rope_scaling: dict) -> np.ndarray:
    """Llama 3.1's inverse frequencies ``[head_dim // 2]`` float32: long wavelengths slowed by
    ``factor``, short ones kept, the band between blended. Source: ``_compute_llama3_parameters``."""
    inv_freq = _default_inv_freq(head_dim, theta)
    factor = float(_rope_key(rope_scaling, "factor"))
    low_freq_factor = float(_rope_key(rope_scaling, "low_freq_factor"))
    high_freq_factor = float(_rope_key(rope_scaling, "high_freq_factor"))
    old_context_len = float(_rope_key(rope_scaling, "original_max_position_embeddings"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None, *,
                  max_model_len: int | None = None) -> np.ndarray:
    """The inverse frequencies ``[head_dim // 2]`` float32 of :func:`rope_frequencies`
    (without its attention factor). Raises its ValueErrors."""
    return rope_frequencies(head_dim, theta, rope_scaling, max_model_len=max_model_len)[0]


class RotaryEmbedding:
    """Rotary position embedding in the "rotate half" layout used by Hugging Face Llama.

    ``cos``/``sin`` tables ``[max_positions, head_dim // 2]`` float32 are built once, a
    chunk of rows at a time (the models make ``max_positions`` the engine's
    ``max_model_len``, :class:`refengine.models.llama.LlamaForCausalLM`); the
    angle ``position * inv_freq`` is rounded to float32 first, as transformers does, and
    the tables carry the attention factor of :func:`rope_frequencies` (YaRN's and longrope's
    mscale; 1 otherwise), as transformers multiplies it into cos and sin. Every layer-op
    backend reads these tables, so each gets the factor.

    Args:
        head_dim: the rotated size (even).
        max_positions: table rows (positions ``0 .. max_positions - 1``).
        theta: the RoPE base.
        rope_scaling: None or the checked dict (see :func:`rope_frequencies`).
        xp: the array module the tables live in.
        max_model_len: keyword only; the longest context the engine allows, which fixes
            ``dynamic``'s base and ``longrope``'s short/long choice once (see
            :func:`rope_frequencies`); default ``max_positions``. 1 <= it <= ``max_positions``.

    Attributes: ``cos``, ``sin`` (``xp`` arrays), ``inv_freq`` (NumPy ``[head_dim // 2]``
    float32), ``attention_factor``, ``max_positions``, ``max_model_len``, ``xp``.

    Raises:
        ValueError: ``max_model_len`` outside ``[1, max_positions]``; those of
            :func:`rope_frequencies`.

    Source: ``LlamaRotaryEmbedding`` (with ``dynamic_rope_update``) and ``apply_rotary_pos_emb``
    in transformers ``models/llama/modeling_llama.py``.
    """

    _ROWS_PER_CHUNK = 1 << 16

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None, xp=np, *,
                 max_model_len: int | None = None):
        max_model_len = max_positions if max_model_len is None else max_model_len
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, np.integer)) \
                or not 1 <= max_model_len <= max_positions:
            raise ValueError(f"max_model_len must be an integer in [1, max_positions={max_positions}] "
                             f"(the RoPE tables' rows), got {max_model_len!r}")
        inv_freq, attention_factor = rope_frequencies(head_dim, theta, rope_scaling, max_model_len=int(max_model_len))
        cos = np.empty((max_positions, inv_freq.size), dtype=np.float32)
        sin = np.empty_like(cos)
        for start in range(0, max_positions, self._ROWS_PER_CHUNK):  # float64 temporaries of one chunk only
            stop = min(start + self._ROWS_PER_CHUNK, max_positions)
            # float32 positions times float32 inv_freq, as transformers' `position_ids.float() @ inv_freq`
            angles = np.arange(start, stop).astype(np.float32)[:, None] * inv_freq[None, :]
            cos[start:stop] = np.cos(angles.astype(np.float64))
            sin[start:stop] = np.sin(angles.astype(np.float64))
            if attention_factor != 1.0:  # float32 products, as transformers' `cos() * attention_scaling`
                cos[start:stop] *= np.float32(attention_factor)
                sin[start:stop] *= np.float32(attention_factor)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)
        self.inv_freq, self.attention_factor = inv_freq, float(attention_factor)
        self.max_positions, self.max_model_len = max_positions, int(max_model_len)
        self.xp = xp

    def __call__(self, x, positions):
        """Rotate ``x [T, heads, head_dim]`` float32 by the angles of ``positions [T]`` int."""
        xp = self.xp
        half = x.shape[-1] // 2
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
