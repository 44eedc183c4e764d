"""refengine: a readable, correctness-first LLM inference engine.

Start at :class:`refengine.engine.LLM` (offline generation) or
:class:`refengine.engine.LLMEngine` (add_request / step / abort).
"""

import os as _os
import sys as _sys

if "numpy" not in _sys.modules:  # OpenBLAS reads this once, as NumPy loads it (see refengine/threads.py)
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from refengine.beam_search import BeamSearchParams  # noqa: E402
from refengine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import refengine` stays light for the CLI and converters
    if name in ("LLM", "LLMEngine"):
        from refengine import engine

        return getattr(engine, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from refengine import sequence

        return getattr(sequence, name)
    raise AttributeError(name)
