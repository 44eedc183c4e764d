"""The model registry: ``config.json``'s ``architectures`` -> the class that runs it.

Each family lives in its own module and owns everything specific to it: how its
``config.json`` is read, its checkpoint tensor names and shapes, how projections are fused,
and the forward pass. Adding an architecture means adding a module here and one line to
:data:`~refengine.models.registry.MODEL_REGISTRY` (README, "How to extend").
:mod:`~refengine.models.hf_config` reads ``config.json`` with the registry.
"""

from refengine.models.hf_config import model_config_from_dict, read_model_config
from refengine.models.registry import MODEL_REGISTRY, get_model_class, load_model

__all__ = ["MODEL_REGISTRY", "get_model_class", "load_model", "model_config_from_dict", "read_model_config"]
