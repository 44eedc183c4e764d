"""Build an attention backend by name: the one place that knows every backend module.

The contract every backend follows is in :mod:`refengine.attention`; the backends import it,
so choosing among them lives here, not in the package's ``__init__``.
"""

from __future__ import annotations

from refengine.attention import AttentionBackend

ATTENTION_BACKENDS = ("numpy", "numba", "cuda", "cuda-emulated")


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
    if name == "numba":
        from refengine.cpu.attention import NumbaAttention

        return NumbaAttention(batch_invariant=batch_invariant)
    if name == "cuda":
        from refengine.attention.cuda import CudaAttention

        return CudaAttention()
    if name == "cuda-emulated":
        from refengine.attention.cuda import EmulatedCudaAttention

        return EmulatedCudaAttention()
    raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
