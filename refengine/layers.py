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


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` float32 of the rotary embedding.

    Supports the rope scaling types ``default`` (None), ``linear`` and ``llama3``.

    Source: ``_compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters``
    and ``_compute_llama3_parameters`` in transformers ``modeling_rope_utils.py``
    (Su et al. 2021, RoFormer §3.4).

    Raises:
        ValueError: an unsupported rope scaling type.
    """
    # float32 as transformers computes it, so angles round the same way.
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    factor = float(rope_scaling.get("factor", 1.0))
    if rope_type == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32)
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = (2 * math.pi / inv_freq).astype(np.float32)
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = ((old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding:
    """Rotary position embedding in the "rotate half" layout used by Hugging Face Llama.

    ``cos``/``sin`` tables ``[max_positions, head_dim // 2]`` float32 are built once; the
    angle ``position * inv_freq`` is rounded to float32 first, as transformers does.

    Source: ``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb`` in
    transformers ``models/llama/modeling_llama.py``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None, xp=np):
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
        self.cos = xp.asarray(np.cos(angles.astype(np.float64)).astype(np.float32))
        self.sin = xp.asarray(np.sin(angles.astype(np.float64)).astype(np.float32))
        self.max_positions = max_positions
        self.xp = xp

    def __call__(self, x, positions):
        """Rotate ``x [T, heads, head_dim]`` float32 by the angles of ``positions [T]`` int."""
        xp = self.xp
        half = x.shape[-1] // 2
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
