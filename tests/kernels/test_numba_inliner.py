"""numba's inliner with the scope shared (:func:`refengine.cpu.numba_support.share_scope_when_inlining`).

The patch changes how numba copies a callee's IR when it inlines it, never what it inlines:
a kernel built from ``inline="always"`` helpers (loops, branches on a constant, several call
sites, helpers inlined into helpers, as in the GGUF products) compiles to the same machine
code with and without it.
"""

from __future__ import annotations

import re

import numpy as np
from numba import njit
from numba.core import inline_closurecall

from refengine.cpu.numba_support import share_scope_when_inlining


def _build_kernel():
    """A fresh (uncompiled, uncached) kernel: two levels of ``inline="always"`` helpers."""

    @njit(inline="always")
    def scaled_sum(x, lo, hi, kind):
        s = 0.0
        for i in range(lo, hi):
            s += x[i] * 2.0 if kind == 1 else x[i]
        return s

    @njit(inline="always")
    def rows(x, out, kind):
        for j in range(out.shape[0]):
            if j % 2 == 0:
                out[j] = scaled_sum(x, 0, x.shape[0], kind)
            else:
                out[j] = scaled_sum(x, j, x.shape[0], kind) - scaled_sum(x, 0, j, kind)

    @njit
    def kernel(x, out):
        rows(x, out, 1)
        rows(x, out[::2], 0)

    return kernel


def _machine_code(kernel) -> tuple[np.ndarray, str]:
    """The kernel's output on a fixed input, and its assembly without symbol names and the
    sizes of the strings that hold them (each compile numbers its functions' names anew)."""
    x, out = np.arange(10, dtype=np.float64), np.zeros(6)
    kernel(x, out)
    asm = re.sub(r"[\w.$<>]*_build_kernel[\w.$<>@]*", "NAME", kernel.inspect_asm(kernel.signatures[0]))
    return out, "\n".join(line for line in asm.splitlines() if not line.startswith("\t.size"))


def test_inlined_kernels_compile_to_the_same_code_with_the_scope_shared(monkeypatch):
    assert share_scope_when_inlining() and share_scope_when_inlining()  # patched once, however often asked
    patched = inline_closurecall.InlineWorker.inline_ir
    assert patched.shares_scope and not hasattr(patched.__wrapped__, "shares_scope")
    with monkeypatch.context() as m:
        m.setattr(inline_closurecall.InlineWorker, "inline_ir", patched.__wrapped__)  # numba's own
        out_before, asm_before = _machine_code(_build_kernel())
    out_after, asm_after = _machine_code(_build_kernel())
    assert inline_closurecall.InlineWorker.inline_ir is patched
    # x = 0..9: rows of kind 1 (doubled) then, over every other output, kind 0: out[j] is
    # sum(x) for even j, sum(x[j:]) - sum(x[:j]) for odd j (doubled where kind 1 stays)
    expected = [45.0, 2 * (45 - 0), 45 - 0, 2 * (42 - 3), 45.0, 2 * (35 - 10)]
    np.testing.assert_array_equal(out_before, expected)
    np.testing.assert_array_equal(out_after, expected)
    assert asm_after == asm_before
