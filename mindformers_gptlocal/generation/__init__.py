"""Text generation: sampling (``sampling.py``), the decode loop (``loop.py``) and the ``generate`` method
causal LMs mix in (``mixin.py``). Imports nothing from ``model/``: it uses only the interface a causal
LM offers (``config``, ``kv_cache(batch, length)``, calling the model on token ids)."""
from .loop import resolve_options
from .mixin import GenerationMixin

__all__ = ["GenerationMixin", "resolve_options"]
