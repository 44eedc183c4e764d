"""The CPU wing's backends registered with the interfaces the engine calls: the numba layer ops
(:func:`refengine.ops.register_layer_ops`), the numba attention
(:func:`refengine.attention.selector.register_attention_backend`) and the compiled products of
the weight formats (:func:`refengine.quant.register_compiled_products`). ``import refengine``
imports this module; each backend module (and numba with it) is imported at its first use.
"""

from __future__ import annotations

from refengine.attention.selector import register_attention_backend
from refengine.ops import register_layer_ops
from refengine.quant import register_compiled_products


def _numba_ops(xp, kernels, *, batch_invariant: bool, activation_dtype: str):
    from refengine.cpu.layer_ops import NumbaOps

    return NumbaOps(batch_invariant=batch_invariant, activation_dtype=activation_dtype)


def _numba_attention(*, batch_invariant: bool):
    from refengine.cpu.attention import NumbaAttention

    return NumbaAttention(batch_invariant=batch_invariant)


def _gguf_products():
    from refengine.cpu import gguf_products

    return gguf_products


def _q8_products():
    from refengine.cpu import q8_products

    return q8_products


def _int_products():
    from refengine.cpu import int_products

    return int_products


register_layer_ops("numba", _numba_ops)
register_attention_backend("numba", _numba_attention)
register_compiled_products("gguf", _gguf_products)
register_compiled_products("q8", _q8_products)
register_compiled_products("int", _int_products)
