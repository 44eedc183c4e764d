"""Build an attention backend by name: the one place that knows every backend module.

The contract every backend follows is in :mod:`refengine.attention`; the backends import it,
so choosing among them lives here, not in the package's ``__init__``.
"""

from __future__ import annotations

from typing import Callable

from refengine.attention import AttentionBackend

ATTENTION_BACKENDS = ("numpy", "numba", "cuda", "cuda-emulated")

#: Backends that live outside this package, by name: ``"numba"``, which the CPU wing
#: (:mod:`refengine.cpu`) registers as it is imported (``import refengine`` does).
_REGISTERED: dict[str, Callable[..., AttentionBackend]] = {}


def register_attention_backend(name: str, factory: Callable[..., AttentionBackend]) -> None:
    """Make ``get_attention_backend(name, batch_invariant=...)`` call ``factory(batch_invariant=...)``.

    Raises:
        ValueError: ``name`` is not one of :data:`ATTENTION_BACKENDS`.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
    _REGISTERED[name] = factory


def get_attention_backend(name: str, *, batch_invariant: bool = False) -> AttentionBackend:
    """Build the attention backend called ``name`` (one of :data:`ATTENTION_BACKENDS`);
    ``batch_invariant``: the numba backend's batch-invariant mode
    (:class:`refengine.cpu.attention.NumbaAttention`), which the others do not have.

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    if name == "numpy":
        from refengine.attention.numpy_ref import NumpyAttention

        return NumpyAttention()
    if name in _REGISTERED:
        return _REGISTERED[name](batch_invariant=batch_invariant)
    if name == "cuda":
        from refengine.attention.cuda import CudaAttention

        return CudaAttention()
    if name == "cuda-emulated":
        from refengine.attention.cuda import EmulatedCudaAttention

        return EmulatedCudaAttention()
    raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
