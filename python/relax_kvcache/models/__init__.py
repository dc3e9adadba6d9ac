"""Example models built on the frontend (used by ``relax-kvcache demo`` and the tests).

``models.llama`` (the ``tvm.relax.frontend.nn`` model) needs TVM's compiler; the config, the
weights and the numpy reference here do not.
"""

from .config import LlamaConfig, random_weights
from .llama_numpy import LlamaNumpy

__all__ = ["LlamaConfig", "LlamaNumpy", "random_weights"]
