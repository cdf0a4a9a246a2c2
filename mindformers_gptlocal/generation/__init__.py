"""Generation's host side, pure Python and numpy: the one table of defaults (``defaults.py``), options
(``loop.resolve_options``), sampling (``sampling.py``) and the decode loop (``loop.py``) over any step function.
Imports nothing from ``model/``; what runs the model (``generate``, the KV cache's compiled graphs) is
``runtime/``."""
from .loop import resolve_options

__all__ = ["resolve_options"]
