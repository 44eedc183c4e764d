"""refengine: a readable, correctness-first LLM inference engine.

Start at :class:`refengine.core.engine.LLM` (offline generation) or
:class:`refengine.core.engine.LLMEngine` (add_request / step / abort). Importing the package
changes nothing process-wide; :func:`refengine.cpu.setup_cpu_runtime` does, explicitly.
"""

import refengine.cpu.backends  # noqa: F401  the CPU wing registers its backends (nothing process-wide)
from refengine.beam_search import BeamSearchParams
from refengine.lora import LoRARequest
from refengine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "LoRARequest", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import refengine` stays light for the CLI and converters
    if name in ("LLM", "LLMEngine"):
        from refengine.core import engine

        return getattr(engine, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from refengine.core import sequence

        return getattr(sequence, name)
    raise AttributeError(name)
